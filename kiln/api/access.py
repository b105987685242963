"""Who may call the server: the API key (`--api-key`, `KILN_API_KEY`) and CORS
(`--allowed-origins`), as Sanic middleware over every route.

- With a key, every request but `GET /health`, the chat page's files and CORS preflights
  must carry `Authorization: Bearer <key>` (compared in constant time); otherwise a 401 in
  the route's error shape: OpenAI's, or Ollama's `{"error": "..."}` under `/api/` (but
  `/api/load`, kiln's own). Without a key nothing is checked.
- Pages from localhost origins (http or https; localhost, 127.0.0.1 or [::1]; any port) may
  call the API, and so may the origins `--allowed-origins` names (`*`: any); any other origin
  gets no CORS headers, so the browser keeps the response from the page. Every route answers a
  preflight `OPTIONS` with a 204; the headers go on every response, streamed ones included.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from sanic import Sanic
from sanic.response import empty
from sanic.response import json as sanic_json

from kiln.api.errors import AuthenticationError, error_body, http_status

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
OPEN_PATHS = frozenset({"/health"})
ALLOW_HEADERS = ("Authorization", "Content-Type")
PREFLIGHT_MAX_AGE_S = 600
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")


def is_local_origin(origin: str) -> bool:
    try:
        u = urlsplit(origin)
        u.port  # noqa: B018 (a bad port raises ValueError)
    except ValueError:
        return False
    return u.scheme in ("http", "https") and u.hostname in LOCAL_HOSTS \
        and not (u.username or u.password or u.path or u.query or u.fragment)


def _normal_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


@dataclass(frozen=True)
class AccessPolicy:
    api_key: str | None = None  # None: no key needed
    allowed_origins: tuple[str, ...] = ()  # besides localhost's; "*" lets every origin in

    @classmethod
    def from_flags(cls, api_key: str | None, allowed_origins: str | None) -> AccessPolicy:
        origins = tuple(_normal_origin(o) for o in (allowed_origins or "").split(",")
                        if o.strip())
        return cls(api_key=api_key or None, allowed_origins=origins)

    def authorized(self, authorization: str | None) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        # Constant time: how much of a guess matches must not show in the reply's timing.
        return hmac.compare_digest(token.strip().encode("utf-8", "surrogatepass"),
                                   self.api_key.encode("utf-8", "surrogatepass"))

    def origin_allowed(self, origin: str | None) -> bool:
        if not origin:
            return False
        return is_local_origin(origin) or "*" in self.allowed_origins \
            or _normal_origin(origin) in self.allowed_origins


def ollama_shaped(path: str) -> bool:
    """Ollama's routes answer errors in Ollama's shape; `/api/load` is kiln's own."""
    return path.startswith("/api/") and path != "/api/load"


def unauthorized(request):
    exc = AuthenticationError(missing=not request.headers.get("authorization"))
    body = {"error": exc.message} if ollama_shaped(request.path) else error_body(exc)
    return sanic_json(body, status=http_status(exc), headers={"WWW-Authenticate": "Bearer"})


def install(app: Sanic, policy: AccessPolicy, open_paths: frozenset[str] = frozenset()
            ) -> None:
    """The key check and the CORS headers on every route of `app`, and a preflight route for
    every path (added at start-up, so routes registered after this call are covered too).
    open_paths: paths that need no key besides /health (the chat page's files)."""
    open_paths = OPEN_PATHS | open_paths

    @app.on_request
    async def check_key(request):
        if request.method == "OPTIONS" or request.path in open_paths:
            return None
        if not policy.authorized(request.headers.get("authorization")):
            return unauthorized(request)
        return None

    @app.on_response
    async def cors_headers(request, response):
        response.headers["Vary"] = "Origin"
        origin = request.headers.get("origin")
        if policy.origin_allowed(origin):
            response.headers["Access-Control-Allow-Origin"] = origin

    def preflight(methods: str):
        async def answer(request, **_):
            if not policy.origin_allowed(request.headers.get("origin")):
                return empty(status=204)
            asked = (h.strip() for h in
                     request.headers.get("access-control-request-headers", "").split(","))
            names = {h.lower(): h for h in (*asked, *ALLOW_HEADERS) if _HEADER_NAME.match(h)}
            return empty(status=204, headers={
                "Access-Control-Allow-Methods": methods,
                "Access-Control-Allow-Headers": ", ".join(names.values()),
                "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)})
        return answer

    @app.before_server_start
    async def add_preflight_routes(app):
        """An OPTIONS route beside every route that has none (Sanic answers 405 otherwise),
        as Sanic's own CORS recipe does: the router is rebuilt with them."""
        methods: dict[str, set[str]] = {}
        for route in app.router.routes:
            methods.setdefault(route.uri, set()).update(route.methods)
        app.router.reset()
        for i, (uri, allowed) in enumerate(sorted(methods.items())):
            if "OPTIONS" not in allowed:
                app.add_route(preflight(", ".join(sorted(allowed | {"OPTIONS"}))), uri,
                              methods=["OPTIONS"], name=f"preflight_{i}")
        app.finalize()  # the router, and each route's middleware
