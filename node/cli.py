"""The `pagedllm` command.

    pagedllm serve [--model DIR] [--port 8000] ...   serve the OpenAI API (see serve_args)
    pagedllm router --model DIR --backends URL,...  route requests to nodes by cached prefix
        (or --discover-namespace NS --discover-service SVC: the nodes of a Kubernetes Service)
    pagedllm generate [--prompt TEXT] ...            one offline generation, printed
    pagedllm demo-model DIR                          write the built-in demo checkpoint
    pagedllm download [--tokenizer-only] hf://ORG/NAME DIR   fetch a Hugging Face model (or
                                                     one GGUF file: hf://ORG/NAME/FILE.gguf)
    pagedllm operator [KOPF RUN OPTIONS]             run the Kubernetes operator

Heavy imports (torch, transformers, kopf) happen inside the subcommand that needs them, so
that `--help` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedllm.hub import HF_URI, HF_URI_FORMS
from pagedllm.router.args import RouterArgs, add_router_arguments, router_args
from pagedllm.serve.args import add_serve_arguments, byte_size, positive_int, serve_args

if TYPE_CHECKING:
    from pagedllm.router.server import BackendSource

# What tokenizing and chat templating read (routers need no weights): the tokenizer in any of
# its formats, its special tokens and chat template, and the small configs that name the
# tokenizer class and the end-of-sequence tokens.
TOKENIZER_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "chat_template*",
    "config.json",
    "generation_config.json",
)


def build_parser() -> argparse.ArgumentParser:
    """The `pagedllm` command line (the operator writes the `serve` flags into its pods)."""
    parser = argparse.ArgumentParser(
        prog="pagedllm", description="LLM serving with a paged KV cache"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_serve_arguments(serve)

    router = commands.add_parser(
        "router", help="route OpenAI requests to serving nodes by the prefix they have cached"
    )
    add_router_arguments(router)

    generate = commands.add_parser("generate", help="generate once, offline, and print it")
    generate.add_argument(
        "--model",
        default=None,
        help="model directory, GGUF file or smollm2 (default: the demo model)",
    )
    generate.add_argument(
        "--tokenizer", default=None, metavar="DIR", help="tokenizer directory or GGUF file"
    )
    generate.add_argument("--prompt", default="Hello, my name is")
    generate.add_argument("--max-tokens", type=positive_int, default=16)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--kv-cache-memory", type=byte_size, default=None, metavar="BYTES")

    demo = commands.add_parser("demo-model", help="write the demo checkpoint into DIR")
    demo.add_argument("directory", metavar="DIR")

    download = commands.add_parser(
        "download",
        help="download hf://ORG/NAME[@REVISION] (a repository) or "
        "hf://ORG/NAME[@REVISION]/FILE.gguf (one file of it) into DIR (token from $HF_TOKEN)",
    )
    download.add_argument(
        "--tokenizer-only",
        action="store_true",
        help="only the tokenizer, chat template and configs, no weights (for routers); a GGUF "
        "file is fetched whole, as it holds the tokenizer",
    )
    download.add_argument("source", metavar="hf://ORG/NAME[@REVISION][/FILE.gguf]")
    download.add_argument("directory", metavar="DIR")

    commands.add_parser(
        "operator", help="run the Kubernetes operator (kopf run options follow)", add_help=False
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["operator"]:
        # Everything after `operator` belongs to kopf, --help included.
        from pagedllm.operator import run

        return run(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        settings = serve_args(args, parser)
        from pagedllm.serve.supervisor import serve

        return serve(settings)
    if args.command == "router":
        router_settings = router_args(args, parser)
        from pagedllm.router.server import main as run_router

        return run_router(router_settings, _router_sources(router_settings))
    if args.command == "generate":
        return _generate(args, parser)
    if args.command == "demo-model":
        from pagedllm.models.demo import write_demo_model

        print(write_demo_model(args.directory))
        return 0
    if args.command == "download":
        return _download(args, parser)
    parser.error(f"unknown command {args.command}")
    return 2


def _router_sources(settings: RouterArgs) -> list[BackendSource]:
    """Kubernetes discovery when asked for (the static --backends otherwise)."""
    if settings.discover_service is None or settings.discover_namespace is None:
        return []
    # Imported only here: the kubernetes package is not needed for --backends.
    from pagedllm.router.discovery import DiscoveryError, DiscoveryTarget, EndpointSliceDiscovery

    target = DiscoveryTarget(settings.discover_namespace, settings.discover_service)
    try:
        return [EndpointSliceDiscovery(target).run]
    except DiscoveryError as error:
        print(f"pagedllm router: {error}", file=sys.stderr)
        raise SystemExit(1) from None


def _generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pagedllm import LLM, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
        )
        llm = LLM(model=args.model, tokenizer=args.tokenizer, kv_cache_memory=args.kv_cache_memory)
    except ValueError as error:
        parser.error(str(error))
    output = llm.generate([args.prompt], params, use_tqdm=False)[0]
    print(args.prompt + output.outputs[0].text)
    return 0


def _download(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    match = HF_URI.match(args.source)
    if match is None:
        parser.error(f"expected {HF_URI_FORMS}, got {args.source!r}")
    from huggingface_hub import hf_hub_download, snapshot_download

    if match["file"]:
        # A GGUF file carries its tokenizer and chat template: --tokenizer-only takes it whole.
        path = hf_hub_download(
            repo_id=match["repo"],
            filename=match["file"],
            revision=match["revision"],
            local_dir=args.directory,
        )
    else:
        path = snapshot_download(
            repo_id=match["repo"],
            revision=match["revision"],
            local_dir=args.directory,
            allow_patterns=list(TOKENIZER_FILES) if args.tokenizer_only else None,
        )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
