"""Drives every arm at once from one event loop with the identical schedule, and writes the run directory.

Same task at the same index for every arm; in open loop the same offset too, dispatched to all arms in the same
loop iteration, so drift on the machine hits both arms alike. Records are derived and appended to requests.jsonl
as requests finish, by a process of their own (`dfserve.loadtest.writer`: a crash loses what was in flight); a stop request
(Ctrl-C) cancels in-flight requests, which are recorded as `cancelled`, and the run still gets its summary.
A sequential run passes `halt`, polled before each request is sent: once it is true nothing more is sent and the
requests in flight finish (they complete pairs the verdict uses).

    outcome = asyncio.run(execute(plan, observers=[], stop=asyncio.Event()))
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dfserve import sglang, stamped_socket
from dfserve.capture.replay import CaptureTaskSet
from dfserve.errors import FieldError, UserError
from dfserve.headers import ARM as PIN_HEADER
from dfserve.loadtest.client import ArmClient, prepare_all
from dfserve.loadtest.config import MAX_REQUESTS, ArmInfo, RunConfig, Sampling, SequentialDesign, TaskSetInfo
from dfserve.loadtest.records import RequestRecord
from dfserve.loadtest.routes import ROUTE_FOR
from dfserve.loadtest.schedule import LoadShape, trace_sha256
from dfserve.loadtest.writer import Observer, RecordWriter
from dfserve.runs import Provenance, create_run_dir, write_model
from dfserve.shard import Shard, shard_concurrency, shard_indices
from dfserve.stamped_socket import ReadLag
from dfserve.tasks import Task, TaskSet
from dfserve.transport import StampingTransport

Halt = Callable[[], bool]

CONNECT_TIMEOUT_S = 10.0
MAX_SCHEDULE_S = 30 * 86400
"""Past any load test's span: a schedule longer than this (infinite, where a rate or a speed is near zero) is a
mistyped flag, not a run to wait for; unless a duration bounds the run (then only an infinite one is)."""


@dataclass(frozen=True)
class RunPlan:
    """A parsed `loadtest run` command line."""

    arms: tuple[tuple[str, str], ...]
    api: sglang.Api | None
    """The route of every request (`--api`); None: native for a task set, each request's own for a capture."""
    task_set: TaskSet
    num_requests: int
    warmup: int
    sampling: Sampling
    load: LoadShape
    out: Path
    name: str | None = None
    duration_s: float | None = None
    request_timeout_s: float = 600.0
    model: str | None = None
    pin_arms: bool = False
    sequential: SequentialDesign | None = None
    shard: Shard | None = None
    headers: tuple[tuple[str, str], ...] = ()
    """Sent with every request to every arm (`--header`, `--api-key`)."""

    def __post_init__(self) -> None:
        names = [name for name, _ in self.arms]
        if not names:
            raise FieldError("arms", "give at least one NAME=URL")
        if len(set(names)) != len(names):
            raise FieldError("arms", "arm names must be unique")
        if not 1 <= self.num_requests <= MAX_REQUESTS:
            raise FieldError("num_requests", f"must be from 1 to {MAX_REQUESTS:,}")
        if not 0 <= self.warmup <= MAX_REQUESTS:
            raise FieldError("warmup", f"must be from 0 to {MAX_REQUESTS:,}")
        if self.duration_s is not None and not 0 < self.duration_s < math.inf:
            raise FieldError("duration_s", "must be a finite number > 0")
        if not 0 < self.request_timeout_s < math.inf:
            raise FieldError("request_timeout_s", "must be a finite number > 0")
        if self.sequential is not None and len(names) != 2:
            raise FieldError("sequential", "give exactly two arms, the baseline then the candidate")
        if self.sequential is not None and self.shard is not None:
            raise FieldError("sequential", "a shard ({other}) sees part of the pairs and cannot decide the gate; "
                             "judge the merged run with dfserve compare", other="shard")
        if self.load.concurrency is not None:
            shard_concurrency(self.load.concurrency, self.shard)  # refuses a concurrency the shards cannot share
        if isinstance(self.task_set, CaptureTaskSet):
            self.task_set.check(self.api, self.load.kind == "trace", self.warmup + self.num_requests)
        elif self.load.kind == "trace":
            raise FieldError("arrival", "trace replays captured arrival times; give {other} capture:DIR", other="tasks")
        _, offsets = self.order()
        if offsets and not (offsets[-1] <= MAX_SCHEDULE_S or (self.duration_s is not None and offsets[-1] < math.inf)):
            raise FieldError("speed" if self.load.kind == "trace" else "rate",
                             f"puts the last request {offsets[-1]:.3g} s after the start, past "
                             f"{MAX_SCHEDULE_S // 86400} days")

    @property
    def recorded_load(self) -> LoadShape:
        """The load as config.json records it, for the judge to compare: a trace's with the hash of the arrival
        offsets it replays, which its other fields do not name."""
        if isinstance(self.task_set, CaptureTaskSet) and self.load.kind == "trace":
            return self.load.model_copy(update={"trace_sha256": trace_sha256(self.task_set.arrivals_s)})
        return self.load

    @property
    def default_api(self) -> sglang.Api:
        """The route of a task that does not carry its own."""
        return self.api or "native"

    def order(self) -> tuple[list[Task], list[float] | None]:
        """The tasks in the order they are sent, and their offsets from the start (None in closed loop)."""
        total = self.warmup + self.num_requests
        if isinstance(self.task_set, CaptureTaskSet) and self.load.kind == "trace":
            order, arrivals_s = self.task_set.trace(total)
            return order, self.load.offsets(total, arrivals_s)
        return self.task_set.sequence(total, self.load.seed), self.load.offsets(total)


