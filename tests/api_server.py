"""A real `kiln serve` subprocess for the API tests: a free loopback port, /health polled
until the model is loaded, the server's log captured to a file the tests read, a clean stop.

Each test module starts at most one server (a module-scoped fixture):

    @pytest.fixture(scope="module")
    def server(tmp_path_factory):
        with KilnServer(tmp_path_factory.mktemp("kiln"), "--ctx-len", "512") as s:
            yield s
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from openai import AsyncOpenAI, OpenAI

MODEL = "smollm2:135m"
# The fp32 products and KV cache: for modules whose expectations were read off those replies
# (a greedy answer's length, how often a word repeats); `--dtype auto`'s 8-bit activations
# answer a little differently (bench/README.md, run K).
FP32 = ("--dtype", "float32")
KILN = Path(sys.executable).with_name("kiln")
START_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KilnServer:
    def __init__(self, workdir: Path, *args: str, model: str = MODEL):
        self.workdir, self.args, self.model = Path(workdir), list(args), model
        self.log_path = self.workdir / "server.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0

    # --- life cycle ---

    def __enter__(self) -> KilnServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        for _ in range(3):  # a port taken between free_port() and bind: try another
            self.port = free_port()
            if self._start_once():
                return
        raise RuntimeError(f"kiln serve did not start:\n{self.log_tail()}")

    def _start_once(self) -> bool:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cmd = [str(KILN), "serve", self.model, "--host", "127.0.0.1", "--port",
               str(self.port), *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=self.workdir)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"kiln serve not healthy after {START_TIMEOUT_S} s:\n"
                           f"{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)  # Sanic's graceful shutdown
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    # --- clients ---

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, timeout: float = 120.0) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key="kiln", max_retries=0,
                      timeout=timeout)

    def async_client(self, timeout: float = 300.0) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"{self.url}/v1", api_key="kiln", max_retries=0,
                           timeout=timeout)

    def health(self) -> dict:
        r = httpx.get(f"{self.url}/health", timeout=10)
        r.raise_for_status()
        return r.json()

    def post(self, path: str, body: dict | str | bytes, timeout: float = 120.0
             ) -> httpx.Response:
        """A raw POST: a dict is sent as JSON, str/bytes as they are."""
        if isinstance(body, dict):
            return httpx.post(f"{self.url}{path}", json=body, timeout=timeout)
        return httpx.post(f"{self.url}{path}", content=body, timeout=timeout,
                          headers={"Content-Type": "application/json"})

    # --- the server's log ---

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:]) if self.log_path.exists() else ""

    def log_mark(self) -> int:
        """A position in the log; `log_since(mark)` reads what came after it."""
        return self.log_path.stat().st_size

    def log_since(self, mark: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(mark)
            return f.read().decode(errors="replace")

    def wait_for_log(self, pattern: str, mark: int = 0, timeout: float = 60.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.log_since(mark))
            if m:
                return m
            time.sleep(0.05)
        raise AssertionError(f"no log line matching {pattern!r} within {timeout} s:\n"
                             f"{self.log_since(mark)[-3000:]}")


def settle_log(server: KilnServer, mark: int, quiet_s: float = 0.3) -> str:
    """The log after `mark`, once it has stopped growing for `quiet_s` (a request's last lines
    may be written just after its response)."""
    last = None
    while True:
        text = server.log_since(mark)
        if text == last:
            return text
        last = text
        time.sleep(quiet_s)
