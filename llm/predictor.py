"""Generate answers with a fine-tuned model (PaddleNLP's llm/predictor.py keys).

    python llm/predictor.py --model_name_or_path OUT --data_file dev.json --output_file out.json --batch_size 8
    python llm/predictor.py --model_name_or_path BASE --lora_path OUT --chat     # interactive, with history
    python llm/predictor.py --model_name_or_path LORA_OUT --chat                 # an adapter dir: its base + it
    python llm/predictor.py args.json [--key value ...]                           # keys from a JSON file
    python -m paddle.distributed.launch --nproc_per_node 2 llm/predictor.py --model_name_or_path OUT \
        --tensor_parallel_degree 2 --data_file dev.json --output_file out.json   # model split over 2 ranks

data_file: JSON lines {"src": str or [rounds], "tgt": optional}; output_file gets JSON lines
{"src", "tgt", "output"} (written atomically at the end; without output_file they go to stdout).
By default the checkpoint's chat template is applied with `src` as one user turn (a list of
rounds `src` with `tgt` as earlier answers), as PaddleNLP's predictor does; --chat_template none
feeds `src` as raw text. Tokens per second are printed at the end.
--chat reads one user message per stdin line and prints each answer on one line ("\\n" inside an
answer is written as a space); "/reset" clears the history, "/exit" or end of input stops.
Every input is checked before the model is loaded.
With tensor_parallel_degree N (launched on N processes) each rank loads its slice of the model and
the ranks generate together (the same ids on every rank); only rank 0 prints and writes.
"""
import dataclasses
import io
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

try:
    import paddletune  # noqa: F401
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import paddletune  # noqa: F401

from paddletune import cli, runtime
from paddletune.args import ArgumentError, F, _convert, read_argv
from paddletune.data.sft import DataError, read_json_lines

DEFAULT_PROMPTS = ["Reverse the words: apple river stone", "解释一下“温故而知新”"]


@dataclass
class PredictorArgument:
    model_name_or_path: str = F(None, "checkpoint directory (HF format) or a built-in name such as paddletune/tiny-llama")
    tokenizer_name_or_path: Optional[str] = F(None, "tokenizer directory when it differs from the model's")
    lora_path: Optional[str] = F(None, "LoRA adapter directory (adapter_config.json + adapter_model.safetensors) applied on the model")
    prefix_path: Optional[str] = F(None, "prefix-tuning directory applied on the model")
    chat_template: Optional[str] = F(None, "chat template: a built-in name, a .jinja / chat_template.json file, a directory holding chat_template.json, or 'none' for raw src; default: the checkpoint's")
    chat: bool = F(False, "interactive multi-turn chat on stdin/stdout with history ('/reset' clears, '/exit' ends)")
    max_history_turns: int = F(-1, "--chat: earlier turns (question + answer) each answer sees: -1 = all that fit src_length (oldest dropped first), 0 = none (each line alone)")
    data_file: Optional[str] = F(None, "JSON lines with \"src\" (and optional \"tgt\"); default: two built-in prompts")
    output_file: Optional[str] = F(None, "where JSON lines {src, tgt, output} go (default: stdout)")
    batch_size: int = F(1, "prompts generated together (left padding)")
    src_length: int = F(1024, "max prompt tokens; longer prompts lose their oldest rounds / leftmost tokens")
    max_length: int = F(1024, "max NEW tokens per answer (PaddleNLP's meaning of max_length here)")
    decode_strategy: str = F("sampling", "sampling or greedy_search", choices=["sampling", "greedy_search"])
    top_k: int = F(0, "sampling: keep the k most likely tokens (0 = no limit; 1 = greedy)")
    top_p: float = F(0.7, "sampling: keep the smallest set of tokens whose probability reaches top_p")
    temperature: float = F(0.95, "sampling: divide logits by this (> 0)")
    repetition_penalty: float = F(1.0, "penalise tokens already in prompt or answer (1 = off)")
    seed: int = F(42, "sampling seed: the same seed and inputs give the same outputs")
    device: str = F("auto", "auto, cpu or gpu", choices=["auto", "cpu", "gpu"])
    dtype: Optional[str] = F(None, "model dtype: float32, float16, bfloat16 or float64 (default: the checkpoint's torch_dtype); float16 / bfloat16 compute in float32 on CPU", choices=[None, "float32", "float16", "bfloat16", "float64"])
    tensor_parallel_degree: int = F(1, "ranks the model is split over (tensor parallel); launch that many processes: python -m paddle.distributed.launch --nproc_per_node N llm/predictor.py ...")
    mode: str = F("dynamic", "dynamic (eager) predictor; static graphs are not built here", choices=["dynamic"])


