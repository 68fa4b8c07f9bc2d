"""The OpenAI-compatible server (llm/server.py) as a real process, called with the official
`openai` client and raw HTTP (httpx). Oracles: llm/predictor.py's answer for the same prompt and
settings, the non-streamed answer for a stream, a request's solo answer for the same request in a
batch, and the OpenAI error object for each bad input."""
import io
import json
import threading
import time

import httpx
import pytest

from conftest import load_script
from serve_util import ServerProcess

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

BASE, KEY, MAX_LENGTH = "paddletune/tiny-qwen2", "sk-test-key", 256
MODEL = BASE   # the served model: a LoRA adapter directory on BASE, set by the `server` fixture
PROMPTS = ["def read_file(path):", "解释一下“温故而知新”", "The os module provides", "import json\n",
           "class Parser:", "Return the", "x", "The following functions are available in the"]


def lora_adapter(out_dir):
    """A LoRA adapter (q/v projections, random B so it changes the answers) saved for BASE, as a
    fine-tuning run leaves it: adapter_config.json names the base."""
    import numpy as np
    import paddle

    from paddletune.loading import load_for_generation
    from paddletune.peft import lora

    model, tok, _ = load_for_generation(BASE)
    names = [n for n, _ in model.named_sublayers() if n.endswith(("q_proj", "v_proj"))]
    lora.inject(model, names, r=4, alpha=8)
    rng = np.random.default_rng(0)
    for n, p in lora.lora_state(model).items():
        p.set_value(paddle.to_tensor((rng.standard_normal(p.shape) * 0.2).astype(np.float32)))
    lora.save(model, str(out_dir), base_model_name_or_path=BASE, tokenizer=tok, builtin=BASE)
    return str(out_dir)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    global MODEL
    MODEL = lora_adapter(tmp_path_factory.mktemp("lora_on_tiny_qwen2"))   # served as base + adapter
    s = ServerProcess(["--model_name_or_path", MODEL, "--api_key", KEY, "--max_batch_size", "8",
                       "--max_length", str(MAX_LENGTH), "--max_request_bytes", "65536",
                       "--batch_window_ms", "100"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def predictor_outputs(tmp_path, prompts, *args):
    """llm/predictor.py's answers (in-process) for `prompts`, one at a time."""
    data = tmp_path / "prompts.json"
    rows = [p if isinstance(p, dict) else {"src": p} for p in prompts]
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    out = io.StringIO()
    code = load_script("llm/predictor.py").main(["--model_name_or_path", MODEL, "--data_file", str(data),
                                                 "--device", "cpu"] + list(args), stdout=out)
    assert code == 0
    return [json.loads(line)["output"] for line in out.getvalue().splitlines() if line.startswith("{")]


def chat(client, prompt, stream=False, **kw):
    kw = dict(dict(model=MODEL, max_tokens=24, temperature=0), **kw)
    r = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], stream=stream, **kw)
    if not stream:
        return r.choices[0].message.content, r.choices[0].finish_reason
    pieces, reasons = [], []
    for c in r:
        if c.choices:
            pieces.append(c.choices[0].delta.content or "")
            reasons.append(c.choices[0].finish_reason)
    return "".join(pieces), [x for x in reasons if x][-1], len([p for p in pieces if p])


