"""What the router's routes share."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.api.tokenizing import TokenizingContext
from pagedllm.router.metrics import RouterMetrics
from pagedllm.router.proxy import Forwarder
from pagedllm.router.routing import Router


@dataclass
class RouterState:
    """``draining`` turns /health to 503 (set on SIGTERM); ``in_flight`` counts forwarded
    requests until their answer's last byte is relayed (the drain waits for them)."""

    ctx: TokenizingContext
    router: Router
    forwarder: Forwarder
    metrics: RouterMetrics
    draining: bool = False
    in_flight: int = 0
