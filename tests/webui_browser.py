"""A headless chromium for the chat page's tests (tests/test_webui.py): Debian's `chromium`
package driven by Playwright (Playwright's own browser download is not needed), and a tab
that records what the page must never do: log a console error, throw, or send a request to
any origin but the server's."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from urllib.parse import urlsplit

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class Tab:
    """A page of a fresh browser context (its own localStorage and sessionStorage)."""

    page: object  # playwright.sync_api.Page
    origin: str
    errors: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    requests: list = field(default_factory=list)  # playwright Request objects, in order
    allowed_errors: str | None = None  # a regex: console errors the test expects

    def watch(self) -> None:
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.on("request", self._request)

    def _request(self, request) -> None:
        self.requests.append(request)
        u = urlsplit(request.url)
        if f"{u.scheme}://{u.netloc}" != self.origin:
            self.foreign.append(request.url)

    def assert_clean(self) -> None:
        errors = [e for e in self.errors
                  if not (self.allowed_errors and re.search(self.allowed_errors, e))]
        assert not errors, f"console errors: {errors}"
        assert not self.foreign, f"requests to other origins: {self.foreign}"

    # --- what the tests do on the page ---

    def preload(self, *conversations: dict) -> None:
        """Conversations in the page's storage before its scripts run."""
        self.page.add_init_script(
            "localStorage.setItem('kiln.conversations', "
            f"{json.dumps(json.dumps(conversations))})")

    def open(self):
        response = self.page.goto(f"{self.origin}/")
        self.wait_ready()
        return response

    def wait_until(self, condition: str, timeout_ms: float | None = None) -> None:
        """Waits for a JavaScript condition. It goes in as a function: Playwright evaluates a
        bare expression string with eval, which the page's CSP forbids."""
        self.page.wait_for_function(f"() => ({condition})", timeout=timeout_ms)

    def wait_ready(self) -> None:
        self.wait_until("document.getElementById('model').options.length > 0 && "
                        "/ready|loaded/.test(document.getElementById('model-status').textContent)")

    def set_fields(self, **fields) -> None:
        """Types into the settings panel's fields (shown beside the chat on a wide window)."""
        for name, value in fields.items():
            self.page.fill(f"#settings input[name={name}]", str(value))

    def send(self, text: str) -> None:
        self.page.fill("#prompt", text)
        self.page.click("#send")

    def wait_reply_done(self, timeout_ms: float = 60_000) -> None:
        self.wait_until("document.querySelector('.msg.assistant') && "
                        "!document.getElementById('send').hidden", timeout_ms)

    def chat_bodies(self) -> list[dict]:
        return [json.loads(r.post_data) for r in self.requests
                if r.url.endswith("/v1/chat/completions") and r.method == "POST"]

    def conversations(self) -> list[dict]:
        return self.page.evaluate(
            "JSON.parse(localStorage.getItem('kiln.conversations') || '[]')")

    def last_reply_text(self) -> str:
        return self.page.evaluate(
            "[...document.querySelectorAll('.msg.assistant .body')].pop().textContent")


def js_number(v) -> str:
    """A JSON number as the page's JavaScript prints it (1.0 is "1")."""
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def new_tab(browser, origin: str, width: int = 1280, height: int = 800) -> Tab:
    """A tab in a fresh context of `browser` (a playwright Browser)."""
    context = browser.new_context(viewport={"width": width, "height": height})
    context.set_default_timeout(60_000)
    tab = Tab(context.new_page(), origin)
    tab.watch()
    return tab
