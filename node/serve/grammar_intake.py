"""Constrained requests waiting beside the step loop for their grammars to compile.

A request with structured outputs enters the scheduler only once its grammar is compiled (on
the compiler's thread, or at once from its cache), so a slow compile never holds up the
batch; one that cannot compile is refused with the compiler's reason.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from pagedllm.core.sequence import GrammarRef
from pagedllm.ipc.messages import AddRequest
from pagedllm.structured.compiler import GrammarCompiler, GrammarError


@dataclass
class Compiled:
    message: AddRequest
    grammar: GrammarRef | None
    # Why the constraint cannot be followed (then ``grammar`` is None).
    error: str | None = None


class GrammarIntake:
    def __init__(self, compiler: GrammarCompiler | None) -> None:
        self.compiler = compiler
        self._waiting: dict[str, tuple[AddRequest, Future[GrammarRef]]] = {}

    @property
    def pending(self) -> bool:
        return bool(self._waiting)

    def submit(self, message: AddRequest) -> Compiled | None:
        """Start compiling the request's grammar; its outcome at once when it is known."""
        constraint = message.params.structured_outputs
        assert constraint is not None
        if self.compiler is None:
            return Compiled(message, None, "structured outputs are not available on this node")
        future = self.compiler.submit(constraint)
        if future.done():
            return _outcome(message, future)
        self._waiting[message.request_id] = (message, future)
        return None

    def abort(self, request_id: str) -> bool:
        return self._waiting.pop(request_id, None) is not None

    def ready(self) -> list[Compiled]:
        """The requests whose compile has ended, in the order they came."""
        done = [rid for rid, (_, future) in self._waiting.items() if future.done()]
        return [_outcome(*self._waiting.pop(rid)) for rid in done]


def _outcome(message: AddRequest, future: Future[GrammarRef]) -> Compiled:
    try:
        return Compiled(message, future.result())
    except GrammarError as error:
        return Compiled(message, None, str(error))