def routes_of(order: Sequence[Task], default: sglang.Api) -> dict[sglang.Api, int]:
    """How many requests of `order` go on each route, as `ArmClient` sends them."""
    counts = Counter(task.route or default for task in order)
    return {api: counts[api] for api in ROUTE_FOR if counts[api]}


@dataclass
class RunOutcome:
    run_dir: Path
    config: RunConfig
    records: list[RequestRecord] = field(default_factory=list)
    interrupted: bool = False
    read_lag: dict[str, ReadLag] = field(default_factory=dict)
    """Per arm whose reads the kernel dated, how long they waited for the loop."""
    records_lost: str | None = None
    """Why some finished requests have no record (the writer's file could not be written), and how many."""


async def _get_json(http: httpx.AsyncClient, url: str, headers: dict[str, str]) -> Any | None:
    """The JSON document at `url`, or None where the arm has none (a router or gateway may not serve it)."""
    response = await http.get(url, headers=headers)
    if response.status_code != 200:
        return None
    try:
        return sglang.printable_json(response.json())  # recorded in config.json, which must stay UTF-8
    except (ValueError, RecursionError):
        return None


async def probe_arm(
    http: httpx.AsyncClient, name: str, url: str, asks_model: bool, model: str | None, pin: bool
) -> ArmInfo:
    """Fetch `/server_info` and `/model_info` (recorded verbatim) and, where a route names the model in its body (the
    OpenAI routes: `asks_model`), the served model's name.

    With `pin`, the documents come from the gateway arm of the same name (the gateway forwards them).
    """
    base = url.rstrip("/")
    headers = {PIN_HEADER: name} if pin else {}
    try:
        server_info = await _get_json(http, base + "/server_info", headers)
        model_info = await _get_json(http, base + "/model_info", headers)
        if model is None and asks_model:
            model = sglang.first_model_id(await _get_json(http, base + "/v1/models", headers))
    except httpx.HTTPError as exc:
        raise FieldError("arms", f"{name}={url}: server does not answer ({type(exc).__name__}: {exc})") from None
    server = sglang.parse_server_info(server_info) if isinstance(server_info, dict) else None
    return ArmInfo(
        name=name,
        url=url,
        server_info=server_info if isinstance(server_info, dict) else None,
        model_info=model_info if isinstance(model_info, dict) else None,
        model=model or "default",
        simulated=bool(server and server.simulated),
    )


