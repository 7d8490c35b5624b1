"""The bundled demo checkpoint: reproducible, loadable by us and by transformers, chat-ready."""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm.models import demo
from pagedllm.models.attention_metadata import AttentionMetadata
from pagedllm.models.config import read_model_config
from pagedllm.models.demo import DEMO_MODEL_DIR_NAME, demo_model_dir, write_demo_model
from pagedllm.models.loader import load_model
from pagedllm.models.tokenizer import load_tokenizer

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo"))


def test_written_twice_gives_identical_files(demo_dir, tmp_path):
    again = write_demo_model(tmp_path / "again")
    names = sorted(path.name for path in demo_dir.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for name in names:
        assert (demo_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_tokenizer_round_trips_text_and_marks_the_start(demo_dir):
    tokenizer = load_tokenizer(demo_dir)
    config = read_model_config(demo_dir)
    assert len(tokenizer) == config.vocab_size
    assert tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.eos_token == "<|end_of_text|>"
    assert config.bos_token_id == tokenizer.bos_token_id
    text = "The baker said: 42 loaves, 3.5 kg — déjà vu! 你好 🍞\n\tDone."
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) < len(text.encode())  # the merges compress text
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_chat_template_renders_roles_and_generation_prompt(demo_dir):
    tokenizer = load_tokenizer(demo_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    without = tokenizer.apply_chat_template(messages, tokenize=False)
    assert prompt.startswith(without) and without.endswith("Bye<|eot_id|>")
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|eot_id|>")) == 4
    with pytest.raises(jinja2.TemplateError, match="tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_config_lists_both_stop_tokens(demo_dir):
    tokenizer = load_tokenizer(demo_dir)
    config = read_model_config(demo_dir)
    assert config.eos_token_ids == tokenizer.convert_tokens_to_ids(
        ["<|end_of_text|>", "<|eot_id|>"]
    )
    assert config.architecture == "LlamaForCausalLM"
    assert config.num_key_value_heads < config.num_attention_heads


def test_loads_here_and_in_transformers_with_equal_logits(demo_dir):
    tokenizer = load_tokenizer(demo_dir)
    tokens = torch.tensor(
        tokenizer("A library is a quiet place, but it is never silent.")["input_ids"]
    )
    model, config = load_model(demo_dir)
    reference = AutoModelForCausalLM.from_pretrained(demo_dir, local_files_only=True).eval()
    num_blocks = -(-len(tokens) // BLOCK_SIZE)
    shape = (num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
    block_table = torch.arange(num_blocks - 1, -1, -1, dtype=torch.int32)
    positions = torch.arange(len(tokens))
    meta = AttentionMetadata(
        slot_mapping=(
            block_table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        ).long(),
        block_tables=block_table[None],
        cu_seqlens_q=torch.tensor([0, len(tokens)], dtype=torch.int32),
        seq_lens_k=torch.tensor([len(tokens)], dtype=torch.int32),
        max_seqlen_q=len(tokens),
        max_seqlen_k=len(tokens),
    )
    with torch.no_grad():
        ours = model.compute_logits(model(tokens, positions, kv_caches, meta))
        theirs = reference(tokens[None]).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4


def test_demo_model_dir_is_created_once_under_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    writes: list[Path] = []
    real_write = demo.write_demo_model

    def counting_write(directory: Path) -> Path:
        writes.append(directory)
        return real_write(directory)

    monkeypatch.setattr(demo, "write_demo_model", counting_write)
    first = demo_model_dir()
    second = demo_model_dir()
    assert first == second == tmp_path / DEMO_MODEL_DIR_NAME
    assert len(writes) == 1
    assert (first / "model.safetensors").is_file()
    assert [path.name for path in tmp_path.iterdir()] == [DEMO_MODEL_DIR_NAME]


def test_demo_model_dir_keeps_the_copy_of_a_process_that_won_the_race(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    winner = tmp_path / DEMO_MODEL_DIR_NAME

    def write_while_another_process_finishes_first(directory: Path) -> Path:
        winner.mkdir()
        (winner / "config.json").write_text("{}")
        return directory

    monkeypatch.setattr(demo, "write_demo_model", write_while_another_process_finishes_first)
    assert demo_model_dir() == winner
    assert (winner / "config.json").read_text() == "{}"
    assert [path.name for path in tmp_path.iterdir()] == [DEMO_MODEL_DIR_NAME]