FIELDS = {f.name: f for f in dataclasses.fields(PredictorArgument)}


def help_text():
    lines = ["usage: python llm/predictor.py [ARGS.json] [--key value ...]", "", __doc__.strip(), "", "keys:"]
    for name, f in FIELDS.items():
        lines.append(f"  --{name} (default {f.default})")
        lines.append(f"      {f.metadata['help']}")
    return "\n".join(lines)


def parse(argv):
    """argv -> PredictorArgument; raises ArgumentError on an unknown key or bad value."""
    import difflib

    argv = list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        raise SystemExit(0)
    values, sources = read_argv(argv, lambda k: k in FIELDS and FIELDS[k].type in (bool, "bool"))
    kwargs = {}
    for k, v in values.items():
        if k not in FIELDS:
            near = difflib.get_close_matches(k, list(FIELDS), n=1)
            hint = f"; did you mean '{near[0]}'?" if near else "; see --help"
            raise ArgumentError(f"{sources[k]}: unknown key '{k}'{hint}")
        f = FIELDS[k]
        kwargs[k] = _convert(k, v, f, sources[k])
        choices = f.metadata["choices"]
        if choices and kwargs[k] not in choices:
            raise ArgumentError(f"{sources[k]}: '{k}' must be one of {choices}, got {kwargs[k]!r}")
        if f.metadata["status"] == "no_effect" and kwargs[k] != f.default:
            runtime.warn_once(k, "'%s: %s' has no effect here: %s", k, kwargs[k], f.metadata["why"])
    return PredictorArgument(**kwargs)


def read_data(path):
    """[(src, tgt)] from JSON lines; src is a string or a list of rounds (tgt then lists the
    earlier answers). Errors name the file and line."""
    if not os.path.isfile(path):
        raise ArgumentError(f"data_file={path!r} not found (working directory {os.getcwd()})")
    rows = []
    try:
        lines = list(read_json_lines(path))
    except DataError as e:
        raise ArgumentError(str(e)) from None
    for n, row in lines:
        src, tgt = row.get("src"), row.get("tgt", "")
        if not (isinstance(src, str) or (isinstance(src, list) and src and all(isinstance(s, str) for s in src))):
            raise ArgumentError(f"{path}:{n}: needs \"src\": a string or a list of strings, got {row!r:.80}")
        if isinstance(src, list) and not (isinstance(tgt, list) and len(tgt) >= len(src) - 1
                                          and all(isinstance(t, str) for t in tgt)):
            raise ArgumentError(f"{path}:{n}: a list \"src\" (rounds) needs a list \"tgt\" holding "
                                f"at least the {len(src) - 1} earlier answers")
        rows.append((src, tgt))
    if not rows:
        raise ArgumentError(f"data_file {path} has no rows")
    return rows


def conversation_of(src, tgt):
    """A string src is one user turn; a list of rounds becomes PaddleNLP pairs
    [[q1, a1], ..., [q_last]] with the earlier answers a_i = tgt[i]."""
    if isinstance(src, str):
        return src
    return [[q, tgt[i]] for i, q in enumerate(src[:-1])] + [[src[-1]]]


