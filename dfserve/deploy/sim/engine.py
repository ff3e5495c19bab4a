"""The scheduler: one loop, continuous batching like SGLang's, on a modelled clock.

Each step is either a prefill of newly admitted requests (DFlash runs without mixed chunked prefill, so prefill is
a step of its own) or one verify round in which every running request advances. At most `max_running_requests`
run; the rest wait in arrival order, and their wait shows in their time to first token. Steps follow the latency
model's absolute schedule: a step ends `duration` after the previous one ended, however late the host wakes, so
the sim's own lateness never leaks into modelled times. A cancelled request (client gone) leaves at the next step; an
aborted one (`/abort_request`) finishes with an abort at its next step, as SGLang's scheduler finishes it.

    engine = Engine(EngineSettings(), profile, latency, telemetry, seed=0)
    task = asyncio.create_task(engine.run())
    request = engine.submit(prompt="def f():", sampling_key="", prompt_tokens=4, output=text_model.start(...))
    while not (update := await request.updates.get()).finished: ...
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dfserve.deploy.sim.acceptance import RoundModel, prompt_difficulty
from dfserve.deploy.sim.latency import LatencyModel
from dfserve.deploy.sim.profiles import DrafterProfile
from dfserve.deploy.sim.telemetry import RoundRecord, Telemetry
from dfserve.deploy.sim.text import OutputStream
from dfserve.sglang import FinishReason, SpecStats
from dfserve.sglang import server as proto

PRECISE_WAKE_S = 0.0015
"""The event loop's timers fire on a millisecond grid; the last stretch before a step ends is awaited by polling."""


@dataclass(frozen=True)
class EngineSettings:
    max_running_requests: int = 48
    max_prefill_tokens: int = 16384
    """Prompt tokens one prefill step admits (SGLang's --max-prefill-tokens); a longer prompt runs alone."""
    max_total_tokens: int = 400_000


@dataclass(slots=True)
class Update:
    """Progress handed to a request's stream after a step: what a chunk may show, and when the model produced it.

    `payload` holds the chunk's bytes when the stream could encode them before the step ended.
    """

    completion_tokens: int
    text_len: int
    due_unix_s: float
    finished: bool
    payload: bytes | None = None


@dataclass(eq=False)
class SimRequest:
    """One request's state inside the engine; its stream reads `updates`."""

    rid: str
    prompt_tokens: int
    output: OutputStream
    round_model: RoundModel | None
    rng: random.Random
    arrived_s: float
    updates: asyncio.Queue[Update | None] = field(default_factory=asyncio.Queue)
    """Filled by the engine in step order; None is put by the stream itself when its client goes away."""
    verify_ct: int = 0
    correct_drafts: int = 0
    histogram: list[int] = field(default_factory=list)
    """Verify rounds by correct drafts, as long as the most seen (``Req.update_spec_correct_drafts_histogram``)."""
    queue_time_s: float = 0.0
    last_token_s: float = 0.0
    finished_s: float | None = None
    cancelled: bool = False
    aborted: FinishReason | None = None
    """Set by `/abort_request`: the request finishes with it at its next step, whatever its output says."""
    encode: Callable[[Update], bytes | None] | None = None
    """Set by a stream that can encode its chunks ahead of time; called in order, once per update."""

    @property
    def finish(self) -> FinishReason | None:
        return self.aborted or self.output.finish

    def spec_stats(self) -> SpecStats | None:
        """The request's spec fields; None until a verify round ran (SGLang then sends none)."""
        if self.round_model is None or self.verify_ct == 0:
            return None
        proposed = self.verify_ct * (self.round_model.block_size - 1)
        return SpecStats(
            verify_ct=self.verify_ct,
            num_correct_drafts=self.correct_drafts,
            num_proposed_drafts=proposed,
            accept_rate=self.correct_drafts / proposed if proposed else 0.0,
            correct_drafts_histogram=tuple(self.histogram),
        )


