"""What a user's client does against a PagedLLM's Service, with the openai SDK: completions
and chat completions, streaming (SSE) and not; a client that keeps streaming (for rollouts);
a load generator that fills the queue (for autoscaling).

Standalone, against any OpenAI base URL (a port-forwarded Service, a cluster's ingress):

    python -m pagedllm_testing.client_checks --base-url http://127.0.0.1:8080/v1 --model demo
    python -m pagedllm_testing.client_checks --base-url URL --model demo --stream-for 600
    python -m pagedllm_testing.client_checks --base-url URL --model demo --load 8 --duration 600

--stream-for and --load end early on SIGTERM or Ctrl-C (then report), so a script can run
them in the background for as long as a rollout or a scale-up takes. Exit status 0 when every
check passed and no streamed request failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import openai

PROMPT = "Once upon a time, in a cluster far away,"
CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Say something about paged attention."},
]
MAX_TOKENS = 24


class CheckFailed(AssertionError):
    pass


def client(
    base_url: str, api_key: str | None, *, retries: int = 0, timeout: float = 120.0
) -> openai.OpenAI:
    """No retries by default: a request that fails is counted, not hidden by the SDK."""
    return openai.OpenAI(
        base_url=base_url,
        api_key=api_key or "unused",
        max_retries=retries,
        timeout=timeout,
        http_client=httpx.Client(trust_env=False, timeout=timeout),
    )


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def check_models(api: openai.OpenAI, model: str) -> str:
    names = [m.id for m in api.models.list().data]
    _expect(model in names, f"model {model!r} not in /v1/models: {names}")
    return f"served models {names}"


def check_completion(api: openai.OpenAI, model: str) -> str:
    response = api.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    choice = response.choices[0]
    _expect(response.model == model, f"response names model {response.model!r}")
    _expect(bool(choice.text), "empty completion")
    _expect(choice.finish_reason in ("stop", "length"), f"finish_reason {choice.finish_reason}")
    usage = response.usage
    _expect(usage is not None and 0 < usage.completion_tokens <= MAX_TOKENS, f"usage {usage}")
    return f"{usage.completion_tokens} tokens, finish_reason {choice.finish_reason}"


def check_completion_stream(api: openai.OpenAI, model: str) -> str:
    pieces, finish, usage = [], None, None
    stream = api.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            finish = choice.finish_reason or finish
    text = "".join(pieces)
    _expect(len([p for p in pieces if p]) > 1, f"expected several SSE chunks, got {pieces}")
    _expect(bool(text), "empty streamed completion")
    _expect(finish in ("stop", "length"), f"stream ended without finish_reason ({finish})")
    _expect(usage is not None and 0 < usage.completion_tokens <= MAX_TOKENS, f"usage chunk {usage}")
    return f"{len(pieces)} chunks, {usage.completion_tokens} tokens"


def check_chat(api: openai.OpenAI, model: str) -> str:
    response = api.chat.completions.create(
        model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0.7, seed=1
    )
    message = response.choices[0].message
    _expect(message.role == "assistant", f"role {message.role}")
    _expect(bool(message.content), "empty chat answer")
    _expect(
        response.usage is not None and response.usage.prompt_tokens > 0, f"usage {response.usage}"
    )
    return f"{response.usage.completion_tokens} tokens"


def check_chat_stream(api: openai.OpenAI, model: str) -> str:
    roles, pieces, finish = [], [], None
    stream = api.chat.completions.create(
        model=model, messages=CHAT, max_tokens=MAX_TOKENS, stream=True
    )
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    _expect(roles[:1] == ["assistant"], f"first delta's role: {roles}")
    _expect(len(pieces) > 1, f"expected several content deltas, got {pieces}")
    _expect(finish in ("stop", "length"), f"stream ended without finish_reason ({finish})")
    return f"{len(pieces)} deltas"


def check_errors(api: openai.OpenAI, model: str) -> str:
    try:
        api.completions.create(model=model + "-missing", prompt=PROMPT, max_tokens=4)
    except openai.NotFoundError as error:
        return f"unknown model answers 404 ({error.body and error.body.get('message')})"
    raise CheckFailed("a request for an unknown model did not fail with 404")


CHECKS: list[tuple[str, Callable[[openai.OpenAI, str], str]]] = [
    ("models", check_models),
    ("completion", check_completion),
    ("completion, streaming", check_completion_stream),
    ("chat", check_chat),
    ("chat, streaming", check_chat_stream),
    ("errors", check_errors),
]


def run_checks(
    base_url: str, model: str, api_key: str | None = None, log: Callable[[str], None] = print
) -> None:
    """Every check once; raises CheckFailed naming the first that failed."""
    with client(base_url, api_key) as api:
        for name, check in CHECKS:
            started = time.monotonic()
            try:
                detail = check(api, model)
            except (openai.OpenAIError, CheckFailed) as error:
                raise CheckFailed(f"check {name!r} failed: {error}") from error
            log(f"  ok  {name:<24} {time.monotonic() - started:5.2f}s  {detail}")


@dataclass
class StreamStats:
    requests: int = 0
    tokens: int = 0
    failures: list[str] = field(default_factory=list)
    # Requests whose stream had opened (status and headers received) before it broke.
    cut: list[str] = field(default_factory=list)


class KeepStreaming:
    """Streams completions and chat completions back to back from a thread until stopped;
    every request that does not end with a finish_reason counts as failed, in `cut` when its
    stream had opened first. With `ignore_eos`, each stream runs its full `max_tokens`.
    `retries`: the SDK's own retries of connection errors, timeouts and 429/5xx answers
    (0: every failure counts; the openai SDK's default is 2)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        max_tokens: int = MAX_TOKENS,
        ignore_eos: bool = False,
        retries: int = 0,
    ):
        self.api = client(base_url, api_key, retries=retries)
        self._opened = False
        self.model = model
        self.max_tokens = max_tokens
        self.extra_body = {"ignore_eos": True} if ignore_eos else None
        self.stats = StreamStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="keep-streaming", daemon=True)

    def __enter__(self) -> KeepStreaming:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> StreamStats:
        self._stop.set()
        self._thread.join(timeout=120)
        self.api.close()
        return self.stats

    def _run(self) -> None:
        chat = False
        while not self._stop.is_set():
            self._opened = False
            try:
                tokens, finish = self._one(chat)
                if finish is None:
                    raise CheckFailed("the stream ended without a finish_reason")
                self.stats.tokens += tokens
            except (openai.OpenAIError, CheckFailed, httpx.HTTPError) as error:
                where = self.stats.cut if self._opened else self.stats.failures
                # The SDK's connection errors wrap what went wrong underneath (refused, reset).
                cause = f" from {error.__cause__!r}" if error.__cause__ is not None else ""
                where.append(f"{time.strftime('%H:%M:%S')} {error!r}{cause}")
            self.stats.requests += 1
            chat = not chat

    def _one(self, chat: bool) -> tuple[int, str | None]:
        tokens, finish = 0, None
        if chat:
            stream = self.api.chat.completions.create(
                model=self.model,
                messages=CHAT,
                max_tokens=self.max_tokens,
                stream=True,
                extra_body=self.extra_body,
            )
            self._opened = True
            for chunk in stream:
                for choice in chunk.choices:
                    tokens += bool(choice.delta.content)
                    finish = choice.finish_reason or finish
        else:
            stream = self.api.completions.create(
                model=self.model,
                prompt=PROMPT,
                max_tokens=self.max_tokens,
                stream=True,
                extra_body=self.extra_body,
            )
            self._opened = True
            for chunk in stream:
                for choice in chunk.choices:
                    tokens += bool(choice.text)
                    finish = choice.finish_reason or finish
        return tokens, finish


