"""The `pagedllm` command: what a user sees from each subcommand and from wrong arguments."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.cli import HF_URI
from pagedllm.kernels import cpu_extension
from pagedllm.models.demo import DEMO_MODEL_DIR_NAME, demo_model_dir
from pagedllm.serve.worker_process import torch_threads
from pagedllm_testing.serve_harness import DEMO_MODEL, run, start_server


def test_help_lists_the_subcommands() -> None:
    result = run("--help")
    assert result.returncode == 0
    for command in ("serve", "generate", "demo-model", "download", "operator"):
        assert command in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--block-size", "0"], "expected a positive integer, got 0"),
        (["--port", "70000"], "a port is at most 65535"),
        (["--gpu-memory-utilization", "1.5"], "expected a fraction in (0, 1]"),
        (["--kv-cache-memory", "lots"], "expected a size in bytes"),
        (["--shutdown-timeout", "-1"], "expected a finite number >= 0"),
        (["--api-server-nice", "20"], "a niceness is between 0 and 19, got 20"),
        (["--max-prompts-per-request", "0"], "expected a positive integer, got 0"),
        (["--max-n", "129"], "n is at most 128 in the API, got 129"),
        (["--max-request-tokens", "many"], "expected a positive integer, got 'many'"),
        (["--dtype", "int3"], "invalid choice: 'int3'"),
        (["--model", "/no/such/model"], "--model /no/such/model: no such directory or file"),
        (["--tokenizer", "/no/such/dir"], "--tokenizer /no/such/dir: no such directory or file"),
        (["--block-size", "512"], "block_size must be at most 256"),
        (["--tensor-parallel-size", "3"], "tensor-parallel size 3 does not divide"),
        (["--max-model-len", "4096"], "exceeds the model's max_position_embeddings (2048)"),
        (["--speculative-config", "{ngram"], "speculative_config: not JSON"),
        (
            ["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
            "unknown method 'eagle'",
        ),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'],
            "num_speculative_tokens must be at most 16, got 99",
        ),
        (
            [
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, '
                '"prompt_lookup_max": 2}',
            ],
            "prompt_lookup_min (3) must not exceed prompt_lookup_max (2)",
        ),
    ],
)
def test_serve_refuses_bad_flags_before_starting_anything(args: list[str], message: str) -> None:
    result = run("serve", *args)
    assert result.returncode == 2
    assert message in result.stderr


def test_serve_refuses_a_directory_that_is_not_a_model(tmp_path: Path) -> None:
    result = run("serve", "--model", str(tmp_path))
    assert result.returncode == 2
    assert "not a Hugging Face model directory" in result.stderr


@pytest.mark.parametrize(
    "source",
    ["hf:/org/name", "s3://bucket/model", "hf://just-a-name", "hf://org/name/model.bin"],
)
def test_download_refuses_what_is_not_a_hugging_face_uri(source: str, tmp_path: Path) -> None:
    result = run("download", source, str(tmp_path))
    assert result.returncode == 2
    assert (
        "expected hf://ORG/NAME[@REVISION] or hf://ORG/NAME[@REVISION]/FILE.gguf" in result.stderr
    )


@pytest.mark.parametrize(
    ("source", "repo", "revision", "file"),
    [
        ("hf://org/name", "org/name", None, None),
        ("hf://org/name@main", "org/name", "main", None),
        ("hf://org/name-GGUF/name.Q4_K_M.gguf", "org/name-GGUF", None, "name.Q4_K_M.gguf"),
        ("hf://org/name@refs/pr/1/model.gguf", "org/name", "refs/pr/1", "model.gguf"),
    ],
)
def test_hugging_face_uris_name_a_repository_or_one_gguf_file(
    source: str, repo: str, revision: str | None, file: str | None
) -> None:
    match = HF_URI.match(source)
    assert match is not None
    assert (match["repo"], match["revision"], match["file"]) == (repo, revision, file)


def test_demo_model_writes_the_builtin_checkpoint(tmp_path: Path) -> None:
    written = run("demo-model", str(tmp_path / "demo"))
    assert written.returncode == 0, written.stderr
    builtin = demo_model_dir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (tmp_path / "demo" / name).read_bytes() == (builtin / name).read_bytes(), name


def test_generate_prints_the_offline_generation(offline: LLM) -> None:
    prompt = "The lighthouse keeper"
    generated = run(
        "generate", "--prompt", prompt, "--max-tokens", "6", "--kv-cache-memory", "32MiB"
    )
    assert generated.returncode == 0, generated.stderr
    (want,) = offline.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False
    )
    assert generated.stdout == prompt + want.outputs[0].text + "\n"


def test_operator_hands_its_arguments_to_kopf() -> None:
    result = run("operator", "--help")
    assert result.returncode == 0
    assert "--namespace" in result.stdout


def test_serve_first_writes_the_demo_model_then_its_workers_compute(tmp_path: Path) -> None:
    """With an empty cache the supervisor writes the demo model (torch work) before it forks
    the workers; their first multi-threaded step must not inherit a dead thread pool."""
    cache = tmp_path / "cache"
    server = start_server(
        tmp_path / "run",
        env={
            "PAGEDLLM_CACHE_DIR": str(cache),
            "OMP_NUM_THREADS": "2",
            cpu_extension.KERNEL_DIR_ENV: str(cpu_extension.build_dir().parent),
        },
    )
    try:
        assert (cache / DEMO_MODEL_DIR_NAME / "model.safetensors").is_file()
        completion = server.client().completions.create(
            model=DEMO_MODEL, prompt="A fresh cache", max_tokens=4, temperature=0
        )
        assert completion.usage.completion_tokens == 4
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("env", "tp_size", "threads"),
    [
        ({"OMP_NUM_THREADS": "3", "PAGEDLLM_CPUS": "8"}, 2, 3),  # per rank, as given
        ({"PAGEDLLM_CPUS": "8"}, 2, 4),  # the pod's CPUs shared among the ranks
        ({"PAGEDLLM_CPUS": "1"}, 2, 1),
        ({"PAGEDLLM_CPUS": "0"}, 1, len(os.sched_getaffinity(0))),  # no CPU request: the cores
    ],
)
def test_worker_threads_follow_the_pods_cpus(
    env: dict[str, str], tp_size: int, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert torch_threads(tp_size) == threads
