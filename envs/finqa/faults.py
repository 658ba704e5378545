"""Injected faults and latency for the tool server, to exercise the client's retries.

A real tool fleet fails in a few ways: it answers 5xx, it hangs past the client's
timeout, it drops the connection without an answer, or it is just slow. `FaultConfig`
sets the share of tool calls that fail each way plus a fixed latency added to every call;
`FaultInjector` draws one outcome per call from a seeded RNG, so a run with the same seed
and the same call order fails the same calls.
"""

from __future__ import annotations

import random
import threading
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Fault(Enum):
    ERROR = "error"  # answer 503
    TIMEOUT = "timeout"  # sleep `timeout_s`, longer than the client waits
    DROP = "drop"  # close the connection without an answer
    SLOW = "slow"  # sleep `slow_ms`, then answer normally


class FaultConfig(BaseModel):
    """How often tool calls fail, and how; all rates are shares of tool calls in [0, 1]."""

    model_config = ConfigDict(extra="forbid")

    error_rate: float = Field(0.0, ge=0, le=1, description="Share of calls answered 503.")
    timeout_rate: float = Field(
        0.0, ge=0, le=1, description="Share of calls that sleep `timeout_s` before a 504."
    )
    timeout_s: float = Field(
        30.0, gt=0, description="How long a timed-out call hangs; set above the client timeout."
    )
    drop_rate: float = Field(
        0.0, ge=0, le=1, description="Share of calls whose connection is closed unanswered."
    )
    slow_rate: float = Field(
        0.0, ge=0, le=1, description="Share of calls delayed by `slow_ms` and then answered."
    )
    slow_ms: float = Field(1000.0, ge=0, description="Delay of a slow call, in milliseconds.")
    latency_ms: float = Field(
        0.0, ge=0, description="Fixed delay before every tool answer, in milliseconds."
    )
    seed: int = Field(0, description="Seed of the RNG that picks the failing calls.")

    @model_validator(mode="after")
    def _rates_sum_to_at_most_one(self) -> FaultConfig:
        total = self.error_rate + self.timeout_rate + self.drop_rate + self.slow_rate
        if total > 1 + 1e-9:
            raise ValueError(
                f"error_rate + timeout_rate + drop_rate + slow_rate is {total:g}; at most 1"
            )
        return self


class FaultInjector:
    """Draws the fault, if any, of each tool call from the config's seeded RNG."""

    def __init__(self, config: FaultConfig):
        self.config = config
        self._rng = random.Random(config.seed)
        self._lock = threading.Lock()

    def draw(self) -> Fault | None:
        c = self.config
        with self._lock:
            u = self._rng.random()
        for fault, rate in (
            (Fault.ERROR, c.error_rate),
            (Fault.TIMEOUT, c.timeout_rate),
            (Fault.DROP, c.drop_rate),
            (Fault.SLOW, c.slow_rate),
        ):
            if u < rate:
                return fault
            u -= rate
        return None
