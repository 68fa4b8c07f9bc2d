"""Loading a ~150M-parameter Llama with nf4 never holds the full-precision model.

The checkpoint (float32, ~590 MB) is written here directly with numpy, tensor by tensor, and
deleted afterwards. A subprocess measures, over its RSS right after `import paddle`:
  build   growth after building the model under paddle.LazyGuard (nothing allocated),
  peak    VmHWM growth over the whole quantize-while-streaming load,
  final   growth once loaded.
Oracle: the float32 size of the parameters (what a plain load holds at the end).
"""
import json
import os
import shutil
import struct

import numpy as np

from conftest import run_script

H, I, V, L = 768, 2048, 32000, 14      # 148.3M parameters, 593 MB in float32

PROBE = r"""
import json, sys
def rss():
    d = dict(l.split(':', 1) for l in open('/proc/self/status'))
    return int(d['VmRSS'].split()[0]) * 1024, int(d['VmHWM'].split()[0]) * 1024
import paddletune, paddle
from paddletune.models import build_model, load_config, load_weights
from paddletune.quant import QuantConfig, quant_report, quantize_model_lazily
base = rss()[0]
spec, cfg = load_config(sys.argv[1])
model = build_model(cfg)
built = rss()[0] - base
quantize_model_lazily(model, QuantConfig("nf4", 64, False))
load_weights(model, sys.argv[1], spec)
now, peak = rss()
print("RESULT " + json.dumps({"build": built, "peak": peak - base, "final": now - base,
                              "report": quant_report(model)}))
"""


def write_checkpoint(path, seed=0):
    """config.json + model.safetensors (float32, N(0, 0.02) matrices, unit norms), streamed."""
    shapes = {"model.embed_tokens.weight": [V, H], "model.norm.weight": [H], "lm_head.weight": [V, H]}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": [H], p + "post_attention_layernorm.weight": [H]})
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{n}.weight"] = [H, H]
        shapes.update({p + "mlp.gate_proj.weight": [I, H], p + "mlp.up_proj.weight": [I, H],
                       p + "mlp.down_proj.weight": [H, I]})
    header, off = {}, 0
    for k, s in shapes.items():
        n = 4 * int(np.prod(s))
        header[k] = {"dtype": "F32", "shape": s, "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    os.makedirs(path)
    rng = np.random.default_rng(seed)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for s in shapes.values():
            a = np.ones(s, np.float32) if len(s) == 1 else rng.standard_normal(s, np.float32) * 0.02
            f.write(a.astype(np.float32).tobytes())
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": V,
              "hidden_size": H, "intermediate_size": I, "num_hidden_layers": L,
              "num_attention_heads": 12, "num_key_value_heads": 12, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return sum(int(np.prod(s)) for s in shapes.values())


def test_nf4_load_peak_rss_below_fp32_size(tmp_path):
    ckpt = str(tmp_path / "llama150m")
    try:
        n_params = write_checkpoint(ckpt)
        proc = run_script(["-c", PROBE, ckpt], timeout=300)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.split("RESULT ", 1)[1])
    fp32 = 4 * n_params
    mb = {k: round(res[k] / 2**20, 1) for k in ("build", "peak", "final")}
    print(f"{n_params / 1e6:.1f}M params, float32 {fp32 / 2**20:.1f} MiB; RSS growth MiB: {mb}; "
          f"whole-model ratio {res['report']['model_ratio']:.3f}")
    assert 140e6 < n_params < 160e6
    assert res["build"] < 0.05 * fp32          # LazyGuard: no weight allocated by building
    assert res["peak"] < fp32                  # the full-precision model is never resident
    assert res["final"] < 0.6 * fp32           # embeddings + LM head float32, the rest nf4
    assert res["report"]["quantized_ratio"] < 0.15