async def _closed_loop(
    client: ArmClient, order: Sequence[Task], indices: Sequence[int], warmup: int, concurrency: int, deadline: float,
    halt: Halt,
) -> None:
    next_index = iter(indices)

    async def worker() -> None:
        for index in next_index:
            if time.perf_counter() >= deadline or halt():
                return
            await client.send(order[index], index, warmup=index < warmup, scheduled_s=None)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(indices)))))


async def _open_loop(
    clients: Sequence[ArmClient], order: Sequence[Task], indices: Sequence[int], warmup: int, offsets: Sequence[float],
    cap: int | None, t0: float, deadline: float, halt: Halt,
) -> None:
    slots = {client.arm: asyncio.Semaphore(cap) for client in clients} if cap else {}
    in_flight: set[asyncio.Task[None]] = set()

    async def one(client: ArmClient, index: int, offset: float) -> None:
        if cap:
            async with slots[client.arm]:
                await client.send(order[index], index, warmup=index < warmup, scheduled_s=offset)
        else:
            await client.send(order[index], index, warmup=index < warmup, scheduled_s=offset)

    try:
        for index in indices:
            offset = offsets[index]
            if t0 + offset >= deadline:
                break  # due after the duration bound: the run ends now, not when it would have been sent
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if time.perf_counter() >= deadline or halt():
                break
            for client in clients:
                task = asyncio.create_task(one(client, index, offset))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
        if in_flight:
            await asyncio.gather(*in_flight)
    finally:
        for task in in_flight:
            task.cancel()
        if in_flight:
            await asyncio.gather(*in_flight, return_exceptions=True)


