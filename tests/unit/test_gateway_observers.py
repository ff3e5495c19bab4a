"""The observers' seam without sockets: every exchange once and in order, off the loop; an observer that raises or
falls behind is counted and logged once, and never reaches the caller."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from dfserve import metrics as m
from dfserve.errors import FieldError
from dfserve.gateway import observers
from dfserve.gateway.config import load_config
from dfserve.gateway.entrypoint import assemble
from dfserve.gateway.observers import Exchanged, MetricsObserver, Observers
from dfserve.metrics import DfserveMetrics, ObserverMetrics, Outcome


def exchanged(request_id: int, status: int = 200, mirror: bool = False) -> Exchanged:
    return Exchanged(request_id, mirror, "POST", "/generate", b"x-user: 1\r\n", b'{"text": "hi"}', 1.0,
                     Outcome(arm="a", route="native", replica="http://r", status=status, error=None, ttft_s=0.01,
                             e2e_s=0.1, output_tokens=8, verify_rounds=2, accept_length=4.0, measure="exact"))


class Recorder:
    def __init__(self, gate: threading.Event | None = None) -> None:
        self.seen: list[Exchanged] = []
        self.closed = False
        self.gate = gate

    def observe(self, exchanged: Exchanged) -> None:
        if self.gate is not None:
            self.gate.wait()
        self.seen.append(exchanged)

    def close(self) -> None:
        self.closed = True


class Raising:
    def observe(self, exchanged: Exchanged) -> None:
        raise RuntimeError(f"cannot take {exchanged.request_id}")

    def close(self) -> None:
        raise RuntimeError("cannot close")


def failures(registry: CollectorRegistry, name: str, reason: str) -> str:
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(f'{m.OBSERVER_FAILURES}_total{{observer="{name}",reason="{reason}"}}'):
            return line.rsplit(" ", 1)[1]
    raise AssertionError(f"no series for {name} {reason}")


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def test_each_exchange_goes_once_and_in_order_to_every_observer(registry: CollectorRegistry) -> None:
    seam = Observers(ObserverMetrics.build(registry))
    metrics = DfserveMetrics.build(registry)
    seam.add("metrics", MetricsObserver(metrics), inline=True)
    first, second = Recorder(), Recorder()
    seam.add("first", first)
    seam.add("second", second, queue_size=64)
    sent = [exchanged(i, status=200 if i % 3 else 502, mirror=i % 2 == 1) for i in range(40)]
    for item in sent:
        seam.finished(item)
    seam.close()
    assert first.seen == sent and second.seen == sent and first.closed and second.closed
    text = generate_latest(registry).decode()
    assert f'{m.REQUESTS}_total{{arm="a",error="",replica="http://r",route="native",status="2xx"}} 26.0' in text
    assert f'{m.REQUESTS}_total{{arm="a",error="http_status",replica="http://r",route="native",status="5xx"}} 14.0' in text
    assert all(failures(registry, name, reason) == "0.0" for name in ("metrics", "first", "second")
               for reason in m.OBSERVER_FAILURE_REASONS)


def test_an_observer_that_raises_is_counted_and_logged_once(
        registry: CollectorRegistry, caplog: pytest.LogCaptureFixture) -> None:
    seam = Observers(ObserverMetrics.build(registry))
    kept = Recorder()
    seam.add("raising", Raising())
    seam.add("inline_raising", Raising(), inline=True)
    seam.add("kept", kept)
    with caplog.at_level(logging.ERROR, "dfserve.gateway"):
        for i in range(5):
            seam.finished(exchanged(i))  # nothing raised reaches the caller
        seam.close()
    assert [e.request_id for e in kept.seen] == list(range(5))
    assert failures(registry, "raising", "failed") == "6.0"  # five exchanges and its close
    assert failures(registry, "inline_raising", "failed") == "6.0"
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and all("RuntimeError: cannot take 0" in text for text in messages)


def test_an_observer_that_falls_behind_loses_exchanges_and_never_holds_the_caller(
        registry: CollectorRegistry, caplog: pytest.LogCaptureFixture) -> None:
    gate = threading.Event()
    slow, fast = Recorder(gate), Recorder()
    seam = Observers(ObserverMetrics.build(registry))
    seam.add("slow", slow, queue_size=2)
    seam.add("fast", fast)
    with caplog.at_level(logging.ERROR, "dfserve.gateway"):
        for i in range(10):
            seam.finished(exchanged(i))  # returns although `slow` takes nothing
        behind = int(float(failures(registry, "slow", "behind")))
        gate.set()
        seam.close()
    assert 10 - 3 <= behind <= 10 - 2  # the queue's two, and the one its thread may hold
    assert len(slow.seen) == 10 - behind and len(fast.seen) == 10
    assert failures(registry, "fast", "behind") == "0.0"
    (message,) = [r.getMessage() for r in caplog.records]
    assert "observer slow" in message and "queue is full" in message


class Batching:
    """Holds what it observes until `flush`, as a recording observer does; the first exchange waits for `gate`."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate
        self.pending: list[int] = []
        self.flushed: list[list[int]] = []
        self.closed_after: list[int] | None = None

    def observe(self, exchanged: Exchanged) -> None:
        self.gate.wait()
        self.pending.append(exchanged.request_id)

    def flush(self) -> None:
        if not self.pending:
            raise AssertionError("flushed without a batch")
        self.flushed.append(self.pending)
        self.pending = []

    def close(self) -> None:
        self.closed_after = list(self.pending)


