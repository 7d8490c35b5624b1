"""`pagedllm download --tokenizer-only`: what a router pod fetches of an hf:// model (the files
tokenizing and chat templating read, never the weights), selected the way the Hub client
selects them."""

from __future__ import annotations

import shutil
from pathlib import Path

from huggingface_hub.utils import filter_repo_objects

from pagedllm.cli import TOKENIZER_FILES, build_parser
from pagedllm.models.demo import demo_model_dir
from pagedllm.models.tokenizer import load_tokenizer

# A typical Hub repository's files (Llama-style, sharded safetensors and the original export).
HUB_FILES = [
    ".gitattributes",
    "README.md",
    "LICENSE",
    "config.json",
    "generation_config.json",
    "model-00001-of-00004.safetensors",
    "model-00004-of-00004.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "original/consolidated.00.pth",
    "original/params.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
]


def selected(files: list[str]) -> set[str]:
    return set(filter_repo_objects(files, allow_patterns=list(TOKENIZER_FILES)))


def test_no_weights_are_selected() -> None:
    chosen = selected(HUB_FILES)
    assert not {f for f in chosen if f.endswith((".safetensors", ".bin", ".pth", ".index.json"))}
    assert {
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "chat_template.jinja",
        "vocab.json",
        "merges.txt",
        "config.json",
        "generation_config.json",
    } <= chosen


def test_the_selected_files_tokenize_like_the_whole_checkpoint(tmp_path: Path) -> None:
    full = demo_model_dir()
    files = [p.name for p in full.iterdir() if p.is_file()]
    assert "model.safetensors" in files
    for name in selected(files):
        shutil.copy(full / name, tmp_path / name)
    assert not (tmp_path / "model.safetensors").exists()
    text = "The lighthouse keeper counted the ships"
    assert load_tokenizer(tmp_path).encode(text) == load_tokenizer(full).encode(text)


def test_the_flag_parses() -> None:
    args = build_parser().parse_args(["download", "--tokenizer-only", "hf://org/name", "/d"])
    assert args.tokenizer_only and args.source == "hf://org/name"
    assert not build_parser().parse_args(["download", "hf://org/name", "/d"]).tokenizer_only
