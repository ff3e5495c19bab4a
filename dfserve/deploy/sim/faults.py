"""Fault injection: HTTP errors, stalls, disconnects, aborts and a client falling behind mid-stream, drawn per
request from a seeded generator.

The `lossy` fault lives in `text.py`, because it is a property of the output (a drafter that changes the text),
decided per prompt; these are properties of one request's delivery, decided per arrival.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

FIRST_FAULT_CHUNK = 1
LAST_FAULT_CHUNK = 3
"""Stalls, disconnects, aborts and backlogs strike after one of these chunks (mid-stream: at least one chunk got
through)."""

BACKLOG_ROUNDS = 3
"""Steps a client that falls behind misses: SGLang then sends one chunk with the latest state for all of them."""

ABORT_STATUS = 503
ABORT_MESSAGE = "Retracted under decode memory pressure without a KV backup. Retry later."
"""What SGLang's scheduler aborts a running request with when decode memory runs out and the request has no KV
backup to resume from (``ScheduleBatch.retract_decode`` in ``managers/schedule_batch.py``)."""


class FaultConfig(BaseModel):
    """Fractions of requests that fail each way; all zero by default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    error_rate: float = Field(0.0, ge=0.0, le=1.0, description="Answered with HTTP 500 before any token.")
    stall_fraction: float = Field(0.0, ge=0.0, le=1.0, description="Pause mid-stream for stall_s.")
    stall_s: float = Field(5.0, ge=0.0, description="Length of a stall, seconds at time scale 1.")
    disconnect_fraction: float = Field(0.0, ge=0.0, le=1.0, description="Connection dropped mid-stream.")
    abort_fraction: float = Field(0.0, ge=0.0, le=1.0, description=(
        "Aborted by the engine mid-stream with status 503, as SGLang aborts a request it retracts without a KV "
        "backup: a stream ends with the error in band (HTTP 200), a whole answer is a 503."))
    backlog_fraction: float = Field(0.0, ge=0.0, le=1.0, description=(
        "The client falls behind mid-stream: SGLang sends only its latest state, one chunk for several verify "
        "rounds (``TokenizerManager._stream_one_response``)."))


class SimulatedDisconnect(Exception):
    """Raised inside a response to make the server drop the connection, as a crashed engine would."""


@dataclass(frozen=True)
class RequestFaults:
    error: bool = False
    stall_after_chunk: int | None = None
    disconnect_after_chunk: int | None = None
    abort_after_chunk: int | None = None
    backlog_after_chunk: int | None = None


class FaultPlan:
    """Draws each arriving request's faults; the generator is injected so a seed replays the same faults."""

    def __init__(self, config: FaultConfig, rng: random.Random) -> None:
        self.config = config
        self._rng = rng

    def draw(self) -> RequestFaults:
        config, rng = self.config, self._rng
        if not (config.error_rate or config.stall_fraction or config.disconnect_fraction or config.abort_fraction
                or config.backlog_fraction):
            return RequestFaults()
        error = rng.random() < config.error_rate

        def after(fraction: float) -> int | None:
            return rng.randint(FIRST_FAULT_CHUNK, LAST_FAULT_CHUNK) if rng.random() < fraction else None

        return RequestFaults(error=error, stall_after_chunk=after(config.stall_fraction),
                             disconnect_after_chunk=after(config.disconnect_fraction),
                             abort_after_chunk=after(config.abort_fraction),
                             backlog_after_chunk=after(config.backlog_fraction))