def adapter_as_model(a):
    """--model_name_or_path naming an adapter directory means its base with that adapter, as if
    --lora_path / --prefix_path had been given (loading.adapter_as_model)."""
    from paddletune.loading import adapter_as_model as apply

    try:
        apply(a)
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def base_from_adapter(a):
    """--lora_path / --prefix_path DIR without --model_name_or_path: the base the adapter names
    (adapter_config.json's base_model_name_or_path, or the built-in it records), as
    llm/merge_lora_params.py finds it."""
    adapter = a.lora_path or a.prefix_path
    if a.model_name_or_path or not adapter:
        return
    conf_path = os.path.join(adapter, "adapter_config.json")
    if not os.path.isfile(conf_path):
        raise ArgumentError(f"{adapter} has no adapter_config.json to name its base; give --model_name_or_path BASE")
    from paddletune.peft.merge import resolve_base

    with open(conf_path) as f:
        conf = json.load(f)
    try:
        a.model_name_or_path = resolve_base(adapter, conf)
    except (ValueError, FileNotFoundError) as e:
        raise ArgumentError(f"{e}; give --model_name_or_path BASE") from None
    logging.getLogger("paddletune").info("base model from %s: %s", conf_path, a.model_name_or_path)


def check(a):
    """Everything that can be checked without the model; returns (model dir, tokenizer, rows)."""
    from paddletune.generation import GenerationConfig
    from paddletune.models import check_checkpoint, check_tokenizer, load_config, resolve_model_path
    from paddletune.outdir import check_writable_file
    from paddletune.loading import load_tokenizer

    base_from_adapter(a)
    if not a.model_name_or_path:
        raise ArgumentError("'model_name_or_path' is required (a checkpoint directory or a built-in name)")
    if a.max_history_turns < -1:
        raise ArgumentError(f"'max_history_turns' must be -1 (all), 0 (none) or a number of turns, got {a.max_history_turns}")
    for key in ("batch_size", "src_length", "max_length"):
        if getattr(a, key) <= 0:
            raise ArgumentError(f"'{key}' must be positive, got {getattr(a, key)}")
    try:
        GenerationConfig(max_new_tokens=a.max_length, decode_strategy=a.decode_strategy,
                         temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                         repetition_penalty=a.repetition_penalty).validate()
    except ValueError as e:
        raise ArgumentError(str(e).replace("generation: ", "")) from None
    if a.chat and a.data_file:
        raise ArgumentError("use either --chat (stdin) or --data_file, not both")
    check_launch(a)
    for key in ("lora_path", "prefix_path"):
        p = getattr(a, key)
        if p and not os.path.isdir(p):
            raise ArgumentError(f"{key}={p!r} is not a directory")
    if a.device == "gpu" and runtime.device() != "gpu":
        raise ArgumentError("device=gpu but paddle sees no GPU here; use --device cpu (or auto)")
    if a.output_file and os.path.isdir(a.output_file):
        raise ArgumentError(f"output_file={a.output_file!r} is a directory; give a file name")
    if a.output_file:   # a test write now, not a lost generation run at the end
        check_writable_file(a.output_file, "output_file")
    adapter_as_model(a)
    path = resolve_model_path(a.model_name_or_path)
    spec, config = load_config(path)
    tok = load_tokenizer(a.tokenizer_name_or_path or path)
    check_tokenizer(config, tok, path)
    check_checkpoint(path, config)
    t = a.chat_template
    if t is not None and os.path.isdir(t):   # PaddleNLP: a directory holding chat_template.json
        t = os.path.join(t, "chat_template.json")
        if not os.path.isfile(t):
            raise ArgumentError(f"chat_template={a.chat_template!r}: no chat_template.json in that directory")
    if t is not None:
        tok.set_chat_template(t)
    if a.chat and tok.template is None and t is None:
        if spec.default_chat_template is None:
            raise ArgumentError("--chat needs a chat template: the checkpoint has none; pass --chat_template "
                                "with a built-in name (llama2, llama3, chatml, ...) or a template file")
        # the model family's usual template (ModelSpec.default_chat_template), said out loud
        runtime.logger.warning("the checkpoint has no chat template: --chat uses %r, this model "
                               "family's default (pass --chat_template to choose)", spec.default_chat_template)
        tok.set_chat_template(spec.default_chat_template)
    rows = read_data(a.data_file) if a.data_file else [(p, "") for p in DEFAULT_PROMPTS]
    if tok.template is None and any(not isinstance(s, str) for s, _ in rows):
        raise ArgumentError(f"{a.data_file}: \"src\" lists (several rounds) need a chat template")
    return path, tok, rows


