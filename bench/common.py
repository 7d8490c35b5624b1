"""What the benchmarks share: the benchmark model, the workload, targets, tables and results.

The default model is a ~100M-parameter Llama-shaped checkpoint with random weights and the demo
model's tokenizer, written once under the PagedLLM cache. Random weights change nothing in the
cost of a forward pass, and every benchmark ignores EOS, so outputs have the lengths asked for.
"""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
# transformers as a baseline runs its own PyTorch layers, not kernels fetched from the Hub
# (transformers >= 5.25 swaps some in by default; none can be fetched offline), here and in the
# peers started from here, so its figures do not change with an environment variable.
os.environ["USE_HUB_KERNELS"] = "NO"
# The machine's load before the benchmark adds its own.
LOAD_AT_START = os.getloadavg()[0]

BENCH_MODEL_NAME = "bench-llama-100m"
# Llama-3-shaped (grouped-query attention, SwiGLU), scaled to ~100M parameters: 12 layers of
# width 768 with 12 query and 4 KV heads and an MLP of 3072, over the demo tokenizer's vocab.
BENCH_MODEL_SHAPE = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 2048,
}
# The demo tokenizer's special tokens take the first ids: prompts draw from the rest.
FIRST_PLAIN_TOKEN = 5


def cache_dir() -> Path:
    from pagedllm.cache import cache_root

    return cache_root()


def bench_model_dir() -> Path:
    """The benchmark model's directory, written on first use (a few seconds)."""
    from pagedllm.cache import cached_dir

    return cached_dir(cache_dir() / BENCH_MODEL_NAME, _write_bench_model, marker="config.json")


def _write_bench_model(directory: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pagedllm.models.demo import demo_model_dir

    demo = demo_model_dir()
    demo_config = json.loads((demo / "config.json").read_text())
    config = LlamaConfig(
        **BENCH_MODEL_SHAPE,
        vocab_size=demo_config["vocab_size"],
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=demo_config["bos_token_id"],
        eos_token_id=demo_config["eos_token_id"],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(demo / name, directory / name)


def resolve_model(model: str | None) -> Path:
    """``--model``: a Hugging Face directory, a GGUF file (or a directory holding one), or a
    packaged model's name (``smollm2``); the benchmark model by default."""
    from pagedllm.config import resolve_model_dir

    return Path(resolve_model_dir(model)) if model else bench_model_dir()


def hf_model_dir(model: Path) -> Path:
    """A Hugging Face directory of ``model``, for the engines that cannot read GGUF files
    (transformers serve): the model itself, or a de-quantized float32 copy of a GGUF file,
    written once under the cache."""
    from pagedllm.cache import cached_dir
    from pagedllm.models.gguf import find_gguf_file

    gguf_file = find_gguf_file(model)
    if gguf_file is None:
        return model

    def write(directory: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        source = {"gguf_file": gguf_file.name}
        loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), dtype=torch.float32, **source
        )
        # Marked quantized by its file, which save_pretrained refuses; the weights are
        # already de-quantized, so a plain model takes them over.
        config = loaded.config
        del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(directory)
        AutoTokenizer.from_pretrained(str(gguf_file.parent), **source).save_pretrained(directory)

    stat = gguf_file.stat()
    name = f"hf-copy-{gguf_file.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    return cached_dir(cache_dir() / name, write, marker="config.json")


def model_summary(model_dir: Path) -> dict[str, Any]:
    from pagedllm.models.config import read_model_config

    config = read_model_config(model_dir)
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = config.head_dim
    kv_heads = config.num_key_value_heads
    inter = config.intermediate_size
    layers = config.num_hidden_layers
    vocab = config.vocab_size
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter + 2 * hidden
    embed = vocab * hidden * (1 if config.tie_word_embeddings else 2)
    return {
        "dir": str(model_dir),
        "layers": layers,
        "hidden_size": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "parameters": layers * per_layer + embed + hidden,
    }


# ----- workload ------------------------------------------------------------------------------


@dataclass
class Workload:
    """Requests of the vLLM comparisons: random prompts and output lengths, fixed seed."""

    prompts: list[list[int]]
    output_lens: list[int]
    seed: int
    spec: dict[str, int] = field(default_factory=dict)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(
    num_requests: int,
    vocab_size: int,
    seed: int = 0,
    prompt_len: int = 128,
    prompt_spread: int = 50,
    output_len: int = 256,
    output_spread: int = 100,
) -> Workload:
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num_requests):
        n = rng.randint(prompt_len - prompt_spread, prompt_len + prompt_spread)
        prompts.append([rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(n)])
        outputs.append(rng.randint(output_len - output_spread, output_len + output_spread))
    spec = {
        "num_requests": num_requests,
        "prompt_len": prompt_len,
        "prompt_spread": prompt_spread,
        "output_len": output_len,
        "output_spread": output_spread,
    }
    return Workload(prompts, outputs, seed, spec)


# What --dtype offers in the benchmarks: the same for every engine in a run.
DTYPE_CHOICES = ("float32", "bfloat16")
# The float benchmarks serve a quantized GGUF model (SmolLM2) de-quantized into the dtype, as
# the peers get it; bench/quantized.py measures the weights kept quantized.
QUANTIZATION = "none"


def kv_bytes_per_token(model_dir: Path, dtype: str = "float32") -> int:
    """Bytes of K and V, all layers, of one token in a ``dtype`` cache."""
    import torch

    s = model_summary(model_dir)
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * element


def vocab_size(model_dir: Path) -> int:
    return model_summary(model_dir)["vocab_size"]


# ----- machine and threads -------------------------------------------------------------------


def set_threads(num_threads: int) -> None:
    import torch

    torch.set_num_threads(num_threads)
    os.environ["OMP_NUM_THREADS"] = str(num_threads)


def machine_info() -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_1m_at_start": LOAD_AT_START,
        "load_average_1m_at_end": os.getloadavg()[0],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def warn_if_busy(limit: float = 1.0) -> None:
    load = os.getloadavg()[0]
    if load >= limit:
        print(
            f"warning: load average {load:.2f} >= {limit}: other processes share the cores "
            "and the figures will be low"
        )


# ----- targets, tables and results -----------------------------------------------------------


@dataclass
class Target:
    """One performance target, checked and printed; a benchmark never fails on it."""

    name: str
    value: float | None
    threshold: float
    at_most: bool = False
    unit: str = ""
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value <= self.threshold if self.at_most else self.value >= self.threshold

    def line(self) -> str:
        op = "<=" if self.at_most else ">="
        value = "n/a" if self.value is None else f"{self.value:.3g}{self.unit}"
        verdict = {True: "MET", False: "NOT MET", None: "NOT MEASURED"}[self.met]
        note = f"  ({self.note})" if self.note else ""
        target = f"{op} {self.threshold:g}{self.unit}"
        return f"  [{verdict:>12}] {self.name}: {value} (target {target}){note}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"met": self.met}


def print_targets(targets: Sequence[Target]) -> None:
    print("\nTargets")
    for target in targets:
        print(target.line())


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> None:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    if title:
        print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}"
    return str(value)


def write_json(name: str, data: dict[str, Any], output_dir: Path = RESULTS) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    return path


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.0):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def save_figure(fig: Any, name: str, output_dir: Path = RESULTS) -> Path:
    import matplotlib.pyplot as plt

    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a server about to start."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM to the process group a server was started in (``start_new_session``), then
    SIGKILL if it has not exited within ``timeout`` seconds."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