def test_a_batch_is_flushed_once_after_its_exchanges_each_once_and_in_order(registry: CollectorRegistry) -> None:
    gate = threading.Event()
    batching = Batching(gate)
    seam = Observers(ObserverMetrics.build(registry))
    seam.add("batching", batching, queue_size=64)
    for i in range(30):
        seam.finished(exchanged(i))  # the thread holds the first; the rest queue up behind it
    gate.set()
    for i in range(30, 40):
        seam.finished(exchanged(i))
    seam.close()
    assert [rid for batch in batching.flushed for rid in batch] == list(range(40))
    assert batching.flushed[0][:30] == list(range(30))  # what was queued is one batch, one flush
    assert batching.closed_after == []  # everything was flushed before close
    assert failures(registry, "batching", "failed") == "0.0"


def opened() -> threading.Event:
    gate = threading.Event()
    gate.set()
    return gate


def seconds_until_flushed(batching: Batching, batches: int, timeout_s: float = 20.0) -> float:
    """How long until `batching` has flushed `batches` batches; fails past `timeout_s`."""
    started = time.monotonic()
    while len(batching.flushed) < batches:
        assert time.monotonic() - started < timeout_s, f"{len(batching.flushed)} of {batches} batches flushed"
        time.sleep(0.01)
    return time.monotonic() - started


