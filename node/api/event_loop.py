"""The event loop the HTTP processes (a node's API servers, the router) run on.

uvloop where it is installed (a dependency on Linux and macOS): its loop and uvicorn's
httptools parser take a fraction of asyncio's CPU time per request and per streamed chunk,
which a router in front of every request and an API server sharing the cores with the model
both feel. Plain asyncio elsewhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
