"""`pagedllm router` flags, checked once: a wrong flag, URL or model directory stops the command
at once with a message."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pagedllm.api.chat_settings import ChatSettings, chat_template_arg
from pagedllm.router.policy import Policy
from pagedllm.router.routing import RoutingSettings
from pagedllm.runtime.flags import (
    API_KEY_ENV,
    LOG_LEVELS,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)

DEFAULT_PORT = 8000


@dataclass
class ModelFacts:
    """What the router needs of the model besides its tokenizer (read from config.json)."""

    max_model_len: int
    vocab_size: int


@dataclass
class RouterArgs:
    model_dir: str
    model_names: list[str]
    model: ModelFacts
    # Only the template matters here: the router renders chats, it reads no tool calls.
    chat: ChatSettings
    backends: list[str]  # empty when discovering them
    host: str
    port: int
    routing: RoutingSettings
    api_key: str | None
    shutdown_timeout: float
    log_level: str
    # The Kubernetes Service whose ready endpoints are the backends (instead of --backends).
    discover_namespace: str | None = None
    discover_service: str | None = None
    # The PagedLLM (in the discovery namespace) to scale from zero while requests are held.
    scale_from_zero: str | None = None
    scale_from_zero_replicas: int = 1


def backend_url(text: str) -> str:
    """``http://HOST:PORT`` (or https), without a trailing slash."""
    url = text.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(
            f"expected a URL such as http://10.0.0.5:8000, got {text!r}"
        )
    if parts.path or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"a backend URL has no path or query, got {text!r}")
    try:
        parts.port  # noqa: B018 - parsing it is the check
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port in {text!r}") from None
    return url


def backend_list(text: str) -> list[str]:
    urls = [backend_url(u) for u in text.split(",") if u.strip()]
    if not urls:
        raise argparse.ArgumentTypeError("expected at least one backend URL")
    return list(dict.fromkeys(urls))


def kubernetes_name(text: str) -> str:
    """A namespace or Service name (an RFC 1123 label)."""
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", text) or len(text) > 63:
        raise argparse.ArgumentTypeError(
            f"expected a Kubernetes name (lower case letters, digits and '-', at most 63), "
            f"got {text!r}"
        )
    return text


def load_bound(text: str) -> float:
    value = positive_float(text)
    if value < 1 or math.isinf(value):
        raise argparse.ArgumentTypeError(
            f"the load bound is a finite factor of the mean load, at least 1, got {text}"
        )
    return value


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--model", required=True, help="the nodes' model directory (tokenizer files)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names answered by /v1/models while no backend is ready (default: --model)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="a Jinja chat template (a file, or the template itself) in place of the model's; "
        "the nodes' own --chat-template, so that chats render as they do there",
    )
    p.add_argument(
        "--backends",
        type=backend_list,
        default=None,
        metavar="URL,URL",
        help="the serving nodes, e.g. http://127.0.0.1:8001,http://127.0.0.1:8002",
    )
    p.add_argument(
        "--discover-namespace",
        type=kubernetes_name,
        default=None,
        metavar="NAMESPACE",
        help="with --discover-service, instead of --backends: the namespace of the serving "
        "pods' Service",
    )
    p.add_argument(
        "--discover-service",
        type=kubernetes_name,
        default=None,
        metavar="SERVICE",
        help="route to the ready endpoints of this Service's port `http`, followed through "
        "its EndpointSlices (credentials: the pod's service account, else $KUBECONFIG)",
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument(
        "--port", type=port_number, default=DEFAULT_PORT, help="HTTP port (default 8000)"
    )
    p.add_argument(
        "--policy",
        choices=[policy.value for policy in Policy],
        default=Policy.PREFIX.value,
        help="prefix (default): the node caching the longest prefix, within the load bound; "
        "least-load; round-robin; random (what a Kubernetes Service does, for comparisons)",
    )
    p.add_argument(
        "--load-bound",
        type=load_bound,
        default=1.25,
        help="no node gets more than this times the mean load (default 1.25)",
    )
    p.add_argument(
        "--max-held-requests",
        type=non_negative_int,
        default=0,
        help="requests held while no node is ready (default 0: answer 503 with Retry-After)",
    )
    p.add_argument(
        "--hold-timeout",
        type=positive_float,
        default=600.0,
        metavar="SECONDS",
        help="how long a held request waits for a ready node (default 600)",
    )
    p.add_argument(
        "--scale-from-zero",
        type=kubernetes_name,
        default=None,
        metavar="PAGEDLLM",
        help="with discovery and --max-held-requests: while requests are held, write this "
        "PagedLLM's /scale (in --discover-namespace) if it is at zero replicas",
    )
    p.add_argument(
        "--scale-from-zero-replicas",
        type=positive_int,
        default=1,
        metavar="N",
        help="the replicas --scale-from-zero asks for (default 1)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require `Authorization: Bearer KEY`, and send it to the nodes (default: "
        f"${API_KEY_ENV})",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=30.0,
        metavar="SECONDS",
        help="how long SIGTERM lets requests in flight run (default 30)",
    )
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info")


def read_model_facts(model_dir: Path) -> ModelFacts:
    """The context length and vocabulary size from ``config.json``; ValueError says what is
    wrong."""
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {path}: {error}") from None
    values = {}
    for name in ("max_position_embeddings", "vocab_size"):
        value = config.get(name) if isinstance(config, dict) else None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{path}: {name} must be a positive integer, got {value!r}")
        values[name] = value
    return ModelFacts(values["max_position_embeddings"], values["vocab_size"])


def router_args(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> RouterArgs:
    model_dir = Path(ns.model).expanduser()
    if not model_dir.is_dir():
        parser.error(f"--model: directory {model_dir} does not exist")
    try:
        model = read_model_facts(model_dir)
    except ValueError as error:
        parser.error(f"--model: {error}")
    discovering = ns.discover_namespace is not None or ns.discover_service is not None
    if discovering and ns.backends is not None:
        parser.error("--backends and --discover-namespace/--discover-service exclude each other")
    if discovering and (ns.discover_namespace is None or ns.discover_service is None):
        parser.error("--discover-namespace and --discover-service go together")
    if not discovering and ns.backends is None:
        parser.error(
            "--backends is required (the serving nodes to route to), or "
            "--discover-namespace with --discover-service"
        )
    if ns.scale_from_zero is not None and not discovering:
        parser.error("--scale-from-zero needs --discover-namespace and --discover-service")
    if ns.scale_from_zero is not None and ns.max_held_requests == 0:
        parser.error("--scale-from-zero needs --max-held-requests above 0 (requests to hold)")
    return RouterArgs(
        model_dir=str(model_dir.resolve()),
        model_names=list(ns.served_model_name or [ns.model]),
        model=model,
        chat=ChatSettings(chat_template=chat_template_arg(ns, parser)),
        backends=ns.backends or [],
        host=ns.host,
        port=ns.port,
        routing=RoutingSettings(
            policy=Policy(ns.policy),
            load_bound=ns.load_bound,
            max_held_requests=ns.max_held_requests,
            hold_timeout=ns.hold_timeout,
        ),
        api_key=(ns.api_key or os.environ.get(API_KEY_ENV) or "").strip() or None,
        shutdown_timeout=ns.shutdown_timeout,
        log_level=ns.log_level,
        discover_namespace=ns.discover_namespace,
        discover_service=ns.discover_service,
        scale_from_zero=ns.scale_from_zero,
        scale_from_zero_replicas=ns.scale_from_zero_replicas,
    )
