"""A capture as the load tester's task set: `dfserve loadtest run --tasks capture:DIR`.

Each captured request becomes a `ReplayTask` that carries its own body, so it is replayed with its own sampling
settings; settings it did not set are taken from the run's flags (`--max-new-tokens`, `--temperature`,
`--top-p`), so the load stays bounded, and the run's config.json records the loosest settings of the replay (the
largest of each), so losslessness is judged only where every request was greedy. What the load tester changes in
each body: it streams (`stream`, chat's usage and spec details, which it measures with), chat names the arm's model
and drops `return_meta_info` (refused on a stream), and native drops `rid` (one id sent to every arm). Task ids carry a hash of that body, so the task set's hash
changes with any setting. A run replays one route; a capture that mixes routes, or one that cannot be replayed
(user text hashed, prompt dropped), or one that is incomplete or tampered with, is refused in one line.

    tasks = load_capture_tasks("capture:/var/dfserve/capture")
    tasks, sampling = tasks.for_run(sampling)
"""

from __future__ import annotations

import copy
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
from dfserve.capture.redact import PROMPT_FIELDS
from dfserve.errors import FieldError
from dfserve.loadtest.config import Sampling
from dfserve.tasks import Task, TaskSet

PREFIX = "capture:"
REPLAYED_ROUTES = ("native", "chat")


@dataclass(frozen=True)
class ReplayTask(Task):
    """A captured request, sent as it came (less what `request` says)."""

    seq: int = 0
    """The record's number in the capture."""
    route: sglang.Api = "native"
    body: dict[str, Any] = field(default_factory=dict, compare=False)
    arrival_s: float = 0.0
    """Seconds from the capture's start to its arrival."""

    def request(self, model: str) -> dict[str, Any]:
        """The body to send: the captured one, streamed, with the arm's model for chat."""
        body = copy.deepcopy(self.body)
        body["stream"] = True
        if self.route == "chat":
            body["model"] = model
            body.pop(sglang.RETURN_META_INFO, None)  # SGLang refuses it on a stream
            body[sglang.RETURN_SPEC_DETAILS] = True
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        else:
            body.pop("rid", None)
        return body


@dataclass(frozen=True)
class CaptureTaskSet(TaskSet):
    """The tasks of one capture, in arrival order."""

    route: sglang.Api
    arrivals_s: tuple[float, ...]

    def for_run(self, sampling: Sampling) -> tuple[CaptureTaskSet, Sampling]:
        """Tasks whose unset sampling settings are the run's, and the loosest settings among them (what the run
        records)."""
        tasks = tuple(_with_defaults(task, sampling) for task in self.tasks if isinstance(task, ReplayTask))
        settings = [_settings(task) for task in tasks]
        loosest = Sampling(max_new_tokens=max(s.max_new_tokens for s in settings),
                           temperature=max(s.temperature for s in settings), top_p=max(s.top_p for s in settings))
        return replace(self, tasks=tasks), loosest

    def check(self, api: str, trace: bool, count: int) -> None:
        """Refuse a run whose `--api` is not the capture's route, or a trace longer than the capture."""
        if api != self.route:
            raise FieldError("api", f"{self.name} holds {sglang.ROUTES[self.route]} requests, so replays as "
                             f"{self.route}, not {api}")
        if trace and count > len(self.tasks):
            raise FieldError("num_requests", f"a trace replays each of the capture's {len(self.tasks)} requests once, "
                             f"in order; {count} asked for ({{other}} included)", other="warmup")

    def trace(self, count: int) -> tuple[list[Task], list[float]]:
        """The first `count` requests in arrival order and their arrival offsets."""
        return list(self.tasks[:count]), list(self.arrivals_s[:count])


