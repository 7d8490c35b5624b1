"""`pagedllm serve --speculative-config`: real nodes, one speculating and one not, side by side.

Greedy answers (whole and streamed, with a stop string landing inside a verified draft, on a
cache so small that sequences are preempted) must be those of the node without speculation;
sampled requests run; the node reports vLLM's spec_decode counters.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from pagedllm_testing.serve_harness import DEMO_MODEL, Server, start_server

NGRAM = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
)
# 16 blocks of 16 tokens on the demo model: six requests of ~100 tokens preempt each other.
TINY_CACHE = ("--kv-cache-memory", "1MiB", "--max-model-len", "256")
PROMPTS = [
    "Copy: the lighthouse keeper kept a log of the weather and the ships that passed.",
    "def total(items):\n    return sum(item.price for item in items)\n\ndef total(",
    "one two three four one two three four one two",
]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, Server]]:
    off = start_server(tmp_path_factory.mktemp("off"), *TINY_CACHE)
    try:
        on = start_server(tmp_path_factory.mktemp("on"), *TINY_CACHE, "--speculative-config", NGRAM)
    except BaseException:
        off.stop()
        raise
    yield {False: off, True: on}
    off.stop()
    on.stop()


def complete(server: Server, **body) -> tuple[str, str]:
    out = server.client().completions.create(model=DEMO_MODEL, temperature=0, **body)
    return out.choices[0].text, out.choices[0].finish_reason


def streamed(server: Server, **body) -> tuple[str, str | None]:
    text, reason = "", None
    for chunk in server.client().completions.create(
        model=DEMO_MODEL, temperature=0, stream=True, **body
    ):
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_greedy_answers_are_those_without_speculation(nodes: dict[bool, Server]) -> None:
    accepted = nodes[True].metric("vllm:spec_decode_num_accepted_tokens_total")
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 40}
        expected = complete(nodes[False], **body)
        assert complete(nodes[True], **body) == expected
        assert streamed(nodes[True], **body) == expected
    on = nodes[True]
    assert on.metric("vllm:spec_decode_num_drafts_total") > 0
    assert on.metric("vllm:spec_decode_num_draft_tokens_total") >= on.metric(
        "vllm:spec_decode_num_accepted_tokens_total"
    )
    assert on.metric("vllm:spec_decode_num_accepted_tokens_total") > accepted
    assert on.metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0


def test_a_stop_string_inside_a_draft_cuts_the_answer_there(nodes: dict[bool, Server]) -> None:
    body = {"prompt": PROMPTS[2], "max_tokens": 40}
    full, _ = complete(nodes[False], **body)
    # A stop string that starts a few tokens into the answer, where drafts are verified.
    stop = full[len(full) // 3 : len(full) // 3 + 3]
    assert stop.strip(), full
    expected = complete(nodes[False], **body, stop=[stop])
    assert expected[1] == "stop" and stop not in expected[0]
    assert complete(nodes[True], **body, stop=[stop]) == expected
    assert streamed(nodes[True], **body, stop=[stop]) == expected


def test_preempted_sequences_keep_their_greedy_answers(nodes: dict[bool, Server]) -> None:
    async def answers(server: Server) -> list[str]:
        client = server.async_client()
        outs = await asyncio.gather(
            *(
                client.completions.create(
                    model=DEMO_MODEL,
                    prompt=f"{i} " + PROMPTS[i % 3],
                    max_tokens=60,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for i in range(6)
            )
        )
        return [o.choices[0].text for o in outs]

    before = nodes[True].metric("vllm:num_preemptions_total")
    assert asyncio.run(answers(nodes[True])) == asyncio.run(answers(nodes[False]))
    assert nodes[True].metric("vllm:num_preemptions_total") > before


def test_sampled_requests_run_with_speculation(nodes: dict[bool, Server]) -> None:
    client = nodes[True].client()
    for extra in ({}, {"logprobs": 2}):  # the second steps without drafts
        out = client.completions.create(
            model=DEMO_MODEL,
            prompt=PROMPTS[2],
            max_tokens=30,
            temperature=0.8,
            top_p=0.95,
            n=3,
            seed=5,
            **extra,
        )
        assert len(out.choices) == 3
        for choice in out.choices:
            assert choice.finish_reason in ("stop", "length") and choice.text
            if extra:
                assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) >= 1
    structured = (
        nodes[True]
        .client()
        .chat.completions.create(
            model=DEMO_MODEL,
            messages=[{"role": "user", "content": PROMPTS[0]}],
            max_tokens=20,
            temperature=0,
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        )
    )
    assert structured.choices[0].message.content in ("yes", "no")