async def _probe_arms(plan: RunPlan, asks_model: bool, stop: asyncio.Event) -> list[ArmInfo]:
    """Every arm probed (`probe_arm`), each given as long as a request may take in all (a busy server answers its
    documents when its scheduler gets to them; one that trickles them is cut off all the same); a `UserError` when
    `stop` comes first."""
    probe_timeout = httpx.Timeout(plan.request_timeout_s, connect=CONNECT_TIMEOUT_S)

    async def probe_all() -> list[ArmInfo]:
        async with httpx.AsyncClient(transport=StampingTransport(), headers=dict(plan.headers), timeout=probe_timeout,
                                     trust_env=False) as http:
            arms = []
            for name, url in plan.arms:
                try:
                    async with asyncio.timeout(plan.request_timeout_s):
                        arms.append(await probe_arm(http, name, url, asks_model, plan.model, plan.pin_arms))
                except TimeoutError:
                    raise FieldError("arms", f"{name}={url}: server does not answer (its documents took over "
                                     f"{plan.request_timeout_s:g} s)") from None
            return arms

    probing, stopping = asyncio.ensure_future(probe_all()), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((probing, stopping), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (probing, stopping):
            task.cancel()
        await asyncio.gather(probing, stopping, return_exceptions=True)
    if not probing.cancelled() and probing.exception() is None:
        return probing.result()
    if stop.is_set():
        raise UserError("stopped while asking the arms' servers for their documents; nothing was sent")
    raise probing.exception() or UserError("probing the arms was cancelled")


async def execute(plan: RunPlan, observers: Sequence[Observer], stop: asyncio.Event, halt: Halt | None = None,
                  going_ahead: Callable[[], None] | None = None) -> RunOutcome:
    """Probe the arms, create the run directory, drive the load until done, `stop`, `halt`, the duration bound or
    the record writer's stopping (its file could not be written: the run is then interrupted). `going_ahead` is
    called once the run directory exists: what it says comes after every refusal the run could still meet."""
    load = plan.recorded_load
    total = plan.warmup + plan.num_requests
    order, offsets = plan.order()
    routes = routes_of(order, plan.default_api)
    asks_model = any(ROUTE_FOR[api].asks_model for api in routes)
    arms = await _probe_arms(plan, asks_model, stop)
    stamped_socket.available()  # turns the kernel's stamps on (tens of ms the first time) before the clock starts
    run_dir = create_run_dir(plan.out, plan.name)
    if going_ahead is not None:
        going_ahead()
    writer = await RecordWriter.start(run_dir / "requests.jsonl", observers)

    def halted() -> bool:
        return writer.stopped() or (halt is not None and halt())

    try:
        provenance = Provenance.here()  # tens of ms the first time: before the clock starts, not in the schedule
        tasks = TaskSetInfo(name=plan.task_set.name, sha256=plan.task_set.sha256, size=len(plan.task_set.tasks),
                            incomplete=plan.task_set.incomplete)  # hashing every prompt: a replayed trace's head was late
        indices = shard_indices(total, plan.shard)
        sent = list({order[i].id: order[i] for i in indices}.values())
        bodies = prepare_all(sent, plan.default_api, plan.sampling.params(), [arm.model for arm in arms])
        t0 = time.perf_counter()
        writer.begin(t0)
        clients = [
            ArmClient(arm.name, arm.url, plan.default_api, plan.sampling.params(), writer.submit, model=arm.model, t0=t0,
                      request_timeout_s=plan.request_timeout_s, pin_arm=plan.pin_arms, headers=dict(plan.headers),
                      bodies=bodies)
            for arm in arms
        ]
        config = RunConfig(
            run_id=run_dir.name,
            api=next(iter(routes)) if len(routes) == 1 else "mixed",
            routes=routes,
            arms=tuple(arm.model_copy(update={"arrival_stamps": "kernel" if client.pool.kernel_stamps else "loop"})
                       for arm, client in zip(arms, clients, strict=True)),
            tasks=tasks,
            num_requests=plan.num_requests,
            warmup=plan.warmup,
            sampling=plan.sampling,
            load=load,
            duration_s=plan.duration_s,
            request_timeout_s=plan.request_timeout_s,
            pin_arms=plan.pin_arms,
            sequential=plan.sequential,
            shard=plan.shard,
            header_names=tuple(name for name, _ in plan.headers),
            t0_unix_s=time.time() - (time.perf_counter() - t0),
            provenance=provenance,
        )
        write_model(run_dir / "config.json", config)
        deadline = t0 + plan.duration_s if plan.duration_s is not None else float("inf")
        concurrency = None if load.concurrency is None else shard_concurrency(load.concurrency, plan.shard)
        drive: asyncio.Future[Any]
        if offsets is None:
            assert concurrency is not None
            drive = asyncio.gather(*(_closed_loop(c, order, indices, plan.warmup, concurrency, deadline, halted)
                                     for c in clients))
        else:
            drive = asyncio.ensure_future(_open_loop(clients, order, indices, plan.warmup, offsets, concurrency, t0,
                                                     deadline, halted))
        try:
            interrupted = await _until_done_or_stopped(drive, stop)
        finally:
            for client in clients:
                client.close()
    finally:
        records = await writer.close()
    read_lag = {c.arm: c.pool.read_lag for c in clients if c.pool.read_lag is not None}
    return RunOutcome(run_dir=run_dir, config=config, records=records, interrupted=interrupted or bool(writer.lost),
                      read_lag=read_lag, records_lost=writer.lost)


async def _until_done_or_stopped(drive: asyncio.Future[Any], stop: asyncio.Event) -> bool:
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({drive, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if drive.done():
        stopper.cancel()
        drive.result()
        return False
    drive.cancel()
    await asyncio.gather(drive, return_exceptions=True)
    return True
