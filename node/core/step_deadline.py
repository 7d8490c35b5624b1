"""How long the scheduler waits for a step's results before it calls the node stuck.

A worker that hangs (a deadlocked collective, a wedged accelerator, a plan it never answers)
would otherwise leave the node waiting forever while its health check says all is well. The
deadline follows the measured speed of the workers, scaled by the size of the step, so that a
slow machine or a long prefill is never taken for a hang, and never drops below a floor that
covers anything a healthy step can meet (60 s by default, as vLLM's engine iteration timeout).
"""

from __future__ import annotations

from dataclasses import dataclass

# How many times slower than the measured rate a step may be before it is overdue.
SLACK = 50.0
# Weight of the newest step in the running mean of seconds per token.
SMOOTHING = 0.1


@dataclass
class StepDeadline:
    floor_s: float
    seconds_per_token: float = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step of ``num_tokens`` tokens took ``seconds``."""
        if num_tokens <= 0:
            return
        rate = seconds / num_tokens
        if self.seconds_per_token == 0.0:
            self.seconds_per_token = rate
        else:
            self.seconds_per_token += SMOOTHING * (rate - self.seconds_per_token)

    def seconds_for(self, num_tokens: int) -> float:
        """How long a step of ``num_tokens`` tokens may take."""
        return max(self.floor_s, SLACK * self.seconds_per_token * num_tokens)
