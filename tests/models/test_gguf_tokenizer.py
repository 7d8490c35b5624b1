"""The tokenizer and chat template of a GGUF file: built from its metadata without torch, the
same as transformers' own GGUF tokenizer and as the checkpoint's original tokenizer, cached by
the file's identity; ``--tokenizer`` takes them from elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from transformers import AutoTokenizer

from pagedllm import LLM, SamplingParams
from pagedllm.cache import CACHE_DIR_ENV
from pagedllm.models import ModelLoadError
from pagedllm.models.demo import demo_model_dir
from pagedllm.models.gguf_tokenizer import tokenizer_cache_dir
from pagedllm.models.tokenizer import load_tokenizer
from pagedllm_testing.gguf_files import write_gguf

TEXTS = [
    "Hello, my name is",
    "  leading spaces and trailing  ",
    "Unicode: café, naïve, 東京, emoji 🙂",
    "<|begin_of_text|>special tokens stay whole<|eot_id|>",
    "tabs\tand\nnewlines\n\n",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a paged KV cache?"},
]


@pytest.fixture
def demo_gguf(tmp_path, monkeypatch) -> Path:
    """The demo checkpoint as a GGUF file, with a private cache for converted tokenizers."""
    demo = demo_model_dir()  # from the usual cache, before it moves
    path = write_gguf(demo, tmp_path / "demo.gguf", Q.Q8_0)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    return path


def test_the_gguf_tokenizer_is_the_checkpoints_tokenizer(demo_gguf):
    ours = load_tokenizer(demo_gguf)
    original = load_tokenizer(demo_model_dir())
    for text in TEXTS:
        assert ours.encode(text) == original.encode(text), text
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == original.decode(
            ids, skip_special_tokens=True
        )
    assert ours.encode("Hi")[0] == original.bos_token_id  # the file says: add BOS
    assert (ours.bos_token, ours.eos_token) == (original.bos_token, original.eos_token)
    rendered = ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered == original.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    )


def test_the_gguf_tokenizer_is_transformers_gguf_tokenizer(demo_gguf):
    ours = load_tokenizer(demo_gguf)
    theirs = AutoTokenizer.from_pretrained(str(demo_gguf.parent), gguf_file=demo_gguf.name)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
    assert ours.apply_chat_template(CHAT, tokenize=False) == theirs.apply_chat_template(
        CHAT, tokenize=False
    )


def test_the_tokenizer_is_converted_once_and_cached(demo_gguf):
    cached = tokenizer_cache_dir(demo_gguf)
    assert not cached.exists()
    load_tokenizer(demo_gguf)
    assert (cached / "tokenizer.json").is_file()
    written = (cached / "tokenizer.json").stat().st_mtime_ns
    load_tokenizer(demo_gguf)
    assert (cached / "tokenizer.json").stat().st_mtime_ns == written
    # A replaced file (another modification time) is another cache entry.
    stat = demo_gguf.stat()
    os.utime(demo_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert tokenizer_cache_dir(demo_gguf) != cached


def test_the_tokenizer_builds_without_torch(demo_gguf, tmp_path):
    """The API servers never load torch; they may be the first to convert the tokenizer."""
    script = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from pagedllm.models.tokenizer import load_tokenizer\n"
        f"tokenizer = load_tokenizer({str(demo_gguf)!r})\n"
        "print(tokenizer.encode('Hello, my name is'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, CACHE_DIR_ENV: str(tmp_path / "fresh-cache")},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(
        load_tokenizer(demo_model_dir()).encode("Hello, my name is")
    )
    assert (tmp_path / "fresh-cache" / "gguf-tokenizers").is_dir()


def test_a_file_without_a_tokenizer_asks_for_one(tmp_path):
    path = write_gguf(demo_model_dir(), tmp_path / "bare.gguf", tokenizer=False)
    with pytest.raises(ModelLoadError, match=r"holds no tokenizer .* --tokenizer"):
        load_tokenizer(path)


def test_the_tokenizer_can_come_from_elsewhere(tmp_path):
    demo = demo_model_dir()
    path = write_gguf(demo, tmp_path / "bare.gguf", tokenizer=False)
    params = SamplingParams(temperature=0, max_tokens=6)
    kwargs = {"kv_cache_memory": 4 * 2**20, "max_model_len": 256}
    from_gguf = LLM(model=str(path), tokenizer=str(demo), **kwargs)
    output = from_gguf.generate(["Once upon a time"], params, use_tqdm=False)[0]
    del from_gguf
    reference = LLM(model=str(demo), **kwargs).generate(["Once upon a time"], params)[0]
    assert output.prompt_token_ids == reference.prompt_token_ids
    assert output.outputs[0].token_ids == reference.outputs[0].token_ids
    assert output.outputs[0].text == reference.outputs[0].text
