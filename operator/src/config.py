"""The operator's own settings, from environment variables (so that the same image serves
production and the fast loops of tests)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

ENV_PREFIX = "PAGEDLLM_OPERATOR_"


@dataclass(frozen=True)
class OperatorConfig:
    # How often each PagedLLM is reconciled and autoscaled even when nothing changed:
    # the level-based safety net (recreates children deleted by hand, refreshes status).
    resync_seconds: float = 15.0
    # Watch requests end after this long and are reopened; short in tests for fast restarts.
    watch_timeout_seconds: float = 300.0
    # A spec that cannot be served is retried after base * 2**retry seconds, up to max.
    backoff_seconds: float = 5.0
    backoff_max_seconds: float = 300.0
    # One pod's /metrics must answer within this long or it is left out of the average.
    metrics_timeout_seconds: float = 2.0
    # Whether a ServiceMonitor CRD exists is looked up again after this long.
    discovery_cache_seconds: float = 60.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if env is None else env
        values = {}
        for item in fields(cls):
            variable = ENV_PREFIX + item.name.upper()
            raw = env.get(variable)
            if raw is None:
                continue
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"{variable}={raw!r} is not a number") from None
            if value < 0:
                raise ValueError(f"{variable} must not be negative")
            values[item.name] = value
        return cls(**values)

    def backoff(self, retry: int) -> float:
        return min(self.backoff_seconds * 2**retry, self.backoff_max_seconds)