class Load:
    """`concurrency` clients, each streaming long completions back to back: more requests
    than a pod's batch holds, so they queue (vllm:num_requests_waiting rises). Stopping
    closes the open streams, which cancels their requests on the server."""

    def __init__(
        self,
        base_url: str,
        model: str,
        concurrency: int,
        api_key: str | None = None,
        max_tokens: int = 512,
    ):
        self.base_url, self.model, self.api_key = base_url, model, api_key
        self.max_tokens = max_tokens
        self.stats = StreamStats()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, name=f"load-{i}", daemon=True)
            for i in range(concurrency)
        ]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> StreamStats:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        return self.stats

    def _run(self) -> None:
        # A client of its own per thread: its own connection, so the Service spreads them.
        with client(self.base_url, self.api_key) as api:
            while not self._stop.is_set():
                try:
                    stream = api.completions.create(
                        model=self.model,
                        prompt=PROMPT,
                        max_tokens=self.max_tokens,
                        stream=True,
                        extra_body={"ignore_eos": True},
                    )
                    with stream:
                        for chunk in stream:
                            self.stats.tokens += len(chunk.choices)
                            if self._stop.is_set():
                                break
                except (openai.OpenAIError, httpx.HTTPError) as error:
                    self.stats.failures.append(repr(error))
                    self._stop.wait(1)
                self.stats.requests += 1


def _interrupted(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _run_for(seconds: float) -> None:
    """Sleep this long, or until SIGTERM or Ctrl-C."""
    try:
        time.sleep(seconds)
    except KeyboardInterrupt:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="OpenAI base URL, ending in /v1")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="API key, if the PagedLLM has apiKeySecretRef (default: $OPENAI_API_KEY)",
    )
    parser.add_argument(
        "--stream-for",
        type=float,
        metavar="SECONDS",
        help="then keep streaming this long (or until SIGTERM) and fail on any failed request",
    )
    parser.add_argument(
        "--load",
        type=int,
        metavar="CONCURRENCY",
        help="instead of the checks, generate load from this many clients",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long --load runs (or until SIGTERM; default 60)",
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)

    if args.load:
        print(f"load: {args.load} clients for {args.duration:g}s", flush=True)
        with Load(args.base_url, args.model, args.load, args.api_key) as load:
            _run_for(args.duration)
        print(
            f"load: {load.stats.requests} requests, {load.stats.tokens} tokens, "
            f"{len(load.stats.failures)} failed",
            flush=True,
        )
        return 0
    try:
        run_checks(
            args.base_url, args.model, args.api_key, log=lambda line: print(line, flush=True)
        )
    except CheckFailed as error:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    if args.stream_for:
        with KeepStreaming(args.base_url, args.model, args.api_key) as streaming:
            _run_for(args.stream_for)
        stats = streaming.stats
        failed = stats.failures + stats.cut
        print(
            f"streamed {stats.requests} requests ({stats.tokens} tokens), {len(failed)} failed",
            flush=True,
        )
        for failure in failed:
            print(f"  {failure}", file=sys.stderr)
        if failed or not stats.requests:
            return 1
    print("all client checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
