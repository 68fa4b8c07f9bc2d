"""The shell blocks of README.md and docs/*.md run as written (issue 34).

Every fenced ```bash / ```sh / ```shell block runs, unless the nearest non-blank line above its
fence is an HTML comment `<!-- not-run: REASON -->` with a reason (GPU, several machines, the
network, installs, placeholders for the reader's files, or minutes of work that a named test
already does). The blocks of one file run in order, in one fresh working directory that holds only
links to the checkout's llm/ and tools/ (so `./checkpoints/...` is new for every run); a block
fails the test on a non-zero exit. What the README says its commands print is checked too.
"""
import glob
import os
import re
import subprocess

import pytest

from conftest import ROOT

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SHELL = {"bash", "sh", "shell"}
MARK = re.compile(r"<!--\s*not-run:\s*(.*?)\s*-->")
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


def shell_blocks(rel):
    """[(line number, code, reason or None)] of the shell blocks of one Markdown file."""
    text = open(os.path.join(ROOT, rel), encoding="utf-8").read()
    out = []
    for m in FENCE.finditer(text):
        if m.group(1) not in SHELL:
            continue
        before = [l for l in text[:m.start()].splitlines() if l.strip()]
        mark = MARK.fullmatch(before[-1].strip()) if before else None
        out.append((text.count("\n", 0, m.start()) + 1, m.group(2), mark.group(1) if mark else None))
    return out


def test_every_block_runs_or_says_why_not():
    """Markers carry a reason; the count of blocks that run is printed and is what the docs hold."""
    run = skipped = 0
    for rel in DOCS:
        for line, _, reason in shell_blocks(rel):
            if reason is None:
                run += 1
            else:
                assert len(reason) >= 10, f"{rel}:{line}: a not-run marker needs a reason"
                skipped += 1
    print(f"\ndocs shell blocks: {run} run, {skipped} marked not-run, in {len(DOCS)} files")
    assert run >= 3 and skipped >= 1
    readme = shell_blocks("README.md")
    assert sum(r is None for _, _, r in readme) == 2   # the two commands, your own data


def run_file(rel, tmp_path):
    """Run the file's unmarked blocks in order in a fresh directory; return their outputs."""
    for name in ("llm", "tools"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    env = dict(os.environ, PYTHONPATH=ROOT)
    outs = []
    for line, code, reason in shell_blocks(rel):
        if reason is not None:
            continue
        r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, f"{rel}:{line} exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        outs.append(r.stdout)
    return outs


def test_readme_commands_run_as_written(tmp_path):
    """README's two commands (train the default, chat: `3`) and its own-data example (LoRA,
    merge, chat: `Lima`, `Shakespeare`), in a fresh working directory."""
    two, own = run_file("README.md", tmp_path)
    answers = [l for l in two.splitlines() if not l.startswith(("[", "model saved to", "generated "))]
    assert "model saved to" in two and answers == ["3"], two[-1500:]
    assert (tmp_path / "checkpoints" / "llama_sft_ckpts" / "config.json").is_file()
    answers = [l for l in own.splitlines() if l in ("Lima", "Shakespeare", "(history cleared)")]
    assert answers == ["Lima", "(history cleared)", "Shakespeare"], own[-1500:]
    assert (tmp_path / "checkpoints" / "my_lora" / "adapter_config.json").is_file()
    assert (tmp_path / "checkpoints" / "my_model" / "model.safetensors").is_file()


@pytest.mark.parametrize("rel", [d for d in DOCS if d != "README.md"
                                 and any(r is None for _, _, r in shell_blocks(d))])
def test_docs_blocks_run_as_written(rel, tmp_path):
    outs = run_file(rel, tmp_path)
    print(f"{rel}: {len(outs)} blocks ran")
    assert outs
