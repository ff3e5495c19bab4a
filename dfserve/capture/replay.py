"""A capture as the load tester's task set: `dfserve loadtest run --tasks capture:DIR`.

Each captured request becomes a `ReplayTask` that carries its own route and body, so it is replayed on the route it
came on (`/generate`, chat, completions: one run sends them all, each built by its route's entry in
`loadtest.routes`) with its own sampling settings; settings it did not set are taken from the run's flags
(`--max-new-tokens`, `--temperature`, `--top-p`), so the load stays bounded, and the run's config.json records the
loosest settings of the replay (the largest of each); each record keeps its request's own temperature, so
losslessness is judged on the greedy ones. What the load tester changes in each body is its route's
(`Route.streamed`). Task ids carry a hash of the route and the body it is sent with, so the task set's hash changes
with any setting. A body is never converted
from one API to another: a run told `--api` replays a capture only when every request came on that route. A capture
that cannot be replayed (user text hashed, prompt dropped, a batch), or one that is incomplete or tampered with, is
refused in one line; one that lost requests between those it holds (`capture_holes`) is no replay of the traffic it
captured, and says so (`TaskSet.incomplete`): the load tester refuses it unless forced, and records it.

    tasks = load_capture_tasks("capture:/var/dfserve/capture")
    tasks, sampling = tasks.for_run(sampling)
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dfserve import sglang
from dfserve.capture.format import CaptureManifest, CaptureRecord
from dfserve.capture.read import read_capture
from dfserve.capture.redact import PROMPT_FIELDS, changes_request
from dfserve.errors import FieldError
from dfserve.loadtest.config import Sampling
from dfserve.loadtest.routes import ROUTE_FOR, first_set
from dfserve.tasks import Task, TaskSet

PREFIX = "capture:"


@dataclass(frozen=True)
class ReplayTask(Task):
    """A captured request, sent as it came (less what `request` says)."""

    seq: int = 0
    """The record's number in the capture."""
    route: sglang.Api = "native"
    body: dict[str, Any] = field(default_factory=dict, compare=False)
    arrival_s: float = 0.0
    """Seconds from the capture's start to its arrival."""
    where: str = field(default="", compare=False)
    """Its line in the capture (`segment-000001.jsonl:3`)."""

    def request(self, model: str) -> dict[str, Any]:
        """The body to send on its route to an arm serving `model`."""
        return ROUTE_FOR[self.route].streamed(self.body, model)

    def temperature(self) -> float | None:
        value = ROUTE_FOR[self.route].settings(self.body)["temperature"]
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class CaptureTaskSet(TaskSet):
    """The tasks of one capture, in arrival order."""

    arrivals_s: tuple[float, ...]
    holes: str | None = None
    """The requests the capture lost between those it holds (`capture_holes`)."""
    shortened: str | None = None
    """Why it replays fewer requests than it holds, in words: its window ends where it lost a request."""

    @property
    def incomplete(self) -> str | None:
        return self.holes

    @property
    def routes(self) -> Counter[sglang.Api]:
        """How many of the capture's requests came on each route."""
        return Counter(task.route for task in self.tasks if isinstance(task, ReplayTask))

    def unset(self) -> Counter[str]:
        """How many of its requests leave each sampling setting (`max_new_tokens`, `temperature`, `top_p`) to the
        run's flags, which `for_run` fills: the server would have used its own defaults (an OpenAI request without
        a temperature samples at 1.0 there)."""
        return Counter(key for task in self.tasks if isinstance(task, ReplayTask)
                       for key, value in ROUTE_FOR[task.route].settings(task.body).items() if value is None)

    def for_run(self, sampling: Sampling) -> tuple[CaptureTaskSet, Sampling]:
        """Tasks whose unset sampling settings are the run's, and the loosest settings among them, with the lowest
        temperature (what the run records)."""
        tasks = tuple(_with_defaults(task, sampling) for task in self.tasks if isinstance(task, ReplayTask))
        settings = [_settings(task) for task in tasks]
        loosest = Sampling(max_new_tokens=max(s.max_new_tokens for s in settings),
                           temperature=max(s.temperature for s in settings), top_p=max(s.top_p for s in settings),
                           min_temperature=min(s.temperature for s in settings))
        return replace(self, tasks=tasks), loosest

    def check(self, api: sglang.Api | None, trace: bool, count: int) -> None:
        """Refuse a run told to send every request on `api` (None: each on its own route) where the capture holds
        requests of another route (a body is never converted between APIs), or a trace longer than the capture."""
        others = {route: n for route, n in self.routes.items() if route != api}
        if api is not None and others:
            held = ", ".join(f"{others[route]} to {sglang.ROUTES[route]}" for route in ROUTE_FOR if route in others)
            raise FieldError("api", f"{self.name} holds requests of other routes than {api} ({held}); bodies are "
                             "not converted between APIs (without it, each is replayed on its own route)")
        if trace and count > len(self.tasks):
            raise FieldError("num_requests", f"a trace replays each of the capture's {len(self.tasks)} requests once, "
                             f"in order; {count} asked for ({{other}} included)", other="warmup")

    def trace(self, count: int) -> tuple[list[Task], list[float]]:
        """The first `count` requests in arrival order and their arrival offsets."""
        return list(self.tasks[:count]), list(self.arrivals_s[:count])


def _settings(task: ReplayTask) -> Sampling:
    """The settings a task is sent with, as the run records them; a capture's bad one named in one line."""
    try:
        return Sampling(**ROUTE_FOR[task.route].settings(task.body))
    except ValidationError as exc:
        first = exc.errors()[0]
        raise FieldError("tasks", f"capture record {task.seq} ({task.where}): {'.'.join(map(str, first['loc']))}: "
                         f"{first['msg']}") from None


