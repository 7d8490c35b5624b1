"""The router process: load the tokenizer (never torch), follow the backends' feeds, serve
HTTP until SIGTERM, then drain like a node: /health turns 503 and requests in flight finish
(within ``--shutdown-timeout``) before it exits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import aiohttp
import uvicorn

from pagedllm.api import event_loop
from pagedllm.api.token_bytes import max_token_bytes
from pagedllm.api.tokenizing import TokenizingContext
from pagedllm.models import ModelLoadError
from pagedllm.models.tokenizer import load_tokenizer
from pagedllm.router.app import build_router_app
from pagedllm.router.args import RouterArgs
from pagedllm.router.feed import FeedFollower
from pagedllm.router.fleet import Fleet
from pagedllm.router.metrics import RouterMetrics
from pagedllm.router.proxy import Forwarder
from pagedllm.router.routing import Router
from pagedllm.router.state import RouterState
from pagedllm.runtime.child_process import LOG_FORMAT, forbid_torch

if TYPE_CHECKING:
    from pagedllm.router.waker import Waker

log = logging.getLogger(__name__)

# A backend source: calls on_change with the full set of backend URLs whenever it changes.
BackendSource = Callable[[Callable[[list[str]], None]], Awaitable[None]]
# Seconds open connections get once the drain is over (or its deadline passed).
CONNECTIONS_GRACE_S = 1
# How long opening a connection to a node may take before it counts as refused.
CONNECT_TIMEOUT_S = 5.0
# How often the drain looks at what is still in flight.
DRAIN_POLL_S = 0.05


class _DrainingServer(uvicorn.Server):
    """SIGTERM or SIGINT: /health 503, wait for requests in flight (up to the timeout), then
    stop. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, state: RouterState, timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.timeout = timeout
        self._drain: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        try:
            yield
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    def _on_signal(self) -> None:
        if self.state.draining:
            self.should_exit = self.force_exit = True
            return
        self.state.draining = True
        log.info("draining: %d requests in flight", self.state.in_flight)
        self._drain = asyncio.get_running_loop().create_task(self._wait_then_exit())

    async def _wait_then_exit(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self.state.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.state.in_flight:
            log.warning(
                "--shutdown-timeout %g s passed with %d requests in flight: they are cut",
                self.timeout,
                self.state.in_flight,
            )
        self.should_exit = True


def _waker(args: RouterArgs, state: RouterState) -> Waker:
    """Asks for capacity while requests are held (credentials as discovery has them)."""
    # Imported only here, like discovery: the kubernetes package is not needed without it.
    from pagedllm.router.discovery import load_api_client
    from pagedllm.router.waker import ScaleTarget, Waker

    assert args.scale_from_zero is not None and args.discover_namespace is not None
    target = ScaleTarget(
        args.discover_namespace, args.scale_from_zero, args.scale_from_zero_replicas
    )
    fleet = state.router.fleet
    waker = Waker(
        target,
        load_api_client(),
        held=lambda: state.router.held,
        ready=lambda: bool(fleet.ready()),
    )
    state.router.on_hold = waker.poke
    return waker


def main(args: RouterArgs, sources: Sequence[BackendSource] = ()) -> int:
    """Run the router until SIGTERM; the exit status. ``sources`` replace ``--backends``."""
    forbid_torch()
    logging.basicConfig(
        level=args.log_level.upper(),
        format=LOG_FORMAT.format(name="router"),
        stream=sys.stderr,
        force=True,
    )
    try:
        tokenizer = load_tokenizer(args.model_dir)
    except ModelLoadError as error:
        log.error("%s", error)
        return 1
    ctx = TokenizingContext(
        tokenizer=tokenizer,
        model_names=args.model_names,
        model_dir=args.model_dir,
        max_model_len=args.model.max_model_len,
        vocab_size=args.model.vocab_size,
        max_token_bytes=max_token_bytes(tokenizer),
        chat=args.chat,
    )
    try:
        event_loop.run(_serve(args, ctx, sources))
    except OSError as error:
        log.error("cannot serve on %s:%d: %s", args.host, args.port, error)
        return 1
    return 0


async def _serve(
    args: RouterArgs, ctx: TokenizingContext, sources: Sequence[BackendSource]
) -> None:
    auth = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = new_client_session()
    fleet = Fleet(FeedFollower(client, auth))
    metrics = RouterMetrics(fleet)
    state = RouterState(
        ctx=ctx,
        router=Router(fleet, args.routing, metrics),
        forwarder=Forwarder(client, fleet, metrics, args.api_key),
        metrics=metrics,
    )
    config = uvicorn.Config(
        build_router_app(state, args.api_key),
        host=args.host,
        port=args.port,
        log_config=None,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=CONNECTIONS_GRACE_S,
        timeout_keep_alive=30,
    )
    server = _DrainingServer(config, state, args.shutdown_timeout)
    watchers = [asyncio.create_task(source(fleet.set_backends)) for source in sources]
    if args.scale_from_zero is not None and args.discover_namespace is not None:
        watchers.append(asyncio.create_task(_waker(args, state).run(), name="scale-from-zero"))
    if not sources:
        fleet.set_backends(args.backends)
    try:
        await server.serve()
    finally:
        for watcher in watchers:
            watcher.cancel()
        await fleet.close()
        await client.close()


def new_client_session() -> aiohttp.ClientSession:
    """The one HTTP client of the router's requests to the nodes: aiohttp, whose C parser
    costs the relay of a streamed token about half of what a pure-Python client does."""
    return aiohttp.ClientSession(
        # No read timeout on answers: a generation may take minutes between its bytes.
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
        # No limit on connections; idle ones kept below the nodes' 30 s keep-alive.
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=15),
        # Clients' cookies are theirs: none is kept between requests.
        cookie_jar=aiohttp.DummyCookieJar(),
    )
