"""The chat page at / in headless Chromium (Debian's chromium + chromium-driver, via Selenium):
type a question, watch the answer grow through intermediate states, end on the server's answer.

The model: a tiny ChatGLM2 (its SentencePiece tokenizer with byte fallback) whose answer we
control, so that it is CJK + emoji: every layer's output projections are zeroed, so the
residual stream is the last token's embedding, and the embeddings / LM head form a chain
"any token -> c0 -> c1 -> ... -> EOS" over the ids of ANSWER. The question does not matter; the
answer's bytes arrive one token at a time (中, 文, 好, 界, ！ are 3 byte tokens each, 🚀 4), so the page
only shows whole characters if the server's detokenizer holds incomplete UTF-8 back.
"""
import shutil

import pytest

from serve_util import ServerProcess

webdriver = pytest.importorskip("selenium.webdriver")
pytest.importorskip("uvicorn")

# ~45 tokens, all different (the chain is a token -> next token map): the stream lasts long enough
# that the page gets it in several network reads even on a busy machine
ANSWER = "中文🚀 done. the quick brown fox jumps a while my and好界！"
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def chain_model(out_dir):
    """Save a tiny-chatglm2 checkpoint whose greedy answer to anything is ANSWER."""
    import paddle

    from paddletune.loading import load_for_generation
    from paddletune.models import save_pretrained

    model, tok, _ = load_for_generation("paddletune/tiny-chatglm2")
    chain = tok.encode(ANSWER, add_special_tokens=False)
    assert len(set(chain)) == len(chain) and tok.decode(chain) == ANSWER   # a token -> next map exists
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    H = state["transformer.embedding.word_embeddings.weight"].shape[1]
    for k in state:
        if k.endswith("self_attention.dense.weight") or k.endswith("mlp.dense_4h_to_h.weight"):
            state[k][:] = 0                              # each block adds nothing to the residual
    emb = state["transformer.embedding.word_embeddings.weight"]
    emb[:] = 0
    emb[:, H - 1] = 1                                    # any token: state "start"
    head = state["transformer.output_layer.weight"]      # [H, V] (paddle layout)
    head[:] = 0
    head[H - 1, chain[0]] = 10
    for i, t in enumerate(chain):
        emb[t] = 0
        emb[t, i] = 1                                    # chain token i: state i
        head[i, chain[i + 1] if i + 1 < len(chain) else tok.eos_token_id] = 10
    model.set_state_dict({k: paddle.to_tensor(v) for k, v in state.items()})
    save_pretrained(model, str(out_dir), tokenizer=tok)
    return str(out_dir)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = chain_model(tmp_path_factory.mktemp("chain_chatglm2"))
    s = ServerProcess(["--model_name_or_path", path, "--served_model_name", "chain"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and DRIVER):
        pytest.fail("chromium and chromedriver are needed (apt-get install chromium chromium-driver; .ci/run does)")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-background-networking", "--disable-component-update",
                 "--disable-dev-shm-usage", "--window-size=1000,700"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


# records the text of the last answer each time the page changes it (one MutationObserver
# callback per task that changed it: a page that waited for the whole answer shows one state)
OBSERVE = """
window.__states = [];
new MutationObserver(() => {
  const a = document.querySelectorAll('#messages .assistant');
  if (a.length) window.__states.push(a[a.length - 1].textContent);
}).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
"""


def test_chat_page_streams_a_cjk_emoji_answer(server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    import re

    import paddletune.serve as serve

    with open(f"{serve.__path__[0]}/static/index.html", encoding="utf-8") as f:
        html = f.read()
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", html)   # nothing from elsewhere: works offline
    browser.get(server.url + "/")
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "model").text == "chain")
    for key, value in (("temperature", "0"), ("max_tokens", "80")):
        box = browser.find_element(By.ID, key)
        box.clear()
        box.send_keys(value)
    browser.execute_script(OBSERVE)
    browser.find_element(By.ID, "input").send_keys("你好，请回答")
    browser.find_element(By.ID, "send").click()
    WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "status").text.startswith("done"))
    answers = browser.find_elements(By.CSS_SELECTOR, "#messages .assistant")
    assert answers[-1].text == ANSWER
    assert browser.find_element(By.ID, "status").text == "done (stop)"
    states = [s for s in browser.execute_script("return window.__states") if s]
    middle = [s for s in dict.fromkeys(states) if s != ANSWER]
    assert len(middle) >= 2, states                       # streamed: >= 2 states before the final one
    assert all(ANSWER.startswith(s) and "\ufffd" not in s for s in middle), middle   # whole characters only
    browser.save_screenshot(str(tmp_path / "chat_page.png"))
    assert (tmp_path / "chat_page.png").stat().st_size > 1000
    # a second turn (the page sends the history with it); reset clears the conversation
    browser.find_element(By.ID, "input").send_keys("再来")
    browser.find_element(By.ID, "send").click()
    WebDriverWait(browser, 60).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#messages .assistant")) == 2
                                     and d.find_element(By.ID, "status").text.startswith("done"))
    browser.find_element(By.ID, "reset").click()
    assert browser.find_elements(By.CSS_SELECTOR, "#messages .msg") == []