def _with_defaults(task: ReplayTask, sampling: Sampling) -> ReplayTask:
    return _task(task.seq, task.route, ROUTE_FOR[task.route].with_defaults(task.body, sampling.params()),
                 task.arrival_s, task.where)


def _task(seq: int, route: sglang.Api, body: dict[str, Any], arrival_s: float, where: str) -> ReplayTask:
    """Its id is the record's number and a hash of the route and body it is sent with."""
    digest = hashlib.sha256(json.dumps([route, body], sort_keys=True).encode()).hexdigest()[:16]
    prompt_value = first_set(body, PROMPT_FIELDS[route], "input_ids")
    plain = isinstance(prompt_value, str)
    return ReplayTask(id=f"c{seq:06d}-{digest}", prompt=prompt_value if plain else json.dumps(prompt_value),
                      seq=seq, route=route, body=body, arrival_s=arrival_s, where=where)


def _where(manifest: CaptureManifest, seq: int) -> str:
    first = 0
    for segment in manifest.segments:
        if seq < first + segment.records:
            return f"{segment.name}:{seq - first + 1}"
        first += segment.records
    return f"seq {seq}"


def _refusal(record: CaptureRecord) -> str | None:
    """Why a record cannot be replayed as the request it was, or None. Its dropped fields are looked at here, not
    only at its `replayable`: a capture written before a dropped setting made a record unreplayable says True."""
    if record.redaction == "hash":
        return "cannot be replayed: its user text was hashed (redact: hash)"
    dropped = [path for path in record.redacted if record.redaction == "drop" and changes_request(path)]
    prompt = {PROMPT_FIELDS[record.route], "input_ids"}
    if not record.replayable and any(path.split(".")[0] in prompt for path in dropped):
        return f"cannot be replayed: its prompt was dropped (redact: drop {', '.join(record.redacted)})"
    if dropped:
        return (f"cannot be replayed: fields it was sent with were dropped (redact: drop {', '.join(dropped)}): "
                "without them it is another request than the one captured")
    if not record.replayable:
        return "cannot be replayed: its record says so"
    return ROUTE_FOR[record.route].refusal(record.body)


def _left_out(manifest: CaptureManifest, held: int, refused: Sequence[tuple[CaptureRecord, str]]) -> str | None:
    """The requests a capture holds that cannot be replayed as one, in words, the first named (None: none): a
    replay without them is not the traffic captured, as one of a capture that lost requests is not."""
    if not refused:
        return None
    record, why = refused[0]
    more = f"; and {len(refused) - 1} more" if len(refused) > 1 else ""
    return (f"{len(refused)} of the {held} requests it would replay cannot be replayed as one and are left out (record "
            f"{record.seq} ({_where(manifest, record.seq)}) {why}{more})")


def capture_holes(manifest: CaptureManifest) -> str | None:
    """What a capture lost between the requests it holds, in words (None: nothing): a full queue, a failed write, a
    request larger than a segment or one it could not record. Requests sampled out, those that arrived after it
    stopped (at its bound or a failed write: its window ends there), and those still running when it stopped (the
    replay ends before the first of them, `load_capture_tasks`) are no holes."""
    counts = manifest.counts
    lost = {"because its queue was full": counts.dropped_queue_full, "because a write failed": counts.dropped_write_error,
            "larger than a segment": counts.dropped_too_large, "it could not record": counts.unreadable}
    if not any(lost.values()):
        return None
    said = ", ".join(f"{n} {why}" for why, n in lost.items() if n)
    return f"the capture lost {sum(lost.values())} of its requests between the {counts.written} it holds ({said})"


def load_capture_tasks(spec: str) -> CaptureTaskSet:
    """The tasks of `capture:DIR`, verified against its manifest."""
    directory = Path(spec.removeprefix(PREFIX))
    manifest, records = read_capture(directory)
    name = f"{PREFIX}{directory.name}"
    if not records:
        raise FieldError("tasks", f"capture {directory} holds no requests")
    # in arrival order: an observer sees exchanges as they end, not begin
    arrived = sorted(records, key=lambda r: r.offset_s)
    until = manifest.lost_from_offset_s
    window = [r for r in arrived if until is None or r.offset_s < until]
    if not window:
        raise FieldError("tasks", f"capture {directory}: its first request, at {until:g} s, was still running when "
                         "it stopped, and was lost: it holds no whole window to replay")
    refused = [(record, why) for record in window if (why := _refusal(record)) is not None]
    left_out = _left_out(manifest, len(window), refused)
    if len(refused) == len(window):
        raise FieldError("tasks", f"capture {directory}: nothing in it can be replayed: {left_out}")
    ends = (f"replays its first {len(window)} of {len(arrived)} requests, those that arrived before {until:g} s: a "
            "request that arrived then was still running when it stopped, and was lost" if until is not None else None)
    gone = {record.seq for record, _ in refused}
    window = [r for r in window if r.seq not in gone]
    tasks: Sequence[ReplayTask] = [_task(r.seq, r.route, r.body, r.offset_s, _where(manifest, r.seq)) for r in window]
    return CaptureTaskSet(name=name, tasks=tuple(tasks), arrivals_s=tuple(t.arrival_s for t in tasks),
                          holes="; ".join(lost for lost in (capture_holes(manifest), left_out) if lost) or None,
                          shortened=ends)
