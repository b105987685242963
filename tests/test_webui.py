"""The chat page at `/` in a real browser (Debian's chromium, headless, via Playwright): no
console error, no request to another origin; a reply streams frame by frame and equals the
API's at temperature 0; stop (the server cancels), regenerate, edit, reload, a model switch;
HTML in a reply stays text; the API key is asked once; a phone's width fits. One server and
one browser for the module (a fresh context, so fresh storage, per test); the model switch
runs last, and `--api-key` gets a server of its own."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from api_server import MODEL, KilnServer
from webui_browser import CHROMIUM, js_number, new_tab
from webui_oracle import aborted_requests, api_first_token_ms, metric_sums

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium (README, 'The chat page')")
sync_api = pytest.importorskip("playwright.sync_api")

GEMMA = "gemma3:270m"
KEY = "sesame-7c1f"
PROMPT = "Write two short sentences about the sea."
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "repeat_last_n", "seed", "max_tokens")
LATEST_REPLY = "[...document.querySelectorAll('.msg.assistant')].pop()"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with KilnServer(tmp_path_factory.mktemp("kiln-webui")) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield b
        b.close()


@pytest.fixture
def tab(browser, server):
    t = new_tab(browser, server.url)
    yield t
    t.page.context.close()


# --- the page and its files ----------------------------------------------------------------

def test_the_page_loads_clean_with_its_csp_the_models_and_their_defaults(tab, server):
    response = tab.open()
    assert response.status == 200
    csp = response.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "unsafe" not in csp and "*" not in csp
    cards = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert tab.page.eval_on_selector_all("#model option", "os => os.map(o => o.value)") \
        == [c["id"] for c in cards]
    assert tab.page.input_value("#model") == MODEL
    card = next(c for c in cards if c["id"] == MODEL)
    for name, value in card["defaults"].items():
        assert tab.page.get_attribute(f"#settings input[name={name}]", "placeholder") \
            == f"default {js_number(value)}", name
    assert tab.page.get_attribute("#settings input[name=seed]", "placeholder") == "random"
    # The server panel, from /health and /metrics.
    tab.page.wait_for_selector('[data-stat="KV blocks used"]')
    total = server.health()["kv_total_blocks"]
    assert tab.page.text_content('[data-stat="KV blocks used"]').endswith(f" of {total}")
    assert tab.page.text_content('[data-stat="in flight"]') == "0"
    # The page's Prometheus parser sums what prometheus-client's own parser reads.
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    parsed = tab.page.evaluate(
        "async (t) => (await import('/webui/stats.js')).parseMetrics(t)", text)
    assert parsed == pytest.approx(metric_sums(text))
    tab.assert_clean()


def test_the_page_serves_a_fixed_set_of_files_and_no_path_on_disk(server):
    js = httpx.get(f"{server.url}/webui/app.js", timeout=10)
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert "default-src 'self'" in js.headers["content-security-policy"]
    for path in ("/webui/..%2Froutes%2Fwebui.py", "/webui/%2e%2e%2fserver.py",
                 "/webui/..%2F..%2Fpyproject.toml", "/webui/routes/webui.py",
                 "/webui/index.htm", "/webui/", "/index.html", "/server.py"):
        r = httpx.get(f"{server.url}{path}", timeout=10)
        assert r.status_code == 404, path


def test_no_webui_adds_no_page_routes():
    from kiln.api.cli import build_parser
    from kiln.api.server import create_app
    from kiln.api.state import ServeOptions, ServerState

    assert build_parser().parse_args(["serve", "--no-webui"]).no_webui
    assert not build_parser().parse_args(["serve"]).no_webui
    paths = {}
    for webui in (True, False):
        state = ServerState(ServeOptions(webui=webui, max_request_bytes=1 << 20))
        app = create_app(state, name=f"kiln_webui_{webui}")
        paths[webui] = {r.path for r in app.router.routes}
    assert paths[True] - paths[False] == {"", "webui/<name:str>"}


def test_markdown_becomes_elements_and_never_html(tab):
    tab.open()
    source = ("# Title\n\nSome *it* and **b `c`** text\nnext line\n\n- a\n- b\n\n3. x\n4. y\n\n"
              "> quoted\n\n```py\nif a < b:\n    print('<b>')\n```\n<i>not html</i>")
    html = tab.page.evaluate(
        "async (s) => { const { renderMarkdown } = await import('/webui/markdown.js'); "
        "const div = document.createElement('div'); div.append(renderMarkdown(s)); "
        "div.querySelectorAll('button').forEach((b) => b.remove()); return div.innerHTML; }",
        source)
    assert html == (
        "<h3>Title</h3><p>Some <em>it</em> and <strong>b <code>c</code></strong> text<br>"
        "next line</p><ul><li>a</li><li>b</li></ul><ol start=\"3\"><li>x</li><li>y</li></ol>"
        "<blockquote><p>quoted</p></blockquote><div class=\"code\"><div class=\"code-head\">"
        "<span class=\"lang\">py</span></div><pre><code>if a &lt; b:\n    print('&lt;b&gt;')"
        "</code></pre></div><p>&lt;i&gt;not html&lt;/i&gt;</p>")
    tab.assert_clean()


# --- chatting ------------------------------------------------------------------------------

def test_a_reply_streams_frame_by_frame_and_equals_the_apis_at_temperature_0(tab, server):
    tab.open()
    tab.set_fields(temperature=0, max_tokens=24)
    # The reply's length at every frame the browser paints.
    tab.page.evaluate(f"""() => {{ window.kilnLengths = [];
        const tick = () => {{ const m = {LATEST_REPLY};
            window.kilnLengths.push(m ? m.querySelector('.body').textContent.length : 0);
            requestAnimationFrame(tick); }};
        requestAnimationFrame(tick); }}""")
    tab.send(PROMPT)
    tab.wait_reply_done()
    lengths = tab.page.evaluate("window.kilnLengths")
    grown = sorted({n for n in lengths if n > 0})
    assert len(grown) >= 3, lengths  # the text grew over several frames, not at once

    [body] = tab.chat_bodies()
    # What the page sends is what the user set: two fields, nothing else.
    assert {k: v for k, v in body.items() if k in SAMPLING} == {"temperature": 0,
                                                                 "max_tokens": 24}
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": PROMPT}]
    [conv] = tab.conversations()
    user, reply = conv["messages"]
    assert user == {"role": "user", "content": PROMPT} and reply["content"]

    whole = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    api = httpx.post(f"{server.url}/v1/chat/completions", json=whole, timeout=60).json()
    assert api["choices"][0]["message"]["content"] == reply["content"]

    # The numbers under the reply are its usage's.
    u = reply["usage"]
    stats = tab.page.text_content(".msg.assistant .stats")
    assert stats.startswith(f"{u['completion_tokens']} tokens · ")
    assert f"{u['prompt_tokens_details']['cached_tokens']} of {u['prompt_tokens']} prompt " \
           f"tokens cached" in stats
    assert f"KV {u['kv_token_occupancy_rate_percentage']:.1f} %" in stats
    assert "tok/s" in stats and "TTFT" in stats

    # First text in the page, against the API's own first token for the same request (its
    # usage's TTFT). An HTTP client's, for the same body sent again, is printed beside it:
    # its prompt comes from the prefix cache, so it is not the same work.
    page_ms = float(tab.page.evaluate(f"{LATEST_REPLY}.dataset.firstTokenMs"))
    engine_ms = u["prefill_duration_ttft"] * 1000
    api_ms = api_first_token_ms(server, body)
    print(f"\n[webui] first text: page {page_ms:.0f} ms, the request's own TTFT "
          f"{engine_ms:.0f} ms, an HTTP client's (prompt cached) {api_ms:.0f} ms")
    assert page_ms - engine_ms < 500
    tab.assert_clean()


def test_regenerate_edit_and_the_system_prompt(tab, server):
    tab.open()
    tab.set_fields(temperature=0, max_tokens=8)
    tab.page.click("#system-box summary")
    tab.page.fill("#system-prompt", "Answer in one word.")
    tab.send("Name a colour.")
    tab.wait_reply_done()
    first = tab.conversations()[0]["messages"]
    tab.page.click(".msg.assistant button:text('Regenerate')")
    tab.wait_reply_done()
    again = tab.conversations()[0]["messages"]
    assert len(again) == 2 and again[1]["content"] == first[1]["content"]  # temperature 0
    bodies = tab.chat_bodies()
    assert len(bodies) == 2 and bodies[0]["messages"] == bodies[1]["messages"] == [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Name a colour."}]

    tab.page.click(".msg.user button:text('Edit')")
    assert tab.page.input_value("#prompt") == "Name a colour."
    assert tab.page.locator(".msg").count() == 0
    tab.page.fill("#prompt", "Name a fruit.")
    tab.page.click("#send")
    tab.wait_reply_done()
    msgs = tab.conversations()[0]["messages"]
    assert [m["content"] for m in msgs if m["role"] == "user"] == ["Name a fruit."]
    assert tab.chat_bodies()[-1]["messages"][-1] == {"role": "user", "content": "Name a fruit."}
    tab.assert_clean()


def test_bad_settings_and_refused_requests_show_a_clear_message(tab, server):
    tab.open()
    tab.set_fields(top_k="2.5")
    tab.send("Hi")
    tab.page.wait_for_selector(".msg.assistant .error")
    assert tab.page.text_content(".msg.assistant .error") == 'top_k must be a whole number, ' \
        'not "2.5"'
    assert tab.chat_bodies() == []  # nothing was sent
    tab.set_fields(top_k="", max_tokens=10**7)
    tab.page.click(".msg.assistant button:text('Regenerate')")
    tab.wait_reply_done()
    assert tab.page.text_content(".msg.assistant .error") == "Max length reached!"
    tab.allowed_errors = r"status of 400"  # the browser logs the refused call
    tab.assert_clean()


def test_stop_ends_the_reply_and_the_server_cancels_it(tab, server):
    tab.open()
    tab.set_fields(max_tokens=1500)
    aborted = aborted_requests(server)
    tab.send("Write a very long story about a dragon who learns to cook, in ten chapters.")
    tab.wait_until(f"(() => {{ const m = {LATEST_REPLY}; "
                   "return m && m.querySelector('.body').textContent.length > 20; })()")
    assert server.health()["in_flight"] == 1
    tab.page.click("#stop")
    deadline = time.monotonic() + 5
    while server.health()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.health()["in_flight"] == 0
    # The engine counts the abort when its loop next takes its inbox, which may be just after
    # the handler let go of the request.
    deadline = time.monotonic() + 5
    while aborted_requests(server) == aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborted_requests(server) == aborted + 1  # cancelled, not finished
    tab.page.wait_for_selector(".msg.assistant .note:text('Stopped.')")
    assert tab.page.is_visible("#send") and not tab.page.is_visible("#stop")
    reply = tab.conversations()[0]["messages"][1]
    assert reply["finish"] == "stopped" and reply["content"] and "usage" not in reply
    tab.assert_clean()


HOSTILE = ('Look: <img src=x onerror="window.pwned=1"> <script>window.pwned=2</script> '
           "**real bold**\n\n```html\n<img src=y onerror=\"window.pwned=3\">\n```")
HOSTILE_CONVERSATION = {
    "id": "hostile", "title": "hostile", "model": MODEL, "system": "", "updated": 1,
    "messages": [
        {"role": "user", "content": '<img src=z onerror="window.pwned=4">'},
        {"role": "assistant", "content": HOSTILE,
         "reasoning": '<svg onload="window.pwned=5"></svg> thinking'}]}


def test_html_in_a_reply_is_shown_as_text_and_runs_nothing(tab, server):
    tab.preload(HOSTILE_CONVERSATION)
    tab.page.context.grant_permissions(["clipboard-read", "clipboard-write"],
                                       origin=server.url)
    tab.open()
    page = tab.page
    assert page.evaluate("window.pwned") is None
    assert page.locator(".messages img, .messages script, .messages svg").count() == 0
    reply = page.locator(".msg.assistant")
    assert '<img src=x onerror="window.pwned=1"> <script>window.pwned=2</script>' \
        in reply.locator(".body p").text_content()
    assert reply.locator("strong").text_content() == "real bold"
    code = '<img src=y onerror="window.pwned=3">'
    assert reply.locator("pre code").text_content() == code
    assert page.locator(".msg.user .text").text_content() == HOSTILE_CONVERSATION[
        "messages"][0]["content"]
    reasoning = reply.locator("details.reasoning")
    assert reasoning.get_attribute("open") is None  # collapsed
    assert '<svg onload="window.pwned=5"></svg> thinking' in reasoning.text_content()
    page.click(".code .copy")
    page.wait_for_selector(".code .copy:text('Copied')")
    assert page.evaluate("navigator.clipboard.readText()") == code
    assert not [r.url for r in tab.requests if r.url.rsplit("/", 1)[-1] in ("x", "y", "z")]
    # Listed, and deletable.
    assert page.locator("#conversation-list li").count() == 1
    page.click("#conversation-list .delete")
    assert page.locator("#conversation-list li").count() == 0
    assert tab.conversations() == []
    tab.assert_clean()


def test_a_phone_sized_window_has_no_horizontal_scroll(browser, server):
    tab = new_tab(browser, server.url, width=375, height=740)
    long = dict(HOSTILE_CONVERSATION, id="long", messages=[
        {"role": "user", "content": "x" * 300},
        {"role": "assistant", "content": "y" * 300 + "\n\n```\n" + "z = 1; " * 80 + "\n```"}])
    tab.preload(long)
    try:
        tab.open()
        fits = "document.documentElement.scrollWidth <= window.innerWidth"
        assert tab.page.evaluate(fits)
        assert not tab.page.is_visible("#side") and not tab.page.is_visible("#conversations")
        for drawer, button in (("#side", "#toggle-settings"),
                               ("#conversations", "#toggle-conversations")):
            tab.page.click(button)
            assert tab.page.is_visible(drawer)
            assert tab.page.evaluate(fits), drawer
        tab.assert_clean()
    finally:
        tab.page.context.close()


def test_the_key_is_asked_once_and_kept_for_the_tab(browser, tmp_path_factory):
    with KilnServer(tmp_path_factory.mktemp("kiln-webui-key"), "--api-key", KEY) as keyed:
        for path in ("/", "/webui/app.js"):  # the page loads without the key
            assert httpx.get(f"{keyed.url}{path}", timeout=10).status_code == 200
        assert httpx.get(f"{keyed.url}/v1/models", timeout=10).status_code == 401
        tab = new_tab(browser, keyed.url)
        tab.allowed_errors = r"status of 401"  # the browser logs each refused call
        try:
            page = tab.page
            page.goto(f"{keyed.url}/")
            page.wait_for_selector("#key-dialog[open]")
            page.fill("#key-input", "wrong")
            page.click("#key-form button")
            tab.wait_until("/refused/.test(document.getElementById('key-message').textContent)")
            page.fill("#key-input", KEY)
            page.click("#key-form button")
            tab.wait_ready()
            assert page.evaluate("sessionStorage.getItem('kiln.apiKey')") == KEY
            tab.set_fields(max_tokens=4)
            tab.send("Hello!")
            tab.wait_reply_done()
            assert tab.conversations()[0]["messages"][1]["content"]
            chat = [r for r in tab.requests if r.url.endswith("/v1/chat/completions")]
            assert chat[-1].all_headers()["authorization"] == f"Bearer {KEY}"
            # A reload in the same tab keeps the key: no question, the panels fill.
            page.reload()
            tab.wait_ready()
            page.wait_for_selector('[data-stat="running"]')
            assert not page.is_visible("#key-dialog")
            assert page.text_content('[data-stat="running"]').isdigit()
            tab.assert_clean()
        finally:
            tab.page.context.close()


def test_reload_restores_the_defaults_and_clears_the_panel(tab, server):
    tab.open()
    page = tab.page
    tab.set_fields(temperature=1.5, max_tokens=4)
    tab.send("Hi")  # temperature 1.5 now sticks on the server
    tab.wait_reply_done()
    page.click("#reload")
    assert page.is_disabled("#send")
    tab.wait_until(f"/{MODEL} loaded/.test(document.getElementById('model-status').textContent)"
                   " && !document.getElementById('reload').disabled", 120_000)
    assert page.input_value("#settings input[name=temperature]") == ""
    assert page.input_value("#settings input[name=max_tokens]") == ""
    assert [json.loads(r.post_data) for r in tab.requests if r.url.endswith("/api/load")] \
        == [{"model": MODEL}]
    tab.assert_clean()


# --- last: it leaves the module's server on another model --------------------------------

def test_switching_models_loads_the_other_with_its_defaults(tab, server):
    tab.open()
    page = tab.page
    page.select_option("#model", GEMMA)
    tab.wait_until(f"/Loading {GEMMA}/.test(document.getElementById('model-status').textContent)")
    assert page.is_disabled("#send")
    tab.wait_until(f"/{GEMMA} loaded/.test(document.getElementById('model-status').textContent)",
                   240_000)
    assert server.health()["model"] == GEMMA
    card = httpx.get(f"{server.url}/v1/models/{GEMMA}", timeout=10).json()
    assert card["loaded"]
    for name, value in card["defaults"].items():
        assert page.get_attribute(f"#settings input[name={name}]", "placeholder") \
            == f"default {js_number(value)}", name
    loads = [json.loads(r.post_data) for r in tab.requests if r.url.endswith("/api/load")]
    assert loads == [{"model": GEMMA}]
    tab.set_fields(temperature=0, max_tokens=3)
    tab.send("Say hello.")
    tab.wait_reply_done()
    assert tab.chat_bodies()[-1]["model"] == GEMMA
    assert tab.conversations()[0]["messages"][1]["content"]
    tab.assert_clean()
