"""The emulator's record of the requests it served, so that tests can count what a client
sends (e.g. that an operator at steady state sends no write at all)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

MUTATING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
REQUESTS_PATH = "/emulator/requests"


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    watch: bool  # a GET with watch=true: a stream, not a read
    agent: str  # the User-Agent, which tells the callers apart

    @property
    def mutating(self) -> bool:
        return self.method in MUTATING_METHODS

    @property
    def verb(self) -> str:
        return "WATCH" if self.watch else self.method


@dataclass
class RequestLog:
    """Every request in the order served (the emulator is for tests: nothing is dropped)."""

    records: list[RecordedRequest] = field(default_factory=list)

    def record(self, request: RecordedRequest) -> None:
        self.records.append(request)

    def since(self, index: int) -> list[RecordedRequest]:
        return self.records[index:]

    def __len__(self) -> int:
        return len(self.records)


def counts(records: list[RecordedRequest]) -> dict[str, int]:
    """'VERB path' -> how many, e.g. 'PATCH /apis/apps/v1/namespaces/a/deployments/b'."""
    return dict(Counter(f"{r.verb} {r.path}" for r in records))


def summary(log: RequestLog, since: int = 0, agents: tuple[str, ...] = ()) -> dict[str, object]:
    """What GET /emulator/requests?since=N[&agent=PREFIX...] answers: the count so far (the
    next `since`) and the requests after index N by verb and path, only those whose
    User-Agent starts with one of `agents` when any is given."""
    records = log.since(since)
    if agents:
        records = [r for r in records if r.agent.startswith(agents)]
    return {"total": len(log), "counts": counts(records)}