def test_chat_and_completions_match_predictor(server, client, tmp_path):
    """Greedy chat (the model's template) and raw completions, streamed and not, equal
    predictor.py's answers; a seeded sampled answer equals predictor.py's with that seed."""
    prompts = PROMPTS[:2]
    greedy = ["--decode_strategy", "greedy_search", "--max_length", "24"]
    rounds = {"src": ["Open the file", prompts[0]], "tgt": ["with open(path) as f:"]}
    *want_chat, want_rounds = predictor_outputs(tmp_path, prompts + [rounds], *greedy)
    # the built-in "plain" template renders a one-turn chat as the raw text (test_first_hour
    # checks predictor.py --chat_template none against it): the same answer for /v1/completions
    want_raw = want_chat
    want_sampled = predictor_outputs(tmp_path, prompts[:1], "--decode_strategy", "sampling", "--max_length", "24",
                                     "--temperature", "0.9", "--top_p", "0.8", "--top_k", "0", "--seed", "7")
    base_answer = paddletune_pipeline_answer(BASE, prompts[0])
    assert base_answer != want_chat[0]   # the adapter matters, so serving without it would fail below
    for p, wc, wr in zip(prompts, want_chat, want_raw):
        text, reason = chat(client, p)
        streamed, sreason, pieces = chat(client, p, stream=True)
        assert text == wc and streamed == text and reason == sreason
        assert pieces >= 2   # really streamed in pieces
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0)
        s = client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0, stream=True)
        assert r.choices[0].text == wr == "".join(c.choices[0].text for c in s if c.choices)
        assert r.usage.completion_tokens <= 24 and r.usage.prompt_tokens > 0
    # a conversation with history: rendered by the template as predictor.py renders src rounds
    history = [{"role": "user", "content": rounds["src"][0]}, {"role": "assistant", "content": rounds["tgt"][0]},
               {"role": "user", "content": rounds["src"][1]}]
    r = client.chat.completions.create(model=MODEL, messages=history, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want_rounds != want_chat[0]   # the history changed the answer
    # a stop string inside the greedy answer: the answer ends right before it, streamed or not
    answer = want_chat[0]
    stop = answer[6:9]
    assert len(answer) > 12 and stop.strip(), answer
    cut = answer[:answer.find(stop)]
    assert chat(client, prompts[0], stop=[stop, "never appears"]) == (cut, "stop")
    assert chat(client, prompts[0], stop=stop, stream=True)[:2] == (cut, "stop")
    sampled, _ = chat(client, prompts[0], temperature=0.9, top_p=0.8, seed=7)
    assert sampled == want_sampled[0]
    assert chat(client, prompts[0], temperature=0.9, top_p=0.8, seed=7, stream=True)[0] == sampled
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def paddletune_pipeline_answer(model, prompt):
    """The greedy 24-token chat answer of `model` alone (no adapter), in-process."""
    import paddletune

    pipe = paddletune.pipeline("text-generation", model=model, max_new_tokens=24)
    return pipe([{"role": "user", "content": prompt}])[0]["generated_text"][-1]["content"]


def first_difference_margin(prompt, answer, got):
    """On a mismatch: the top-2 logit margin of the solo run at the first differing step."""
    from paddletune.generation import generate
    from paddletune.loading import load_for_generation
    from paddletune.text_generation import encode_prompt

    model, tok, _ = load_for_generation(BASE, lora_path=MODEL)
    ids = encode_prompt(tok, [{"role": "user", "content": prompt}], True)
    out = generate(model, [ids], max_new_tokens=40, return_logits=True, tokenizer=tok)
    lg = out.logits[0]
    a, b = tok.encode(answer, add_special_tokens=False), tok.encode(got, add_special_tokens=False)
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    top = sorted(lg[min(k, len(lg) - 1)])[-2:]
    return f"first differing token {k}: top-2 logit margin {top[1] - top[0]:.3g}"


def test_eight_concurrent_streams_equal_solo_answers(server, client):
    """8 streaming clients at once (different prompt lengths and max_tokens, greedy and seeded
    sampling mixed) are decoded in shared batches; each equals its answer alone."""
    settings = [dict(max_tokens=10 + 3 * i, **(dict(temperature=0.8, seed=i) if i in (2, 5) else {}))
                for i in range(8)]
    solo = [chat(client, p, **kw)[0] for p, kw in zip(PROMPTS, settings)]
    before = server.health()
    got, errors, barrier = [None] * 8, [], threading.Barrier(8)

    def run(i):
        try:
            barrier.wait()
            got[i] = chat(client, PROMPTS[i], stream=True, **settings[i])[0]
        except Exception as e:   # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    after = server.health()
    assert after["max_batch"] >= 4, after   # they really shared batches
    assert after["batches"] - before["batches"] < 8, (before, after)
    for i in range(8):
        assert got[i] == solo[i], (i, first_difference_margin(PROMPTS[i], solo[i], got[i]))


def error_of(r, status, code):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"], err
    return err["message"]


def test_error_cases_then_still_serving(server, client):
    url, auth = server.url, {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    post = lambda path, **kw: httpx.post(url + path, timeout=30, **kw)  # noqa: E731
    assert "JSON" in error_of(post("/v1/chat/completions", content=b"{not json", headers=auth), 400, "invalid_json")
    assert "temperature" in error_of(post("/v1/chat/completions", json=dict(body, temperature="hot"), headers=auth),
                                     400, "invalid_type")
    assert "messages" in error_of(post("/v1/chat/completions", json={"model": MODEL}, headers=auth),
                                  400, "missing_required_parameter")
    assert "'n'" in error_of(post("/v1/chat/completions", json=dict(body, n=2), headers=auth), 400, "invalid_value")
    long = dict(body, messages=[{"role": "user", "content": "word " * 400}])
    assert "max_length" in error_of(post("/v1/chat/completions", json=long, headers=auth), 400,
                                    "context_length_exceeded")
    assert "max_length" in error_of(post("/v1/chat/completions", json=dict(body, max_tokens=MAX_LENGTH), headers=auth),
                                    400, "context_length_exceeded")
    assert "prompt" in error_of(post("/v1/completions", json={"model": MODEL, "prompt": 5}, headers=auth),
                                400, "invalid_type")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        error_of(post("/v1/chat/completions", json=body, headers=headers), 401, "invalid_api_key")
    error_of(httpx.get(url + "/v1/models"), 401, "invalid_api_key")
    assert "nope" in error_of(post("/v1/chat/completions", json=dict(body, model="nope"), headers=auth),
                              404, "model_not_found")
    big = dict(body, messages=[{"role": "user", "content": "x" * 70000}])
    assert "65536" in error_of(post("/v1/chat/completions", json=big, headers=auth), 413, "request_too_large")
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="other", messages=body["messages"])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=body["messages"], n=3)
    assert chat(client, "still there?", max_tokens=4)[1] in ("stop", "length")