def check_launch(a):
    """The launched processes must be the tensor-parallel ranks (data-parallel prediction is not
    built: every rank would answer every prompt)."""
    from paddletune.parallel import world_from_env

    tp = 1 if a.tensor_parallel_degree in (-1, 0, 1) else a.tensor_parallel_degree
    if a.tensor_parallel_degree < -1:
        raise ArgumentError(f"'tensor_parallel_degree' must be >= 1, got {a.tensor_parallel_degree}")
    world, _ = world_from_env()
    launch = (f"python -m paddle.distributed.launch --nproc_per_node {tp} llm/predictor.py "
              f"... --tensor_parallel_degree {tp}")
    if world == 1 and tp > 1:
        raise ArgumentError(f"tensor_parallel_degree={tp} needs {tp} processes, one per slice of the "
                            f"model; launch them with: {launch}")
    if world != tp:
        raise ArgumentError(f"launched on {world} processes with tensor_parallel_degree={tp}: the "
                            f"processes must be the tensor-parallel ranks; use {launch}")
    if tp > 1 and a.chat:
        raise ArgumentError("--chat reads stdin on one process; with tensor_parallel_degree > 1 use "
                            "--data_file")


def chat_loop(a, model, tok, cfg, stdin, stdout):
    """One user message per line; answers on one line each. Returns (new tokens, seconds)."""
    from paddletune.generation import generate
    from paddletune.text_generation import encode_prompt

    history, tokens, seconds = [], 0, 0.0
    keep = history_turns(a, tok)
    if stdin.isatty():
        print("chat: type a message; /reset clears the history, /exit ends", file=stdout, flush=True)
    for line in stdin:
        text = line.rstrip("\n")
        if text.strip() in ("/exit", "/quit"):
            break
        if text.strip() == "/reset":
            history = []
            print("(history cleared)", file=stdout, flush=True)
            continue
        if not text.strip():
            continue
        msgs = (history[-2 * keep:] if keep > 0 else [] if keep == 0 else history) + [
            {"role": "user", "content": text}]
        # --chat_template none: each line is raw text for the model (no template, no history)
        prompt = (encode_prompt(tok, msgs, True, a.src_length) if tok.template is not None
                  else encode_prompt(tok, text, False, a.src_length))
        out = generate(model, [prompt], cfg, tokenizer=tok)
        reply = out.texts[0]
        tokens, seconds = tokens + out.num_new_tokens, seconds + out.seconds
        print(reply.replace("\n", " "), file=stdout, flush=True)
        history = msgs + [{"role": "assistant", "content": reply}]
    return tokens, seconds


def history_turns(a, tok):
    """Earlier turns each chat answer sees (-1: all that fit), said once, since a model trained on
    single turns (the built-ins' plain template) answers differently with earlier turns before."""
    keep = a.max_history_turns if tok.template is not None else 0
    log = logging.getLogger("paddletune")
    if keep == 0:
        log.info("chat: each line is answered alone, without earlier turns%s",
                 " (--chat_template none)" if tok.template is None else " (--max_history_turns 0)")
    else:
        log.info("chat: each answer sees %s earlier turns (--max_history_turns N to limit, 0 for none; "
                 "/reset clears them)", "all the" if keep < 0 else f"up to {keep}")
    return keep


