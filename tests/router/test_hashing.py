"""The router hashes a prompt exactly as the node's block manager does: the same token ids
(the node's tokenizer and chat template) and the same chained block hashes."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pagedllm.api.chat_settings import ChatSettings
from pagedllm.api.chat_template import tool_template
from pagedllm.api.errors import ApiError
from pagedllm.api.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.api.serving import ServingContext
from pagedllm.api.serving_completions import completion_prompts
from pagedllm.api.tokenizing import TokenizingContext
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.request_delta import RequestTimings
from pagedllm.core.sequence import Request, Sequence
from pagedllm.lora.request import LoRARequest
from pagedllm.router.hashing import HashScheme, PromptHashes, block_hashes
from pagedllm.router.prompts import HEAD_CHARS, ROUTE_TEXT_CHARS, routing_prompt, routing_tokens
from pagedllm.router.residency import Residency
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZES = [8, 16, 32]
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()


def node_hashes(token_ids: list[int], block_size: int, seed: int) -> tuple[BlockManager, int]:
    """A block manager that computed ``token_ids`` as the node's scheduler does, and the
    number of blocks it published to its prefix cache."""
    bm = BlockManager(num_blocks=4096, block_size=block_size, seed=seed)
    request = Request("r", token_ids, SamplingParams(), (), RequestTimings(0.0))
    seq = Sequence(0, request, list(token_ids))
    assert bm.allocate(seq, len(token_ids), bm.find_prefix(seq))
    seq.num_computed_tokens = seq.num_kv_tokens = len(token_ids)
    bm.register_computed(seq)
    return bm, seq.blocks.num_registered


def assert_same_hashes(token_ids: list[int], block_size: int, seed: int = 0) -> None:
    scheme = HashScheme(block_size, seed)
    ours = block_hashes(token_ids, scheme)
    bm, published = node_hashes(token_ids, block_size, seed)
    assert len(ours) == published == len(token_ids) // block_size
    assert all(bm.pool.cached_block(h) is not None for h in ours)
    # What the node would find for the same prompt again is what the router predicts.
    again = Sequence(
        1, Request("s", token_ids, SamplingParams(), (), RequestTimings(0.0)), token_ids
    )
    residency = Residency(scheme, set(bm.pool._by_hash))
    assert residency.cached_tokens(ours) == bm.find_prefix(again).num_tokens


def text_of_multiple(ctx: TokenizingContext, block_size: int, blocks: int) -> str:
    """A text whose completion tokens are exactly ``blocks`` blocks."""
    tokenizer = ctx.tokenizer
    words: list[str] = []
    i = 0
    while True:
        words.append(WORDS[i % len(WORDS)] + str(i % 7))
        i += 1
        text = " ".join(words)
        n = len(tokenizer.encode(text))
        if n == blocks * block_size:
            return text
        if n > blocks * block_size:
            words = words[:-2]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_completion_prompts_hash_as_the_node(
    tokenizing: TokenizingContext, block_size: int
) -> None:
    for blocks in (1, 3, 7):
        exact = text_of_multiple(tokenizing, block_size, blocks)
        for text in (exact, exact + " and one more", "short"):
            body = CompletionRequest(prompt=text)
            ours = asyncio.run(routing_tokens(tokenizing, body))
            # The node's own path from the request body to token ids.
            (node_prompt,) = asyncio.run(completion_prompts(_node_ctx(tokenizing), body))
            assert ours == node_prompt.token_ids
            assert_same_hashes(ours, block_size, seed=blocks)
        assert (
            len(asyncio.run(routing_tokens(tokenizing, CompletionRequest(prompt=exact))))
            % block_size
            == 0
        )


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_token_id_prompts_hash_as_the_node(block_size: int) -> None:
    for length in (block_size, 4 * block_size, 4 * block_size + 3, block_size - 1):
        token_ids = [(7 * i + 5) % 300 + 5 for i in range(length)]
        body = CompletionRequest(prompt=[token_ids, [1, 2, 3]])  # the first prompt routes
        assert asyncio.run(routing_tokens(None, body)) == token_ids  # type: ignore[arg-type]
        assert_same_hashes(token_ids, block_size)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_chat_prompts_hash_as_the_node(tokenizing: TokenizingContext, block_size: int) -> None:
    tokenizer = tokenizing.tokenizer
    for system_words in (5, 40, 200):
        messages = [
            {
                "role": "system",
                "content": " ".join(WORDS[i % len(WORDS)] for i in range(system_words)),
            },
            {"role": "user", "content": "What does the fox do?"},
        ]
        for add_generation_prompt in (True, False):
            body = ChatCompletionRequest(
                messages=messages, add_generation_prompt=add_generation_prompt
            )
            ours = asyncio.run(routing_tokens(tokenizing, body))
            # The model's own template, applied by transformers as a reference.
            reference = tokenizer.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=add_generation_prompt
            )
            reference = list(getattr(reference, "input_ids", reference))
            assert ours == reference
            assert_same_hashes(ours, block_size)
            cut = ours[: len(ours) // block_size * block_size]  # an exact multiple too
            assert_same_hashes(cut, block_size)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# A --chat-template of the nodes: it writes a template variable the request may set.
CUSTOM_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}{% if style %} {{ style }}{% endif %}] "
    "{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_tool_chats_hash_as_the_node(tokenizing: TokenizingContext, block_size: int) -> None:
    """With tools the node renders the built-in tool template (the demo model's own knows
    no tools): the router must render the same, tools and all."""
    tokenizer = tokenizing.tokenizer
    messages = [
        {"role": "system", "content": " ".join(WORDS * 6)},
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    body = ChatCompletionRequest(messages=messages, tools=TOOLS)
    ours = asyncio.run(routing_tokens(tokenizing, body))
    node = _node_ctx(tokenizing)
    node_text = asyncio.run(node.render_request(body))
    assert ours == asyncio.run(node.chat_tokens(node_text))
    # transformers on the built-in tool template, the call's arguments as an object
    messages[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    reference = tokenizer.apply_chat_template(
        messages,
        tools=TOOLS,
        chat_template=tool_template(),
        tokenize=False,
        add_generation_prompt=True,
    )
    assert node_text == reference and "get_weather" in reference
    plain = asyncio.run(routing_tokens(tokenizing, ChatCompletionRequest(messages=messages[:2])))
    assert ours[: len(plain)] != plain  # the tool template, not the model's own
    assert_same_hashes(ours, block_size)


def test_the_chat_template_flag_and_kwargs_render_as_the_node(
    tokenizing: TokenizingContext,
) -> None:
    settings = ChatSettings(chat_template=CUSTOM_TEMPLATE)
    router = dataclasses.replace(tokenizing, chat=settings)
    node = dataclasses.replace(_node_ctx(tokenizing), chat=settings)
    messages = [{"role": "user", "content": "Hello there"}]
    for kwargs in (None, {"style": "terse"}):
        body = ChatCompletionRequest(messages=messages, chat_template_kwargs=kwargs)
        ours = asyncio.run(routing_tokens(router, body))
        text = asyncio.run(node.render_request(body))
        assert text == "[user" + (" terse" if kwargs else "") + "] Hello there\n[assistant] "
        assert ours == tokenizing.tokenizer.encode(text, add_special_tokens=False)
    bad = ChatCompletionRequest(messages=messages, chat_template_kwargs={"tokenize": True})
    with pytest.raises(ApiError) as refused:
        asyncio.run(routing_tokens(router, bad))
    assert refused.value.status == 400 and refused.value.param == "chat_template_kwargs"


def test_hashes_depend_on_the_seed_and_block_size() -> None:
    token_ids = list(range(5, 69))
    base = block_hashes(token_ids, HashScheme(16, 0))
    assert block_hashes(token_ids, HashScheme(16, 1))[0] != base[0]
    assert block_hashes(token_ids, HashScheme(8, 0))[0] != base[0]
    prompt = PromptHashes(token_ids)
    assert prompt.for_scheme(HashScheme(16, 0)) == base
    assert block_hashes(token_ids, HashScheme(16, 0), max_blocks=2) == base[:2]


def test_a_huge_prompt_routes_by_its_start(tokenizing: TokenizingContext) -> None:
    text = "lorem ipsum dolor sit amet " * (ROUTE_TEXT_CHARS // 10)
    tokenizing_long = TokenizingContext(
        tokenizer=tokenizing.tokenizer,
        model_names=tokenizing.model_names,
        model_dir=tokenizing.model_dir,
        max_model_len=1 << 30,
        vocab_size=tokenizing.vocab_size,
    )
    ours = asyncio.run(routing_tokens(tokenizing_long, CompletionRequest(prompt=text)))
    whole = tokenizing.tokenizer.encode(text)
    assert 0 < len(ours) < len(whole)
    assert ours == whole[: len(ours)]


def test_a_long_prompt_is_first_routed_by_its_head(tokenizing: TokenizingContext) -> None:
    """The head's tokens are the whole prompt's first tokens (completions and chat alike); the
    whole is tokenized only when asked for."""
    text = " ".join(WORDS[(i * 5) % len(WORDS)] + str(i) for i in range(HEAD_CHARS // 3))
    for body in (
        CompletionRequest(prompt=text),
        ChatCompletionRequest(messages=[{"role": "user", "content": text}]),
    ):
        prompt = asyncio.run(routing_prompt(tokenizing, body))
        whole = asyncio.run(prompt.whole(tokenizing))
        assert prompt.rest is not None and 0 < len(prompt.head) < len(whole)
        assert prompt.head == whole[: len(prompt.head)]
        assert whole == asyncio.run(routing_tokens(tokenizing, body))
    short = asyncio.run(routing_prompt(tokenizing, CompletionRequest(prompt=text[:HEAD_CHARS])))
    assert short.rest is None
    assert short.head == tokenizing.tokenizer.encode(text[:HEAD_CHARS])


def _node_ctx(ctx: TokenizingContext) -> ServingContext:
    """The API server's context on the same tokenizer (no engine: only tokenizing is used)."""
    return ServingContext(
        tokenizer=ctx.tokenizer,
        model_names=ctx.model_names,
        model_dir=ctx.model_dir,
        max_model_len=ctx.max_model_len,
        vocab_size=ctx.vocab_size,
        max_token_bytes=ctx.max_token_bytes,
        client=None,  # type: ignore[arg-type]
        metrics=None,  # type: ignore[arg-type]
    )