def test_disconnect_mid_stream_stops_generation(server, client):
    """A streaming client that goes away after two chunks: its row stops (the engine counts a
    cancel and far fewer tokens than asked for) while a request decoded beside it completes with
    its solo answer, and the server answers the next request."""
    solo = chat(client, "and now?", max_tokens=30)[0]
    before = server.health()
    beside = {}
    t = threading.Thread(target=lambda: beside.update(text=chat(client, "and now?", stream=True, max_tokens=30)[0]))
    t.start()
    body = {"model": MODEL, "prompt": "import os", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
        lines = r.iter_lines()
        seen = [line for _, line in zip(range(4), lines)]   # 2 chunks + their blank separators
        assert seen[0].startswith("data: ")
    t.join(60)
    for _ in range(100):
        h = server.health()
        if h["cancelled"] > before["cancelled"] and h["running"] == 0:
            break
        time.sleep(0.05)
    assert h["cancelled"] == before["cancelled"] + 1, h
    assert h["tokens"] - before["tokens"] < 200 + 30, (before, h)
    assert beside.get("text") == solo
    assert chat(client, "and now?", max_tokens=4)[1] in ("stop", "length")


def test_start_refusals(caplog, tmp_path):
    """Refused before the model is loaded: a non-positive batch size, a parallel degree; a
    public address without a key warns."""
    from paddletune.args import ArgumentError
    from paddletune.serve import cli

    for argv, words in ((["--max_batch_size", "0"], "max_batch_size"),
                        (["--tensor_parallel_degree", "2"], "one process"),
                        (["--max_btch_size", "2"], "did you mean 'max_batch_size'")):
        with pytest.raises(ArgumentError, match=words):
            cli.check(cli.parse(["--model_name_or_path", BASE, "--port", "0"] + argv))
    sock = cli.check(cli.parse(["--model_name_or_path", BASE, "--host", "0.0.0.0", "--port", "0"]))
    sock.close()
    assert "without --api_key" in caplog.text
    # an adapter directory as the model: its base from adapter_config.json, the adapter on top
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": BASE, "peft_type": "LORA"}))
    a = cli.parse(["--model_name_or_path", str(tmp_path)])
    cli.adapter_base(a)
    assert (a.model_name_or_path, a.lora_path) == (BASE, str(tmp_path))


def test_served_model_loads_in_the_requested_dtype():
    """--dtype float64: the served model's parameters are float64 and its logits equal the
    float32 load's (what predictor.py's --dtype does); the default keeps the checkpoint's dtype."""
    import numpy as np
    import paddle

    from paddletune.loading import load_for_generation
    from paddletune.serve import cli

    ref, tok, _ = load_for_generation(BASE)
    model = cli.load_served_model(cli.parse(["--model_name_or_path", BASE, "--dtype", "float64"]))[0]
    assert {str(p.dtype) for p in model.parameters()} == {"paddle.float64"}
    assert {str(p.dtype) for p in ref.parameters()} == {"paddle.float32"}
    ids = paddle.to_tensor([tok.encode("def read_file(path):")])
    with paddle.no_grad():
        want, got = ref(ids), model(ids)
    want, got = (np.asarray((x.logits if hasattr(x, "logits") else x).astype("float64")) for x in (want, got))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_throughput_benchmark_smoke(server):
    """benchmarks/serve_throughput.py against this server (2 requests of 4 tokens per level)."""
    from conftest import ROOT, run_script

    r = run_script([f"{ROOT}/benchmarks/serve_throughput.py", "--smoke", "--url", server.url, "--model", MODEL,
                    "--api_key", KEY])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| predictor.py, sequential (batch_size 1) |" in r.stdout and "| 2 |" in r.stdout


def test_training_imports_nothing_of_the_server():
    """The [serve] extra stays optional: what the fine-tuning script imports (the trainer,
    arguments, data, generation) loads neither the HTTP stack nor paddletune.serve."""
    from conftest import run_script

    code = ("import sys, paddletune.trainer, paddletune.args, paddletune.data, paddletune.generation, "
            "paddletune.text_generation\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('starlette', 'uvicorn', 'fastapi')"
            " or m.startswith('paddletune.serve')]\n"
            "assert not bad, bad\nprint('clean')")
    r = run_script(["-c", code])
    assert r.returncode == 0 and "clean" in r.stdout, r.stderr[-2000:]