def predict(a, model, tok, cfg, rows):
    """Generate for every row, batch_size at a time. Returns (records, new tokens, seconds)."""
    from paddletune.generation import generate
    from paddletune.text_generation import encode_prompt

    use_template = tok.template is not None
    records, tokens, seconds = [], 0, 0.0
    for i in range(0, len(rows), a.batch_size):
        chunk = rows[i:i + a.batch_size]
        prompts = [encode_prompt(tok, conversation_of(s, t), use_template, a.src_length) for s, t in chunk]
        out = generate(model, prompts, cfg, tokenizer=tok)
        tokens, seconds = tokens + out.num_new_tokens, seconds + out.seconds
        records += [{"src": s, "tgt": t, "output": o} for (s, t), o in zip(chunk, out.texts)]
    return records, tokens, seconds


def reference_metrics(records):
    """'metrics on N rows with a tgt: exact match E, BLEU-4 B, ROUGE-L R' for the rows whose tgt
    is the reference answer (a string; for a list of rounds, its entry for the last round), or
    None. Exact match compares stripped strings; BLEU-4 (corpus) and ROUGE-L F1 are
    trainer/metrics.py's, on lower-cased words (each CJK character a word)."""
    from paddletune.trainer.metrics import generation_metrics

    pairs = []
    for r in records:
        t = r["tgt"]
        ref = t[-1] if isinstance(t, list) and isinstance(r["src"], list) and len(t) == len(r["src"]) else t
        if isinstance(ref, str) and ref.strip():
            pairs.append((r["output"], ref))
    if not pairs:
        return None
    m = generation_metrics([p for p, _ in pairs], [g for _, g in pairs])
    exact = sum(p.strip() == g.strip() for p, g in pairs) / len(pairs)
    return (f"metrics on {len(pairs)} rows with a tgt: exact match {exact:.4f}, BLEU-4 {m['bleu4']:.4f}, "
            f"ROUGE-L {m['rougel']:.4f}")


@cli.entry   # errors anywhere below: one `error:` line, exit 2 (PADDLETUNE_DEBUG=1: traceback)
def main(argv=None, stdin=None, stdout=None):
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    runtime.setup_logging(stream=sys.stderr)   # stdout carries the answers only
    try:
        a = parse(sys.argv[1:] if argv is None else argv)
        path, tok, rows = check(a)
    except (ArgumentError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from paddletune import parallel
    from paddletune.generation import GenerationConfig, checkpoint_defaults
    from paddletune.loading import load_for_generation
    from paddletune.trainer.metrics import write_json_lines

    if a.device == "cpu":
        import paddle

        paddle.set_device("cpu")
    else:
        runtime.set_device()
    topo = parallel.init(a) if a.tensor_parallel_degree > 1 else None
    main_rank = topo is None or topo.is_main    # every rank generates; rank 0 speaks
    if not main_rank:
        stdout = io.StringIO()
    from paddletune.models import declared_dtype, load_config, ops

    # the checkpoint's dtype or --dtype, under tensor parallelism too (slices read in the dtype)
    dtype = ops.compute_dtype(a.dtype, declared_dtype(load_config(path)[1]))
    model, tok, _ = load_for_generation(path, tok, a.lora_path, a.prefix_path, topology=topo, dtype=dtype)
    cfg = GenerationConfig(max_new_tokens=a.max_length, decode_strategy=a.decode_strategy,
                           temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                           repetition_penalty=a.repetition_penalty, seed=a.seed,
                           **checkpoint_defaults(path, tok)).validate()
    t0 = time.perf_counter()
    if a.chat:
        tokens, seconds = chat_loop(a, model, tok, cfg, stdin, stdout)
    else:
        records, tokens, seconds = predict(a, model, tok, cfg, rows)
        if a.output_file:
            if main_rank:
                write_json_lines(a.output_file, records)
            print(f"{len(records)} answers written to {a.output_file}", file=stdout)
        else:
            for r in records:
                print(json.dumps(r, ensure_ascii=False), file=stdout)
        scores = reference_metrics(records)
        if scores:
            print(scores, file=stdout)
    wall = time.perf_counter() - t0
    print(f"generated {tokens} tokens in {seconds:.2f} s: {tokens / max(seconds, 1e-9):.1f} tokens/s "
          f"(wall {wall:.2f} s)", file=stdout, flush=True)
    return 0


if __name__ == "__main__":
    cli.finish(main())
