"""What the supervisor hands an API server on its stdin, and what the server makes of junk."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields

import msgpack
import pytest

from pagedllm.api.chat_settings import ChatSettings
from pagedllm.api.limits import RequestLimits
from pagedllm.ipc.codec import WireError
from pagedllm.ipc.sockets import IpcPaths
from pagedllm.serve.api_server_process import ApiServerSpec, decode_spec, encode_spec

SPEC = ApiServerSpec(
    index=1,
    ipc_paths=IpcPaths("/tmp/pagedllm-x"),
    model_dir="/models/demo",
    model_names=["demo", "alias"],
    max_model_len=2048,
    vocab_size=2000,
    api_key="sk-secret",
    host="0.0.0.0",
    port=8000,
    log_level="info",
    supervisor_pid=4242,
    nice=5,
    limits=RequestLimits(max_prompts_per_request=8, max_n=4, max_request_tokens=1000),
    tokenizer_dir="/models/tokenizer",
    chat=ChatSettings("{{ messages }}", True, "hermes"),
    lora_modules={"sql": "/adapters/sql"},
    runtime_lora_updates=True,
)


def test_a_spec_arrives_as_it_was_sent() -> None:
    assert decode_spec(encode_spec(SPEC)) == SPEC


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xc1", "not msgpack"),
        (
            msgpack.packb(["too", "short"]),
            f"ApiServerSpec as a list of {len(fields(ApiServerSpec))} fields",
        ),
        (
            msgpack.packb(
                [
                    1,
                    ["/d"],
                    "m",
                    ["n"],
                    1,
                    1,
                    None,
                    "h",
                    "80",
                    "info",
                    1,
                    0,
                    [1, 1, 1],
                    "",
                    [None, False, None],
                    None,
                    {},
                    False,
                    None,
                ]
            ),
            "port",
        ),
    ],
)
def test_a_malformed_spec_is_refused_by_name(data: bytes, message: str) -> None:
    with pytest.raises(WireError, match=message):
        decode_spec(data)


def test_the_process_refuses_junk_on_stdin_and_exits_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pagedllm.serve.api_server_process"],
        input=b"junk",
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert b"invalid spec on stdin" in result.stderr