def test_adapter_prompts_hash_as_the_node_roots_them() -> None:
    """A LoRA adapter's blocks are rooted at its (name, path) key, as the node's feed lists
    it: the router predicts the node's hit for the adapter, and none for the base model or
    the same name loaded from another directory."""
    tokens = list(range(3, 3 + 64))
    scheme = HashScheme(16, 5)
    sql = LoRARequest("sql", 1, "/adapters/sql")
    bm = BlockManager(num_blocks=64, block_size=16, seed=5)
    request = Request("r", tokens, SamplingParams(), (), RequestTimings(0.0), lora=sql)
    seq = Sequence(0, request, list(tokens))
    assert bm.allocate(seq, len(tokens), bm.find_prefix(seq))
    seq.num_computed_tokens = seq.num_kv_tokens = len(tokens)
    bm.register_computed(seq)
    residency = Residency(scheme, set(bm.pool._by_hash))
    prompt = PromptHashes(tokens)
    assert residency.cached_tokens(prompt.for_scheme(scheme, sql.key)) == 64
    assert residency.cached_tokens(prompt.for_scheme(scheme)) == 0
    assert residency.cached_tokens(prompt.for_scheme(scheme, ("sql", "/elsewhere"))) == 0
    assert prompt.for_scheme(scheme, sql.key) == block_hashes(tokens, scheme, adapter=sql.key)
