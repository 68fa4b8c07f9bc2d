"""Small CLIs: the tiny-checkpoint maker is deterministic and its output loads in transformers;
docs/arguments.md's key tables are generated from args.py and not stale."""
import hashlib
import os

from conftest import ROOT, run_script


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_make_tiny_checkpoint_is_deterministic_and_loads_in_transformers(tmp_path):
    import transformers

    tool = os.path.join(ROOT, "tools", "make_tiny_checkpoint.py")
    for name in ("a", "b"):
        r = run_script([tool, "--model_type", "qwen2", "--output", str(tmp_path / name), "--config", "{\"hidden_size\": 48}"])
        assert r.returncode == 0, r.stderr[-2000:]
    assert digest(tmp_path / "a" / "model.safetensors") == digest(tmp_path / "b" / "model.safetensors")
    m = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"))
    assert m.config.hidden_size == 48 and m.config.model_type == "qwen2"


def test_arguments_md_is_current():
    r = run_script([os.path.join(ROOT, "tools", "gen_arguments_md.py"), "--check"])
    assert r.returncode == 0, r.stdout
