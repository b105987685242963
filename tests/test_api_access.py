"""Who may do what, against one real `kiln serve` started on a GGUF path outside its model
directory, with `--api-key`, `--allowed-origins https://app.example` and `--models-dir` on a
temporary directory holding a tiny GGUF without a chat template, a `.gguf` that is not a GGUF
and a text file:

- the right key opens every route (the OpenAI SDK), a wrong or missing one is a 401 in
  OpenAI's shape (Ollama's under /api/), /health and preflights need none;
- CORS: localhost origins and the --allowed-origins ones get the headers (streams too),
  any other origin none;
- a request's model may name a catalogue tag, the served model or a models-dir file by file
  name or stem, never a path: /etc/passwd, a real GGUF outside the directory, '../' tricks,
  a 300-character name are the same 404, opened by no one;
- a models-dir GGUF without a chat template completes text and refuses chat with a 400.
"""

from __future__ import annotations

import gguf
import httpx
import openai
import pytest
from api_server import KilnServer
from openai import OpenAI
from tiny_gguf import llama_metadata, llama_tensors, write_gguf

KEY = "kiln-test-key-5c1e"
AUTH = {"Authorization": f"Bearer {KEY}"}
APP_ORIGIN = "https://app.example"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def files(tmp_path_factory, smollm2_gguf):
    """(the startup GGUF, outside the models dir; the models dir)."""
    root = tmp_path_factory.mktemp("kiln-access")
    models, outside = root / "models", root / "outside"
    models.mkdir()
    outside.mkdir()
    tokenizer = gguf.GGUFReader(smollm2_gguf)  # the tiny models borrow smollm2's
    vocab = len(tokenizer.fields["tokenizer.ggml.tokens"].contents())

    def tiny(path, seed, **kw):
        write_gguf(path, "llama", llama_metadata(), llama_tensors(vocab, seed=seed),
                   tokenizer_from=tokenizer, **kw)

    tiny(outside / "start.gguf", 0)
    tiny(models / "bare.gguf", 1, without=("tokenizer.chat_template",))
    (models / "broken.gguf").write_bytes(b"not a GGUF at all")
    (models / "notes.txt").write_text("not a model name")
    return outside / "start.gguf", models


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    start, models = files
    with KilnServer(tmp_path_factory.mktemp("kiln-access-log"), "--ctx-len", "512",
                    "--api-key", KEY, "--allowed-origins", APP_ORIGIN, "--models-dir",
                    str(models), model=str(start)) as s:
        yield s


def client(server: KilnServer, key: str = KEY) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


def post(server: KilnServer, path: str, body: dict, headers: dict | None = None
         ) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120,
                      headers=AUTH if headers is None else headers)


# --- the API key ----------------------------------------------------------------------------

def test_the_right_key_opens_the_api(server, files):
    c = client(server)
    start = str(files[0])
    reply = c.chat.completions.create(model=start, messages=HI, max_tokens=2)
    assert reply.model == start and reply.usage.completion_tokens >= 1
    assert start in {m.id for m in c.models.list().data}
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert post(server, path, body).status_code == 200
    assert httpx.get(f"{server.url}/metrics", headers=AUTH).status_code == 200
    lower = {"Authorization": f"bearer {KEY}"}  # the scheme is case-insensitive
    assert httpx.get(f"{server.url}/v1/models", headers=lower).status_code == 200


@pytest.mark.parametrize("key", ["wrong", KEY + "x", KEY[:-1], KEY.upper()])
def test_a_wrong_key_is_a_401_for_the_sdk(server, key):
    c = client(server, key)
    with pytest.raises(openai.AuthenticationError) as err:
        c.chat.completions.create(model="x", messages=HI, max_tokens=1)
    assert err.value.body["code"] == "invalid_api_key"
    assert err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        c.models.list()


@pytest.mark.parametrize("headers", [{}, {"Authorization": KEY}, {"Authorization": "Bearer"},
                                     {"Authorization": f"Basic {KEY}"},
                                     {"Authorization": "Bearer wrong"}])
def test_a_missing_or_malformed_key_is_a_401_on_every_route(server, headers):
    mark = server.log_mark()
    for method, path in (("GET", "/v1/models"), ("GET", "/v1/models/smollm2:135m"),
                         ("GET", "/metrics"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                         ("POST", "/v1/completions"), ("POST", "/api/load")):
        r = httpx.request(method, f"{server.url}{path}", headers=headers, json={}, timeout=30)
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_api_key")
    # Ollama's routes answer in Ollama's shape.
    r = httpx.post(f"{server.url}/api/chat", headers=headers, json={}, timeout=30)
    assert r.status_code == 401 and isinstance(r.json()["error"], str)
    assert "Loaded" not in server.log_since(mark)


def test_health_and_preflights_need_no_key(server):
    h = httpx.get(f"{server.url}/health", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    r = httpx.options(f"{server.url}/v1/chat/completions", timeout=10)
    assert r.status_code == 204


# --- CORS -----------------------------------------------------------------------------------

def preflight(server: KilnServer, path: str, origin: str) -> httpx.Response:
    return httpx.options(f"{server.url}{path}", timeout=10, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://localhost",
                                    "https://localhost:8443", "http://127.0.0.1:5173",
                                    "http://[::1]:8080", APP_ORIGIN])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models/smollm2:135m",
                                  "/tokenize", "/metrics", "/health"])
