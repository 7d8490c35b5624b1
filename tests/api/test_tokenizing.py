"""How the API server tokenizes: the byte bound on a token (sound for the demo model's
byte-level BPE, absent where a tokenizer can shrink or drop text) and the encoding itself."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pagedllm.api.serving import encode_text
from pagedllm.api.token_bytes import max_token_bytes
from pagedllm.config import resolve_model_dir
from pagedllm.models.tokenizer import load_tokenizer


def test_no_text_has_more_bytes_than_its_tokens_can_cover() -> None:
    tokenizer = load_tokenizer(resolve_model_dir(None))
    longest = max_token_bytes(tokenizer)
    assert longest is not None
    rng = random.Random(0)
    alphabet = "ab cd\n\t<|eot_id|>é漢字🙂\u0301" + "".join(chr(i) for i in range(32, 127))
    for _ in range(200):
        text = "".join(rng.choices(alphabet, k=rng.randint(1, 300)))
        tokens = tokenizer.encode(text, add_special_tokens=False)
        assert len(text.encode()) <= longest * len(tokens), text


def test_a_tokenizer_that_can_shrink_text_has_no_bound() -> None:
    backend = Tokenizer(models.BPE(unk_token="[UNK]"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert max_token_bytes(tokenizer) is None


@pytest.mark.parametrize("special", [True, False])
def test_the_server_encodes_as_the_tokenizer_does(special: bool) -> None:
    tokenizer = load_tokenizer(resolve_model_dir(None))
    for text in ["hello <|eot_id|> world", "  é漢字🙂\n\t", "a" * 3000]:
        expected = tokenizer.encode(text, add_special_tokens=special)
        assert encode_text(tokenizer, text, special) == expected
