"""A stand-in node that answers at once, for measuring what the router itself adds.

It speaks what `pagedllm router` needs of a node: ``GET /v1/kv_events`` (a snapshot of an
empty cache, then an update every second with an idle load) and ``POST /v1/completions``,
streamed (``--tokens`` OpenAI-shaped chunks, then ``[DONE]``) or not. No model runs, so a
request's time is the HTTP path's alone: called directly and through a router, the difference
is the router's.

    python bench/instant_node.py --port 8801 [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import time
from typing import Any

from aiohttp import web

from pagedllm.core.kv_events import FEED_VERSION

BLOCK_SIZE = 16
IDLE = {"running": 0, "waiting": 0, "kv_usage": 0.0}


def _completion(request_id: str, created: int, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": "bench",
        "choices": choices,
    }


def _choice(text: str, finish: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def app(tokens: int, interval_s: float) -> web.Application:
    ids = itertools.count()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        request_id, created = f"cmpl-{next(ids)}", int(time.time())
        count = min(int(body.get("max_tokens") or tokens), tokens)
        usage = {"prompt_tokens": 1, "completion_tokens": count, "total_tokens": count + 1}
        if not body.get("stream"):
            choices = [_choice(" x" * count, "length")]
            return web.json_response(_completion(request_id, created, choices) | {"usage": usage})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i in range(count):
            if i and interval_s:
                await asyncio.sleep(interval_s)
            choice = _choice(" x", "length" if i == count - 1 else None)
            await response.write(_event(_completion(request_id, created, [choice])))
        if (body.get("stream_options") or {}).get("include_usage"):
            last = _completion(request_id, created, []) | {"usage": usage}
            await response.write(_event(last))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def kv_events(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "application/x-ndjson"})
        await response.prepare(request)
        snapshot = {
            "type": "snapshot",
            "version": FEED_VERSION,
            "seq": 0,
            "block_size": BLOCK_SIZE,
            "hash_seed": 0,
            "num_blocks": 1 << 16,
            "blocks": [],
            "load": IDLE,
            "adapters": [],
        }
        await response.write(json.dumps(snapshot).encode() + b"\n")
        for seq in itertools.count(1):
            await asyncio.sleep(1.0)
            update = {"type": "update", "seq": seq, "stored": [], "removed": [], "load": IDLE}
            await response.write(json.dumps(update).encode() + b"\n")
        return response  # never reached: the subscriber hangs up

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    application = web.Application()
    application.router.add_post("/v1/completions", completions)
    application.router.add_get("/v1/kv_events", kv_events)
    application.router.add_get("/health", health)
    return application


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument(
        "--interval-ms",
        type=float,
        default=0.0,
        help="time between a stream's tokens, the first sent at once (a node's decode step)",
    )
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper())
    application = app(args.tokens, args.interval_ms / 1e3)
    web.run_app(application, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
