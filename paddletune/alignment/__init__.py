"""Preference alignment: DPO and KTO on the one Trainer (llm/alignment/dpo/run_dpo.py,
llm/alignment/kto/run_kto.py).

    args.py   PaddleNLP's DPO / KTO keys on top of paddletune.args
    data.py   preference rows (PaddleNLP's, TRL's) -> tokenised pairs / KTO examples -> batches
              (two sequences per pair or example: prompt + each response; padded or packed)
    loss.py   per-sequence log-probabilities (vocabulary shards under TP), the DPO losses, KTO,
              the reference (a frozen copy, the model with its LoRA adapters off, or none)
"""