def test_exchanges_that_finish_while_the_thread_waits_for_more_are_one_batch(
        registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    """Woken by one exchange, the thread waits `BATCH_WAIT_S` before it observes: what finished meanwhile is
    observed with it, in one batch (each batch's first exchange pays for the cold caches of the rest)."""
    monkeypatch.setattr(observers, "BATCH_WAIT_S", 1.0)
    batching = Batching(opened())
    seam = Observers(ObserverMetrics.build(registry))
    seam.add("batching", batching, queue_size=64)
    seam.finished(exchanged(0))
    time.sleep(0.05)
    for i in range(1, 6):
        seam.finished(exchanged(i))
    seconds_until_flushed(batching, 1)
    assert batching.flushed == [[0, 1, 2, 3, 4, 5]]
    seam.close()


class SlowFlush(Batching):
    """Holds its thread in its first flush until `release` is set."""

    def __init__(self) -> None:
        super().__init__(opened())
        self.flushing, self.release = threading.Event(), threading.Event()

    def flush(self) -> None:
        super().flush()
        self.flushing.set()
        self.release.wait(10)


def flushing_the_first(registry: CollectorRegistry,
                       monkeypatch: pytest.MonkeyPatch) -> tuple[SlowFlush, Observers, threading.Event]:
    """A lane whose thread has observed exchange 0 without waiting and is held in its flush: what is offered now
    queues behind it."""
    monkeypatch.setattr(observers, "BATCH_WAIT_S", 0.0)
    slow = SlowFlush()
    seam = Observers(ObserverMetrics.build(registry))
    seam.add("slow", slow, queue_size=64)
    seam.finished(exchanged(0))
    assert slow.flushing.wait(10)
    return slow, seam, slow.release


def test_a_thread_that_finds_a_backlog_takes_it_without_waiting(
        registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backlog (`BATCH_BACKLOG` exchanges queued while the thread was busy) is a batch already: it does not wait
    `BATCH_WAIT_S` for more, so the wait never caps how fast an observer keeps up."""
    monkeypatch.setattr(observers, "BATCH_BACKLOG", 2)
    slow, seam, release = flushing_the_first(registry, monkeypatch)
    monkeypatch.setattr(observers, "BATCH_WAIT_S", 30.0)
    for i in range(1, 4):
        seam.finished(exchanged(i))  # queued while the thread is busy flushing
    release.set()
    assert seconds_until_flushed(slow, 2) < 10  # not the 30 s wait
    assert slow.flushed == [[0], [1, 2, 3]]
    seam.close()


def test_a_few_exchanges_queued_while_busy_wait_for_the_batch(
        registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two or three exchanges that queued while the last batch was observed are no backlog: the thread waits
    `BATCH_WAIT_S` for the rest of the batch rather than observing them alone on cold caches."""
    slow, seam, release = flushing_the_first(registry, monkeypatch)
    monkeypatch.setattr(observers, "BATCH_WAIT_S", 2.0)  # far longer than the sleep below, on a loaded machine too
    for i in range(1, 3):
        seam.finished(exchanged(i))  # queued while the thread is busy flushing: fewer than BATCH_BACKLOG
    release.set()
    time.sleep(0.2)
    for i in range(3, 5):
        seam.finished(exchanged(i))  # during the wait: the same batch
    seconds_until_flushed(slow, 2)
    assert slow.flushed == [[0], [1, 2, 3, 4]]
    seam.close()


def test_a_flush_that_raises_is_counted_and_the_lane_goes_on(registry: CollectorRegistry) -> None:
    class FailingFlush(Recorder):
        def flush(self) -> None:
            raise OSError("disk full")

    observer = FailingFlush()
    seam = Observers(ObserverMetrics.build(registry))
    seam.add("failing", observer)
    for i in range(3):
        seam.finished(exchanged(i))
    seam.close()
    assert [e.request_id for e in observer.seen] == [0, 1, 2] and observer.closed
    assert float(failures(registry, "failing", "failed")) >= 1


def test_two_observers_of_one_name_are_refused(registry: CollectorRegistry) -> None:
    seam = Observers(ObserverMetrics.build(registry))
    seam.add("a", Recorder(), inline=True)
    with pytest.raises(FieldError, match="observers: two observers named 'a'"):
        seam.add("a", Recorder(), inline=True)


@pytest.fixture
def recorder_kind() -> Iterator[list[Recorder]]:
    built: list[Recorder] = []

    @observers.register("test_recorder")
    def make(options: Mapping[str, Any]) -> Recorder:
        if set(options) != {"label"}:
            raise FieldError("observers.options", f"test_recorder takes label, not {sorted(options)}")
        built.append(Recorder())
        return built[-1]

    yield built
    del observers.KINDS["test_recorder"]


def write(tmp_path: Path, entries: list[dict[str, Any]]) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({"arms": {"a": {"weight": 1, "replicas": ["http://127.0.0.1:1"]}},
                                    "observers": entries}))
    return path


def test_observers_are_registered_by_config(tmp_path: Path, recorder_kind: list[Recorder]) -> None:
    path = write(tmp_path, [{"kind": "test_recorder", "queue_size": 8, "options": {"label": "x"}}])
    gateway = assemble(load_config(path, {}))
    assert gateway.observers.names == ["metrics", "test_recorder"]
    gateway.observers.finished(exchanged(7))
    gateway.observers.close()
    (recorder,) = recorder_kind
    assert [e.request_id for e in recorder.seen] == [7] and recorder.closed


def test_an_unknown_kind_is_refused_naming_its_field(tmp_path: Path, recorder_kind: list[Recorder]) -> None:
    path = write(tmp_path, [{"kind": "test_recorder", "options": {"label": "x"}}, {"kind": "no_such_kind"}])
    with pytest.raises(FieldError, match=r"observers\.1\.kind: no observer kind 'no_such_kind' \(known: capture, .*test_recorder"):
        assemble(load_config(path, {}))
    with pytest.raises(ValueError, match="registered twice"):
        observers.register("test_recorder")(lambda options: Recorder())


def test_a_batch_lets_the_event_loop_run_between_two_exchanges(
        registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    """An observer thread holds the GIL for `GIL_SLICE_S`, or one exchange past it, not for the interpreter's
    switch interval: a batch of slow observations never holds the event loop back longer than that."""
    monkeypatch.setattr(observers, "BATCH_WAIT_S", 0.0)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # were the GIL never handed over, the loop would wait this long for it

    class Busy(Recorder):
        def observe(self, exchanged: Exchanged) -> None:
            until = time.perf_counter() + 0.002
            while time.perf_counter() < until:  # pure Python: the GIL held throughout
                continue
            super().observe(exchanged)

    async def longest_lag_s() -> float:
        longest = 0.0
        for _ in range(100):
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            longest = max(longest, time.perf_counter() - before - 0.001)
        return longest

    busy = Busy()
    seam = Observers(ObserverMetrics.build(registry))
    seam.add("busy", busy, queue_size=512)
    try:
        for i in range(500):
            seam.finished(exchanged(i))  # 1 s of observing, in one batch
        lag_s = asyncio.run(longest_lag_s())
    finally:
        sys.setswitchinterval(switch)
        seam.close()
    assert len(busy.seen) == 500
    # half the switch interval: a loaded machine may keep a runnable thread off a core for a while, whatever the GIL
    assert lag_s < 0.5, f"the loop waited {lag_s * 1000:.0f} ms for the GIL"