class Engine:
    """Owns the running batch and the waiting queue; `run()` is the only coroutine that changes them."""

    def __init__(
        self, settings: EngineSettings, profile: DrafterProfile | None, latency: LatencyModel,
        telemetry: Telemetry, seed: int,
    ) -> None:
        self.settings = settings
        self.profile = profile
        self._latency = latency
        self._telemetry = telemetry
        self._seed = seed
        self._waiting: deque[SimRequest] = deque()
        self._running: list[SimRequest] = []
        self._wake = asyncio.Event()
        self._unix_offset = time.time() - time.perf_counter()
        self._count = 0

    @property
    def block_size(self) -> int:
        return self.profile.block_size if self.profile else 1

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def unix(self, perf_s: float) -> float:
        return perf_s + self._unix_offset

    def submit(self, *, prompt: str, sampling_key: str, prompt_tokens: int, output: OutputStream,
               rid: str | None = None) -> SimRequest:
        """Queue a request. Acceptance draws are seeded by the prompt, so concurrency never changes them."""
        self._count += 1
        round_model = None
        if self.profile is not None:
            round_model = RoundModel.build(self.profile, prompt_difficulty(prompt))
        digest = hashlib.blake2b(f"{self._seed}\x1f{sampling_key}\x1f{prompt}".encode(), digest_size=8).digest()
        request = SimRequest(
            rid=rid or f"sim-{self._count:x}-{digest.hex()[:8]}",
            prompt_tokens=prompt_tokens,
            output=output,
            round_model=round_model,
            rng=random.Random(int.from_bytes(digest, "big")),
            arrived_s=time.perf_counter(),
        )
        self._waiting.append(request)
        self._wake.set()
        return request

    def serving(self, rid: str) -> bool:
        """A request of this id is queued or running (SGLang refuses a second one: "Duplicate request ID")."""
        return any(r.rid == rid and r.finished_s is None and not r.cancelled for r in (*self._waiting, *self._running))

    def cancel(self, request: SimRequest) -> None:
        """The client went away: free its slot (or its place in the queue) before the next step."""
        if request.finished_s is not None or request.cancelled:
            return
        request.cancelled = True
        if request in self._waiting:
            self._waiting.remove(request)
        self._telemetry.finished(0.0, aborted=True)

    def abort(self, rid: str, abort_all: bool) -> None:
        """SGLang's `/abort_request`: a running request (every one with `abort_all`) runs one more step and finishes
        with an abort; one still waiting leaves the queue at once. Counted as SGLang's tokenizer manager counts it:
        once per call that names a request it holds (once for `abort_all`), and never twice for one request."""
        held = [r for r in (*self._waiting, *self._running)
                if r.aborted is None and not r.cancelled and r.finished_s is None and (abort_all or r.rid == rid)]
        if not held and not abort_all:
            return
        self._telemetry.aborted()
        for request in held:
            request.aborted = proto.ABORTED
            if request in self._waiting:
                self._waiting.remove(request)
                request.aborted = proto.ABORTED_WAITING
                request.finished_s = time.perf_counter()
                request.updates.put_nowait(Update(0, 0, self.unix(request.finished_s), finished=True))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        due = time.perf_counter()
        while True:
            self._running = [r for r in self._running if not r.cancelled]
            if not self._running and not self._waiting:
                self._wake.clear()
                self._telemetry.occupancy(0, 0, 0)
                await self._wake.wait()
                due = time.perf_counter()
            admitted = self._admit()
            start = due
            if admitted:
                duration = self._latency.prefill_s(sum(r.prompt_tokens for r in admitted))
                due += duration
                step = self._prefill(admitted, start, due)
            else:
                duration = self._latency.round_s(len(self._running), self.block_size)
                due += duration
                step = self._verify(due, duration)
            # The step's outcome is computed before its end, so at the deadline only the hand-over remains.
            await _sleep_until(due, duration)
            for request, update in step.updates:
                if not request.cancelled:
                    request.updates.put_nowait(update)
            loop.call_soon(self._report, step)  # after the woken streams have run: no chunk waits on metrics
            self._running = [r for r in self._running if r.finished_s is None]
            await asyncio.sleep(0)  # let the streams send before the next step is computed

    def _admit(self) -> list[SimRequest]:
        admitted: list[SimRequest] = []
        budget = self.settings.max_prefill_tokens
        while self._waiting and len(self._running) + len(admitted) < self.settings.max_running_requests:
            head = self._waiting[0]
            if admitted and head.prompt_tokens > budget:
                break
            budget -= head.prompt_tokens
            admitted.append(self._waiting.popleft())
        self._running.extend(admitted)
        return admitted

    def _prefill(self, batch: list[SimRequest], start: float, due: float) -> Step:
        step = Step(due_unix_s=self.unix(due), prompt_tokens=sum(r.prompt_tokens for r in batch))
        for request in batch:
            request.queue_time_s = max(0.0, start - request.arrived_s)
            request.output.first_token()
            request.last_token_s = due
            step.ttfts_s.append(due - request.arrived_s)
            step.queue_times_s.append(request.queue_time_s)
            self._emit(step, request, due)
        return step

    def _verify(self, due: float, duration: float) -> Step:
        step = Step(due_unix_s=self.unix(due))
        tokens = verify = correct = 0
        for request in self._running:
            if request.cancelled or request.finished_s is not None:
                continue
            model = request.round_model
            if model is None:
                produced = request.output.take(1)
            else:
                accepted = model.sample_accepted(request.rng)
                produced = request.output.take(accepted + 1)
                request.verify_ct += 1
                request.correct_drafts += accepted
                _count_into(request.histogram, accepted)
                verify += 1
                correct += accepted
            tokens += produced
            step.gaps.append((due - request.last_token_s, produced))
            request.last_token_s = due
            self._emit(step, request, due)
        step.round = RoundRecord(tokens, verify, correct, verify * (self.block_size - 1), duration)
        return step

    def _emit(self, step: Step, request: SimRequest, due: float) -> None:
        finished = request.finish is not None
        if finished:
            request.finished_s = due
            step.e2e_s.append(due - request.arrived_s)
        update = Update(len(request.output.ids), len(request.output.text), step.due_unix_s, finished)
        if request.encode is not None:
            update.payload = request.encode(update)
        step.updates.append((request, update))

    def _report(self, step: Step) -> None:
        telemetry = self._telemetry
        if step.round is None:
            telemetry.prefill(step.prompt_tokens, step.ttfts_s, step.queue_times_s)
        else:
            telemetry.round(step.round, step.gaps)
        for e2e in step.e2e_s:
            telemetry.finished(e2e, aborted=False)
        tokens = sum(r.prompt_tokens + len(r.output.ids) for r in self._running)
        telemetry.occupancy(len(self._running), len(self._waiting), tokens)


@dataclass
class Step:
    """One scheduler step's outcome: the updates to hand over at its end, and what telemetry records of it."""

    due_unix_s: float
    prompt_tokens: int = 0
    updates: list[tuple[SimRequest, Update]] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)
    queue_times_s: list[float] = field(default_factory=list)
    gaps: list[tuple[float, int]] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    round: RoundRecord | None = None


async def _sleep_until(deadline: float, step_s: float) -> None:
    """Sleep on the loop's timer, then poll for the last stretch (at most a tenth of the step) to end on time."""
    delay = deadline - time.perf_counter() - min(PRECISE_WAKE_S, step_s / 10)
    if delay > 0:
        await asyncio.sleep(delay)
    while time.perf_counter() < deadline:  # noqa: ASYNC110 - timers are too coarse for the last millisecond
        await asyncio.sleep(0)


def _count_into(histogram: list[int], value: int) -> None:
    if len(histogram) <= value:
        histogram.extend([0] * (value + 1 - len(histogram)))
    histogram[value] += 1
