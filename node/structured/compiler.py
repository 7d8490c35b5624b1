"""Compiling output constraints into xgrammar grammars, once per constraint, off the step loop.

A compiled grammar is cached by the constraint's key (its kind and text), so a schema sent
with every request is compiled once. ``submit`` compiles on a thread of its own (xgrammar
releases the GIL while it compiles), so the process that asks keeps stepping meanwhile.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from pagedllm.core.sequence import GrammarRef
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured.schema_rewrite import rewrite_schema

# Compiled grammars kept for reuse, most recently used last.
CACHE_SIZE = 256
# With whitespace allowed in JSON, the most between two tokens of it: small models left free
# can fill their whole output with newlines.
MAX_JSON_WHITESPACE = 16
# xgrammar's messages start with a time stamp and the C++ source line: "[18:38:35] x.cc:94: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message says why."""


def tokenizer_info(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> xgr.TokenizerInfo:
    """The vocabulary as xgrammar sees it. ``vocab_size`` is the model's (its logits' width),
    which may exceed the tokenizer's: the rows past it are never allowed. The end-of-sequence
    tokens are those the scheduler stops on, so a finished grammar ends the sequence."""
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
    )


def _message(error: Exception) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return _LOG_PREFIX.sub("", lines[0]) if lines else type(error).__name__


class GrammarCompiler:
    def __init__(self, info: xgr.TokenizerInfo, threads: int = 2) -> None:
        # Cached here, with the serialized form the workers load.
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._cache: OrderedDict[str, Future[GrammarRef]] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> Future[GrammarRef]:
        """The compiled grammar of ``params``, from the cache or compiled on the compiler's
        thread; the future raises ``GrammarError`` for a constraint that cannot compile."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, params, key)
            self._cache[key] = future
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def compile(self, params: StructuredOutputsParams) -> GrammarRef:
        return self.submit(params).result()

    def _compile(self, params: StructuredOutputsParams, key: str) -> GrammarRef:
        try:
            compiled = self._compile_kind(params)
        except Exception as error:  # xgrammar raises RuntimeError and its own kinds
            raise GrammarError(f"structured_outputs.{params.kind}: {_message(error)}") from None
        return GrammarRef(key, compiled.serialize_json())

    def _compile_kind(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind, source = params.kind, params.source
        if kind in ("json", "json_object"):
            any_whitespace = not params.disable_any_whitespace
            schema = json.loads(source) if kind == "json" else {"type": "object"}
            return self._compiler.compile_json_schema(
                json.dumps(rewrite_schema(schema)),
                any_whitespace=any_whitespace,
                max_whitespace_cnt=MAX_JSON_WHITESPACE if any_whitespace else None,
            )
        if kind == "regex":
            return self._compiler.compile_regex(source)
        return self._compiler.compile_grammar(source)  # grammar, choice