def _settings(task: ReplayTask) -> Sampling:
    """The settings a task is sent with, as the run records them; a capture's bad one named in one line."""
    body = task.body
    if task.route == "native":
        body = body["sampling_params"]
        values = {"max_new_tokens": body.get("max_new_tokens")}
    else:
        values = {"max_new_tokens": body.get("max_tokens", body.get("max_completion_tokens"))}
    try:
        return Sampling(**values, temperature=body.get("temperature"), top_p=body.get("top_p"))
    except ValidationError as exc:
        first = exc.errors()[0]
        raise FieldError("tasks", f"capture record {task.seq}: {'.'.join(map(str, first['loc']))}: "
                         f"{first['msg']}") from None


def _with_defaults(task: ReplayTask, sampling: Sampling) -> ReplayTask:
    params = sampling.params()
    body = copy.deepcopy(task.body)
    if task.route == "native":
        captured = body.get("sampling_params")
        body["sampling_params"] = {**params.native(), **(captured if isinstance(captured, dict) else {})}
    else:
        defaults = params.openai()
        if "max_completion_tokens" in body:
            defaults.pop("max_tokens")
        body = {**defaults, **body}
    return _task(task.seq, task.route, body, task.arrival_s)


def _task(seq: int, route: sglang.Api, body: dict[str, Any], arrival_s: float) -> ReplayTask:
    """Its id is the record's number and a hash of the body it is sent with."""
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    prompt_value = body.get(PROMPT_FIELDS[route], body.get("input_ids"))
    plain = isinstance(prompt_value, str)
    return ReplayTask(id=f"c{seq:06d}-{digest}", prompt=prompt_value if plain else json.dumps(prompt_value),
                      seq=seq, route=route, body=body, arrival_s=arrival_s)


def _where(manifest: CaptureManifest, seq: int) -> str:
    first = 0
    for segment in manifest.segments:
        if seq < first + segment.records:
            return f"{segment.name}:{seq - first + 1}"
        first += segment.records
    return f"seq {seq}"


def _refusal(record: CaptureRecord) -> str | None:
    if not record.replayable:
        how = ("its user text was hashed (redact: hash)" if record.redaction == "hash"
               else f"its prompt was dropped (redact: drop {', '.join(record.redacted)})")
        return f"cannot be replayed: {how}"
    if record.route not in REPLAYED_ROUTES:
        return f"is a {record.path} request; the load tester replays {' and '.join(sglang.ROUTES[r] for r in REPLAYED_ROUTES)}"
    if record.route == "native" and not isinstance(record.body.get("text", record.body.get("input_ids")), str | list):
        return "has no prompt (text or input_ids)"
    if record.route == "native" and isinstance(record.body.get("text"), list):
        return "is a batch (text is a list); a replayed request carries one prompt"
    if record.route == "native" and not isinstance(record.body.get("sampling_params", {}), dict):
        return "has a sampling_params that is not an object"
    if record.route == "chat" and not isinstance(record.body.get("messages"), list):
        return "has no messages"
    return None


def load_capture_tasks(spec: str) -> CaptureTaskSet:
    """The tasks of `capture:DIR`, verified against its manifest."""
    directory = Path(spec.removeprefix(PREFIX))
    manifest, records = read_capture(directory)
    name = f"{PREFIX}{directory.name}"
    if not records:
        raise FieldError("tasks", f"capture {directory} holds no requests")
    for record in records:
        refusal = _refusal(record)
        if refusal is not None:
            raise FieldError("tasks", f"capture {directory}: record {record.seq} ({_where(manifest, record.seq)}) "
                             f"{refusal}")
    routes = Counter(record.route for record in records)
    if len(routes) > 1:
        mix = ", ".join(f"{count} to {sglang.ROUTES[route]}" for route, count in routes.items())
        raise FieldError("tasks", f"capture {directory} mixes routes ({mix}); a run replays one route")
    arrived = sorted(records, key=lambda r: r.offset_s)  # an observer sees exchanges as they end, not begin
    tasks: Sequence[ReplayTask] = [_task(r.seq, r.route, r.body, r.offset_s) for r in arrived]
    return CaptureTaskSet(name=name, tasks=tuple(tasks), route=records[0].route,
                          arrivals_s=tuple(t.arrival_s for t in tasks))
