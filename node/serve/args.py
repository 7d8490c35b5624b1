"""`pagedllm serve` flags (vLLM's names and meanings where vLLM has the flag), checked once.

Everything that can be known before starting a process is checked here, so that a wrong flag
or model directory stops the command at once with a message instead of a dying child.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.api.chat_settings import ChatSettings, chat_template_arg
from pagedllm.api.limits import MAX_N_LIMIT, RequestLimits
from pagedllm.api.tool_parsers import PARSERS
from pagedllm.config import (
    DTYPE_CHOICES,
    KV_CACHE_DTYPES,
    QUANTIZATION_CHOICES,
    EngineConfig,
    resolve_model_dir,
)
from pagedllm.kernels import BACKENDS
from pagedllm.models.named import NAMED_MODELS
from pagedllm.runtime.flags import (
    API_KEY_ENV,
    LOG_LEVELS,
    integer,
    non_negative_float,
    port_number,
    positive_float,
    positive_int,
)

if TYPE_CHECKING:
    from pagedllm.lora.peft_files import Shapes
    from pagedllm.models.config import ModelConfig

DEMO_MODEL_NAME = "pagedllm-demo"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# 0: the front processes keep the workers' priority (see --api-server-nice).
DEFAULT_API_SERVER_NICE = 0
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


@dataclass
class ServeArgs:
    engine: EngineConfig
    model_dir: str
    tokenizer_dir: str
    model_names: list[str]
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    host: str
    port: int
    api_key: str | None
    max_waiting: int | None
    request_limits: RequestLimits
    shutdown_timeout: float
    step_timeout: float
    api_server_count: int
    api_server_nice: int
    async_scheduling: bool
    log_level: str
    chat: ChatSettings = field(default_factory=ChatSettings)
    otlp_traces_endpoint: str | None = None
    # --lora-modules: the adapters requests may name as their model, name -> directory.
    lora_modules: dict[str, str] = field(default_factory=dict)
    # The model's projections adapters are checked against (with --enable-lora).
    lora_shapes: Shapes = field(default_factory=dict)
    # --allow-runtime-lora-updating (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): the load and
    # unload endpoints.
    runtime_lora_updates: bool = False
    # --lora-modules-file: the watched list of adapters (absolute), see runtime.adapter_file.
    lora_modules_file: str | None = None


def otlp_endpoint(text: str) -> str:
    from pagedllm.runtime.tracing import traces_url

    try:
        traces_url(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text.strip()


def sample_count(text: str) -> int:
    value = positive_int(text)
    if value > MAX_N_LIMIT:
        raise argparse.ArgumentTypeError(f"n is at most {MAX_N_LIMIT} in the API, got {value}")
    return value


def niceness(text: str) -> int:
    value = integer(text, "an integer")
    if not 0 <= value <= 19:
        raise argparse.ArgumentTypeError(f"a niceness is between 0 and 19, got {value}")
    return value


def fraction(text: str) -> float:
    value = non_negative_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text}")
    return value


def lora_module(text: str) -> tuple[str, str]:
    """``NAME=PATH``, or vLLM's JSON form ``{"name": ..., "path": ...}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"--lora-modules: bad JSON: {error}") from None
        name, path = (value.get(k) if isinstance(value, dict) else None for k in ("name", "path"))
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path:
        raise argparse.ArgumentTypeError(
            f'--lora-modules: expected NAME=PATH or {{"name": ..., "path": ...}}, got {text!r}'
        )
    return name.strip(), path


