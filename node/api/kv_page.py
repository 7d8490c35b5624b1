"""``GET /kv``: the live block map, a page of plain HTML, CSS and JavaScript shipped in the
package (files under ``kv_page_assets/``), and its feed ``GET /kv/events`` (server-sent events, one
``map`` event per map the scheduler sends, see ``kv_map``).

A browser cannot put a bearer header on a page load or an EventSource, so with ``--api-key``
the page asks for the key once and keeps it in a cookie (``KEY_COOKIE``, ``SameSite=Strict``,
path ``/kv``), which the key check accepts on the page's own paths only: the cookie never
authorizes the API (no cross-site request can use it either). The page's script sets the
cookie, so it cannot be ``HttpOnly``.
"""

from __future__ import annotations

import hmac
from functools import cache
from importlib import resources
from urllib.parse import unquote

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from pagedllm.api.event_stream import EventStreamResponse
from pagedllm.api.serving import ServingContext

KEY_COOKIE = "pagedllm_api_key"
PAGE_PATH = "/kv"
ASSETS = {"kv.js": "text/javascript", "kv.css": "text/css"}


@cache
def asset(name: str) -> bytes:
    return resources.files("pagedllm.api").joinpath("kv_page_assets", name).read_bytes()


def on_page(path: str) -> bool:
    """Whether ``path`` is the page or one of its files or its feed (where the cookie counts)."""
    return path == PAGE_PATH or path.startswith(PAGE_PATH + "/")


def cookie_key(cookie_header: bytes) -> bytes | None:
    """The API key a ``Cookie`` header carries in ``KEY_COOKIE``, or None."""
    for part in cookie_header.decode("latin-1").split(";"):
        name, _, value = part.strip().partition("=")
        if name == KEY_COOKIE:
            return unquote(value).encode()
    return None


def cookie_matches(cookie_header: bytes, api_key: str) -> bool:
    given = cookie_key(cookie_header)
    return given is not None and hmac.compare_digest(given, api_key.encode())


def login_page() -> HTMLResponse:
    """What ``GET /kv`` answers without the key: a form that stores it in the cookie."""
    return HTMLResponse(asset("login.html"), status_code=401)


def add_kv_page_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.get(PAGE_PATH)
    async def page() -> Response:
        return HTMLResponse(asset("index.html"), headers={"Cache-Control": "no-cache"})

    # Before the files' route, which would take "events" for a file name.
    @app.get(PAGE_PATH + "/events")
    async def events() -> Response:
        ctx.check_admitting()
        view = ctx.client.kv_map
        viewer = view.subscribe()
        return EventStreamResponse(view.stream(viewer), lambda: view.unsubscribe(viewer))

    @app.get(PAGE_PATH + "/{name}")
    async def page_file(name: str) -> Response:
        if name not in ASSETS:
            return Response(status_code=404)
        return Response(asset(name), media_type=ASSETS[name])
