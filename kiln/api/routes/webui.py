"""The chat page at `/` (`kiln serve --no-webui` leaves it out): the files of kiln/api/webui,
read once from the package and served by name from a fixed list, so no request ever names a
path on disk. Every file goes out with a Content-Security-Policy that lets the page load and
call nothing beyond the server it came from, and run no inline script: model text the page
shows can never become live code, even through a bug in its own renderer."""

from __future__ import annotations

from importlib.resources import files

from sanic import Sanic
from sanic.exceptions import NotFound
from sanic.response import raw

CONTENT_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
    "api.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "store.js": "text/javascript; charset=utf-8",
    "settings.js": "text/javascript; charset=utf-8",
    "stats.js": "text/javascript; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
}

CSP = ("default-src 'self'; base-uri 'self'; form-action 'self'; object-src 'none'; "
       "frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}

# The page and its files load without the API key (they hold no secret); the calls the
# page makes carry it.
PATHS = frozenset({"/", *(f"/webui/{name}" for name in CONTENT_TYPES)})


def read_files() -> dict[str, bytes]:
    folder = files("kiln.api") / "webui"
    return {name: (folder / name).read_bytes() for name in CONTENT_TYPES}


def install(app: Sanic) -> frozenset[str]:
    """Adds the page's routes to `app`; returns the paths that need no API key."""
    contents = read_files()

    def answer(name: str):
        return raw(contents[name], content_type=CONTENT_TYPES[name], headers=HEADERS)

    async def index(request):
        return answer("index.html")

    async def asset(request, name: str):
        if name not in contents:
            raise NotFound("The chat page has no such file.")
        return answer(name)

    app.add_route(index, "/", methods=["GET"], name="webui_index")
    app.add_route(asset, "/webui/<name:str>", methods=["GET"], name="webui_asset")
    return PATHS