def byte_size(text: str) -> int:
    """Bytes: ``33554432``, ``32MiB``, ``32M`` or ``1GiB`` (K/M/G/T are powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"expected a size in bytes such as 33554432, 32MiB or 1GiB, got {text!r}"
        )
    number, unit = int(match.group(1)), match.group(2).lower()
    value = number * 1024 ** " kmgt".index(unit or " ")
    if value < 1:
        raise argparse.ArgumentTypeError(f"the size must be positive, got {text!r}")
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument(
        "--model",
        default=None,
        help="local Hugging Face model directory, GGUF file (or a directory holding one), "
        "or smollm2 (default: the built-in demo model)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="take the tokenizer and chat template from this Hugging Face directory or GGUF "
        "file (default: the model's)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names clients use in `model` (the first appears in responses and "
        f"metrics; default: the --model value, or {DEMO_MODEL_NAME})",
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=port_number, default=8000, help="HTTP port (default 8000)")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require `Authorization: Bearer KEY` on the API (default: "
        f"${API_KEY_ENV} if set, else no key)",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        type=otlp_endpoint,
        default=None,
        metavar="URL",
        help="send a trace of every request to this OTLP/HTTP collector (e.g. "
        "http://collector:4318; the path /v1/traces is added to a URL without one)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="weights and activations; with quantized weights, the activations' (auto: the "
        "checkpoint's, float32 for a quantized GGUF file)",
    )
    p.add_argument(
        "--quantization",
        choices=QUANTIZATION_CHOICES,
        default=None,
        help="gguf: keep a GGUF file's quantized tensors quantized (the default for one); int8: "
        "quantize float weights to int8 in groups of 32; none: de-quantize into --dtype",
    )
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV-cache block")
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="the KV cache's element: auto (the model's dtype), 8-bit floats (fp8 = fp8_e4m3, "
        "fp8_e5m2) or int8 with a scale per token and head (int8_per_token_head, CPU), each "
        "holding about twice a bfloat16 cache's tokens in the same memory",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=fraction,
        default=0.9,
        help="share of accelerator memory for weights, activations and KV cache",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=byte_size,
        default=None,
        metavar="BYTES",
        help="KV-cache size per rank, e.g. 32MiB (overrides --gpu-memory-utilization)",
    )
    p.add_argument(
        "--max-num-batched-tokens", type=positive_int, default=2048, help="token budget of one step"
    )
    p.add_argument(
        "--max-num-seqs", type=positive_int, default=256, help="most sequences in the running batch"
    )
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="longest prompt + completion (default: the model's)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=positive_int,
        default=1,
        help="worker processes the model is sharded over",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV cache of identical prompt prefixes",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prefix-cache hash")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--kernel-backend",
        choices=BACKENDS,
        default="auto",
        help="attention kernels: Triton on CUDA, the C++ CPU kernels elsewhere "
        "(auto), or the pure-torch reference",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run decode steps through the eager modules, not as one C++ call",
    )
    p.add_argument(
        "--max-waiting",
        type=positive_int,
        default=None,
        help="answer 503 (Retry-After) while this many requests wait (default: no limit)",
    )
    defaults = RequestLimits()
    p.add_argument(
        "--max-prompts-per-request",
        type=positive_int,
        default=defaults.max_prompts_per_request,
        help="most prompts in one completions request (400 beyond; default "
        f"{defaults.max_prompts_per_request})",
    )
    p.add_argument(
        "--max-n",
        type=sample_count,
        default=defaults.max_n,
        help=f"largest n or best_of of a request (400 beyond; default {defaults.max_n}, "
        f"at most {MAX_N_LIMIT})",
    )
    p.add_argument(
        "--max-request-tokens",
        type=positive_int,
        default=defaults.max_request_tokens,
        help="most tokens one request may generate: sequences (best_of or n, times prompts) "
        f"times max_tokens (400 beyond; default {defaults.max_request_tokens})",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long in-flight requests may run before exit",
    )
    p.add_argument(
        "--step-timeout",
        type=positive_float,
        default=60.0,
        metavar="SECONDS",
        help="the least time a step may take before the node is declared stuck and fails "
        "(more for steps the measured speed says are long)",
    )
    p.add_argument(
        "--api-server-count",
        type=positive_int,
        default=1,
        help="HTTP front processes sharing the port",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send each step's plan before the previous step's samples are back, "
        "so the worker never waits for the scheduler (one worker only)",
    )
    p.add_argument(
        "--api-server-nice",
        type=niceness,
        default=DEFAULT_API_SERVER_NICE,
        metavar="0-19",
        help="CPU niceness of the HTTP front processes: above 0 their work (HTTP, "
        "detokenization) waits for the gaps between the workers' compute "
        "instead of stalling it, at the cost of slower admission under load",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE_OR_TEMPLATE",
        help="a Jinja chat template (a file, or the template itself) in place of the model's",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs '
        "--tool-call-parser",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        help="how tool calls are read from the model's text: hermes (Qwen2.5/Qwen3, Hermes, "
        "the built-in tool template), llama3_json (Llama 3.1-3.3), mistral",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (default: off)',
    )
    p.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters beside the base model"
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        default=[],
        metavar="NAME=PATH",
        help="PEFT adapters requests may name as their model (checked at start); needs "
        "--enable-lora",
    )
    p.add_argument(
        "--max-loras", type=positive_int, default=1, help="the most adapters one step runs"
    )
    p.add_argument(
        "--max-lora-rank", type=positive_int, default=16, help="the largest adapter rank accepted"
    )
    p.add_argument(
        "--max-cpu-loras",
        type=positive_int,
        default=None,
        help="adapters kept loaded, the least recently used dropped beyond (default: --max-loras)",
    )
    p.add_argument(
        "--lora-modules-file",
        default=None,
        metavar="PATH",
        help='a JSON list of {"name", "uri", "preload"} adapters (uri: a directory or '
        "hf://ORG/NAME[@REVISION]), watched while the node runs: adapters added to it are "
        "served, those taken out dropped; ready once the preload ones are served; needs "
        "--enable-lora",
    )
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="turn on POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's "
        f"{RUNTIME_LORA_ENV}=True does; needs --enable-lora)",
    )
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info")


def _exists(path: str) -> bool:
    return os.path.exists(os.path.expanduser(path))


def chat_settings(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> ChatSettings:
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    return ChatSettings(
        chat_template_arg(ns, parser), ns.enable_auto_tool_choice, ns.tool_call_parser
    )


def serve_args(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> ServeArgs:
    """The checked settings, or ``parser.error`` (exit 2) with what is wrong."""
    if ns.model is not None and ns.model not in NAMED_MODELS and not _exists(ns.model):
        parser.error(f"--model {ns.model}: no such directory or file")
    if ns.tokenizer is not None and not _exists(ns.tokenizer):
        parser.error(f"--tokenizer {ns.tokenizer}: no such directory or file")
    try:
        engine = EngineConfig(
            model=ns.model,
            tokenizer=ns.tokenizer,
            dtype=ns.dtype,
            quantization=ns.quantization,
            block_size=ns.block_size,
            kv_cache_memory=ns.kv_cache_memory,
            gpu_memory_utilization=ns.gpu_memory_utilization,
            max_num_seqs=ns.max_num_seqs,
            max_num_batched_tokens=ns.max_num_batched_tokens,
            max_model_len=ns.max_model_len,
            enable_prefix_caching=ns.enable_prefix_caching,
            seed=ns.seed,
            tensor_parallel_size=ns.tensor_parallel_size,
            kernel_backend=ns.kernel_backend,
            device=ns.device,
            speculative_config=ns.speculative_config,
            enable_lora=ns.enable_lora,
            max_loras=ns.max_loras,
            max_lora_rank=ns.max_lora_rank,
            max_cpu_loras=ns.max_cpu_loras,
            enforce_eager=ns.enforce_eager,
            kv_cache_dtype=ns.kv_cache_dtype,
        )
    except ValueError as error:
        parser.error(str(error))
    if ns.lora_modules and not ns.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    lora_modules_file = lora_modules_file_checked(ns, parser)
    runtime_lora = ns.allow_runtime_lora_updating or os.environ.get(
        RUNTIME_LORA_ENV, ""
    ).lower() in ("1", "true")
    if runtime_lora and not ns.enable_lora:
        parser.error(f"--allow-runtime-lora-updating ({RUNTIME_LORA_ENV}) needs --enable-lora")
    # Reading the model pulls in torch: only once the cheap checks passed.
    import torch

    # This process only supervises, and forks the workers. What torch computes here (writing
    # the demo model) stays on one thread, so that no OpenMP thread pool exists yet at the fork:
    # a pool inherited through fork deadlocks the child's first parallel region.
    torch.set_num_threads(1)
    from pagedllm.models import ModelLoadError
    from pagedllm.models.config import read_model_config

    try:
        model_dir = os.path.abspath(resolve_model_dir(ns.model))
        model = read_model_config(model_dir)
        model.check_tensor_parallel(engine.tensor_parallel_size)
    except ModelLoadError as error:
        parser.error(str(error))
    max_model_len = engine.max_model_len or model.max_position_embeddings
    if max_model_len > model.max_position_embeddings:
        parser.error(
            f"--max-model-len {max_model_len} exceeds the model's "
            f"max_position_embeddings ({model.max_position_embeddings})"
        )
    names = ns.served_model_name or [ns.model if ns.model is not None else DEMO_MODEL_NAME]
    shapes = lora_shapes(model) if ns.enable_lora else {}
    lora_modules = lora_modules_checked(ns.lora_modules, names, shapes, engine, parser)
    return ServeArgs(
        engine=engine,
        model_dir=model_dir,
        tokenizer_dir=os.path.abspath(os.path.expanduser(ns.tokenizer))
        if ns.tokenizer
        else model_dir,
        model_names=list(names),
        max_model_len=max_model_len,
        vocab_size=model.vocab_size,
        eos_token_ids=tuple(model.eos_token_ids),
        host=ns.host,
        port=ns.port,
        # Stripped: a key mounted from a Secret file often ends in a newline.
        api_key=(ns.api_key or os.environ.get(API_KEY_ENV) or "").strip() or None,
        max_waiting=ns.max_waiting,
        request_limits=RequestLimits(ns.max_prompts_per_request, ns.max_n, ns.max_request_tokens),
        shutdown_timeout=ns.shutdown_timeout,
        step_timeout=ns.step_timeout,
        api_server_count=ns.api_server_count,
        api_server_nice=ns.api_server_nice,
        async_scheduling=ns.async_scheduling,
        log_level=ns.log_level,
        chat=chat_settings(ns, parser),
        otlp_traces_endpoint=ns.otlp_traces_endpoint,
        lora_modules=lora_modules,
        lora_shapes=shapes,
        runtime_lora_updates=runtime_lora,
        lora_modules_file=lora_modules_file,
    )


def lora_modules_file_checked(
    ns: argparse.Namespace, parser: argparse.ArgumentParser
) -> str | None:
    """``--lora-modules-file`` as an absolute path, read once here so that a file that
    cannot serve stops the command at once (later changes are only logged when wrong)."""
    if ns.lora_modules_file is None:
        return None
    if not ns.enable_lora:
        parser.error("--lora-modules-file needs --enable-lora")
    from pagedllm.runtime.adapter_file import AdapterFileError, read_adapter_file

    path = os.path.abspath(os.path.expanduser(ns.lora_modules_file))
    try:
        entries = read_adapter_file(path)
    except AdapterFileError as error:
        parser.error(f"--lora-modules-file {error}")
    fixed = {name for name, _ in ns.lora_modules}
    for entry in entries:
        if entry.name in fixed:
            parser.error(
                f"--lora-modules-file: the adapter {entry.name!r} is in --lora-modules too"
            )
    return path


def lora_modules_checked(
    modules: list[tuple[str, str]],
    model_names: list[str],
    shapes: Shapes,
    engine: EngineConfig,
    parser: argparse.ArgumentParser,
) -> dict[str, str]:
    """``--lora-modules`` as name -> absolute directory, each adapter read and checked against
    the model, or ``parser.error`` naming the adapter and its problem."""
    from pagedllm.lora.peft_files import check_adapter

    out: dict[str, str] = {}
    for name, path in modules:
        if name in out or name in model_names:
            parser.error(f"--lora-modules: the name {name!r} is given twice")
        try:
            check_adapter(name, os.path.expanduser(path), engine.max_lora_rank, shapes)
        except ValueError as error:
            parser.error(f"--lora-modules {name}: {error}")
        out[name] = os.path.abspath(os.path.expanduser(path))
    return out


def lora_shapes(model: ModelConfig) -> Shapes:
    from pagedllm.lora.peft_files import model_shapes

    return model_shapes(
        model.num_hidden_layers,
        model.hidden_size,
        model.intermediate_size,
        model.num_attention_heads,
        model.num_key_value_heads,
        model.head_dim,
    )