def test_a_preflight_from_an_allowed_origin_is_answered(server, origin, path):
    r = preflight(server, path, origin)
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == origin
    assert "Origin" in r.headers["vary"]
    methods = {m.strip() for m in r.headers["access-control-allow-methods"].split(",")}
    assert methods & {"GET", "POST"} and "OPTIONS" in methods
    allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "x-stainless-os"} <= allowed
    assert int(r.headers["access-control-max-age"]) > 0


@pytest.mark.parametrize("origin", ["https://evil.example", "http://localhost.evil.example",
                                    "http://evil.example:3000", "null", "file://",
                                    "http://localhost@evil.example", "https://app.example.evil",
                                    "ftp://localhost"])
def test_any_other_origin_gets_no_cors_headers(server, origin):
    r = preflight(server, "/v1/chat/completions", origin)
    assert not any(h.startswith("access-control-") for h in r.headers), r.headers
    r = httpx.get(f"{server.url}/v1/models", headers={**AUTH, "Origin": origin}, timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_responses_carry_the_origin_streams_and_401s_too(server, files):
    origin = "http://localhost:3000"
    body = {"model": str(files[0]), "messages": HI, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120,
                      headers={**AUTH, "Origin": origin}) as r:
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == origin
        assert "data: [DONE]" in r.read().decode()
    r = httpx.get(f"{server.url}/v1/models", headers={"Origin": origin}, timeout=10)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == origin
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120,
                      headers={**AUTH, "Origin": "https://evil.example"}) as r:
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r.read()


# --- model names ----------------------------------------------------------------------------

def not_found_bodies(server: KilnServer, name: str) -> list[dict]:
    """The answers of every route that takes a model name."""
    out = []
    for path, body in (("/v1/chat/completions", {"model": name, "messages": HI,
                                                 "max_tokens": 1}),
                       ("/v1/completions", {"model": name, "prompt": "a", "max_tokens": 1}),
                       ("/tokenize", {"model": name, "prompt": "a"}),
                       ("/api/load", {"model": name})):
        r = post(server, path, body)
        assert r.status_code == 404, (path, name, r.text)
        out.append(r.json())
    with pytest.raises(openai.NotFoundError) as err:
        client(server).models.retrieve(name)
    out.append({"error": err.value.body})
    return out


def test_paths_and_odd_names_are_the_same_404(server, files, smollm2_gguf):
    start, models = files
    served = server.health()["model"]
    names = ["/etc/passwd", "/etc/shadow", "/etc/nonexistent.gguf", smollm2_gguf,
             str(models / "bare.gguf"), "../models/bare.gguf", "./bare.gguf",
             "bare.gguf/../bare.gguf", "models/bare", "../../../../etc/passwd",
             "~/.cache/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf", "notes.txt", "notes",
             "broken.gguf", "broken", "a" * 300, "x" * 300 + ".gguf", "bare.GGUF", "bare.gguf ",
             "nul\u0000.gguf", "SmolLM2-135M-Instruct.Q4_1.gguf", str(start) + "x"]
    mark = server.log_mark()
    reference = not_found_bodies(server, "no-such-model")[0]
    assert reference["error"]["code"] == "model_not_found"
    for name in names:
        for body in not_found_bodies(server, name):
            assert body == reference, name
    log = server.log_since(mark)
    assert "Traceback" not in log and "passwd" not in log and "Loaded" not in log
    assert server.health()["model"] == served


def test_a_models_dir_file_is_usable_by_name_or_stem(server, files):
    """bare.gguf has no chat template: it completes text, and chat is a 400, not a 500."""
    c = client(server)
    cards = {m.id: m.model_dump() for m in c.models.list().data}
    assert {"bare.gguf", str(files[0]), "smollm2:135m"} <= set(cards)
    assert not ({"broken.gguf", "notes.txt"} & set(cards))
    assert not cards["bare.gguf"]["loaded"] and cards["bare.gguf"]["context_length"] is None
    mark = server.log_mark()
    r = post(server, "/api/load", {"model": "bare"})
    assert r.status_code == 200 and r.json()["model"] == "bare.gguf"
    done = c.completions.create(model="bare.gguf", prompt="Hello", max_tokens=2)
    assert done.model == "bare.gguf" and done.usage.completion_tokens >= 1
    assert server.log_since(mark).count("Loaded") == 1  # both names are the same model
    card = c.models.retrieve("bare.gguf").model_dump()
    assert card["loaded"] and card["context_length"] == 512
    assert server.health()["model"] == "bare.gguf"

    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="bare", messages=HI, max_tokens=2)
    assert err.value.body["code"] == "no_chat_template"
    r = post(server, "/tokenize", {"model": "bare", "messages": HI})
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"
    assert post(server, "/tokenize", {"model": "bare", "prompt": "Hi"}).status_code == 200
    assert "Traceback" not in server.log_text()

    # The model the server was started with stays nameable by its path.
    reply = c.chat.completions.create(model=str(files[0]), messages=HI, max_tokens=2)
    assert reply.model == str(files[0])
