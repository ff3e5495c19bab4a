"""Observers of finished exchanges: the one seam through which the gateway tells what became of each request.

Every request the gateway sends to an arm (a client's, or a shadow mirror of one; answered, refused by the arm's
limits or failed) ends in one `Exchanged` record, handed once to `Observers.finished`; a request the gateway
refuses before it picks an arm (invalid JSON, an unknown route, an oversize body) is no exchange. Metrics are the
first observer (`MetricsObserver`), run inline on the event loop: it is a few dictionary lookups, and the families
it updates are read on the loop (`GET /metrics`). Every other observer (a capture of requests, shadow records)
runs on a thread of its own, fed by a bounded queue: the loop's cost per exchange is one `put_nowait`, and an
observer's work never runs on the hot path. The thread takes its exchanges in batches: woken by one with no
backlog behind it (`BATCH_BACKLOG`), it waits `BATCH_WAIT_S` for more, then observes everything queued by then, and
an observer with a `flush` method has it called after each batch, to write a batch at once. An exchange that
finds the queue full is dropped for that observer (one with a `missed` method is told, on the loop, to count it in
what it writes), and an observer that raises loses that exchange: both are counted
(`dfserve_gateway_observer_failures_total{observer, reason}`, reason `behind` or `failed`) and logged once per
observer and reason; neither ever fails or slows a client's request.

Observer kinds are entries of a registry (`register`), named in the gateway's YAML::

    observers:
      - {kind: my_capture, queue_size: 4096, options: {path: /var/lib/dfserve/capture}}

    @register("my_capture")
    def my_capture(options: Mapping[str, Any]) -> Observer: ...
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from prometheus_client import Counter

from dfserve.errors import FieldError
from dfserve.metrics import DfserveMetrics, ObserverMetrics, Outcome, observe

log = logging.getLogger("dfserve.gateway")


@dataclass(frozen=True, slots=True)
class Exchanged:
    """One finished exchange: the request as the gateway sent it, and what came of it."""

    request_id: int
    """The client request's number in this process; its shadow mirrors carry the same, so their records pair up."""
    mirror: bool
    """A shadow copy, answered to nobody."""
    method: str
    path: str
    headers: bytes
    """The header lines passed upstream: the client's, less hop-by-hop ones (credentials included)."""
    body: bytes
    """The body as the client sent it (the gateway may add `return_spec_tokens_details` upstream)."""
    start_s: float
    """When the client's request had been read, on `time.perf_counter`'s clock (shared by its mirrors)."""
    outcome: Outcome
    """Arm, replica, status, failure kind, TTFT, E2E, gaps, tokens and acceptance (exact or estimated)."""
    unparsed: str | None = None
    """Why a 200 answer could not be read as SGLang's, if it could not (its outcome's error is then `protocol`, and
    acceptance unknown)."""
    answer: bytes = b""
    """What the relay already held of the answer, at no cost to it: a whole body as the replica sent it, or a
    stream's last events (the whole output of a native stream, only the end of an OpenAI one, after the pieces of it
    that held an error or an abort)."""
    streamed: bool = False
    mirrors: tuple[str, ...] = ()
    """On a client's exchange: the arms its shadow copies were sent to (not those skipped, `skipped`)."""
    pieces: Sequence[tuple[float, bytes]] | Sequence[tuple[float, int]] | None = None
    """A recorded stream as its client read it: each piece of whole events, with the `perf_counter` reading of its
    arrival (`EventRelay.pieces`, by reference, decoded by the observer's thread), or, for a native stream (whose
    events repeat the whole output so far), each event's `completion_tokens` where it changed, with its piece's
    arrival (its output is in `answer`); None for a stream not recorded (which the gateway decides per request at
    dispatch: shadow records are of mirrored requests and their primary) and for a whole body."""
    request: Mapping[str, Any] | None = None
    """The body as the gateway decoded it (a JSON object, never changed after), read by observers instead of
    decoding `body` again: a coding prompt's body is tens of kilobytes. None where the gateway did not decode it."""
    sent_s: float | None = None
    """When the request was written to the replica that answered (`perf_counter`), None where none did."""
    skipped: tuple[str, ...] = ()
    """On a client's exchange: the arms its shadow copies were not sent to, their arm down (no healthy replica)."""
    paused_s: float = 0.0
    """How long the relay stopped reading the replica's stream because its client's socket was full (back-pressure):
    that long, its chunks came as fast as the client took them, not as the engine made them."""

    @property
    def timed_from_s(self) -> float:
        """Where its outcome's TTFT and E2E are timed from (`latency_origin`)."""
        return latency_origin(self.mirror, self.start_s, self.sent_s)


def latency_origin(mirror: bool, start_s: float, sent_s: float | None) -> float:
    """Where an exchange's latencies are timed from: a client's request from when the gateway had read it (its client
    waited for the gateway too); a mirror from when it was written to its replica, where it was (nobody waits for it,
    and the event loop sends it after its client's request, as it gets to it: that delay is the gateway's, not the
    mirrored arm's)."""
    return sent_s if mirror and sent_s is not None else start_s


class Observer(Protocol):
    """Sees every finished exchange once, in the order they finished, on a thread of its own."""

    def observe(self, exchanged: Exchanged) -> None:
        """Take one exchange; what it raises is counted and logged, and costs only this exchange."""

    def close(self) -> None:
        """The gateway is stopping: every exchange has been observed; flush and let go."""


@runtime_checkable
class Flushing(Protocol):
    """An observer that holds what it observed until `flush`, called after each batch of exchanges."""

    def flush(self) -> None:
        """Write what the batch's exchanges left pending; what it raises is counted and logged."""


@runtime_checkable
class Missing(Protocol):
    """An observer told of each exchange its full queue dropped, to count it in what it writes (a capture's
    manifest)."""

    def missed(self, exchanged: Exchanged) -> None:
        """Called on the event loop: as cheap as adding to a count."""


ObserverKind = Callable[[Mapping[str, Any]], Observer]
"""Builds an observer from its `options` in the config, raising `FieldError` for a bad one."""

KINDS: dict[str, ObserverKind] = {}


def register(kind: str) -> Callable[[ObserverKind], ObserverKind]:
    """Make an observer kind available to the config's `observers:` under `kind`."""
    def add(factory: ObserverKind) -> ObserverKind:
        if kind in KINDS:
            raise ValueError(f"observer kind {kind!r} is registered twice")
        KINDS[kind] = factory
        return factory
    return add


def build(kind: str, options: Mapping[str, Any], field: str) -> Observer:
    """The observer a config entry names; `FieldError` naming `field` for an unknown kind."""
    factory = KINDS.get(kind)
    if factory is None:
        known = ", ".join(sorted(KINDS)) or "none registered"
        raise FieldError(field, f"no observer kind {kind!r} (known: {known})")
    return factory(options)


class MetricsObserver:
    """The per-arm families (`dfserve.metrics.observe`, shared with the load tester), updated inline."""

    def __init__(self, metrics: DfserveMetrics) -> None:
        self.metrics = metrics

    def observe(self, exchanged: Exchanged) -> None:
        observe(self.metrics, exchanged.outcome)
        if exchanged.unparsed is not None:
            o, metrics = exchanged.outcome, self.metrics
            metrics.child(metrics.upstream_errors, o.arm, o.replica, "protocol").inc()

    def close(self) -> None:
        """Nothing is held."""


class _Faults:
    """One observer's missed exchanges: counted every time, logged the first time for each reason."""

    def __init__(self, name: str, counters: dict[str, Counter]) -> None:
        self.name = name
        self.counters = counters
        self.logged: set[str] = set()

    def __call__(self, reason: str, exc: BaseException | None) -> None:
        self.counters[reason].inc()
        if reason not in self.logged:
            self.logged.add(reason)
            why = f"it raised {type(exc).__name__}: {exc}" if exc is not None else "its queue is full"
            log.error("observer %s missed an exchange (%s); counted in dfserve_gateway_observer_failures_total, "
                      "logged once", self.name, why)


_STOP = object()

BATCH_WAIT_S = 0.25
"""How long an observer's thread, woken by an exchange, waits for more before it observes them. Between two
batches the event loop's work evicts an observer's code and data from the CPU's caches: a shadow record costs three
to four times as much made alone as in a batch of sixteen (bench/record_batches.py), so the first exchange of a
batch pays for the rest. A live decision or a capture on disk is later by as much."""

BATCH_BACKLOG = 64
"""Exchanges queued that make a batch at once: a thread that finds this many behind the one it took is behind, and
does not wait, so the wait never caps how fast an observer keeps up. A few queued while the last batch was observed
are no backlog: taken at once, they were a batch of two or three on cold caches, as dear as a batch of one each."""


GIL_SLICE_S = 0.001
"""How long an observer's thread observes before it lets the event loop, if it waits, take the GIL: without it,
the loop would wait the interpreter's switch interval (5 ms) behind a batch, added to requests' TTFT. Each hand-over
costs the observer its warm caches, so not after every exchange."""


class _Lane:
    """A bounded queue drained by a thread that calls one observer."""

    def __init__(self, name: str, observer: Observer, queue_size: int, faults: _Faults) -> None:
        self.observer = observer
        self.faults = faults
        self.queue: queue.Queue[object] = queue.Queue(queue_size)
        self.missed = observer.missed if isinstance(observer, Missing) else None
        self.thread = threading.Thread(target=self._drain, name=f"dfserve observer {name}", daemon=True)
        self.thread.start()

    def offer(self, exchanged: Exchanged) -> None:
        try:
            self.queue.put_nowait(exchanged)
        except queue.Full:
            self.faults("behind", None)
            if self.missed is not None:
                try:
                    self.missed(exchanged)
                except Exception as exc:
                    self.faults("failed", exc)

    def _drain(self) -> None:
        observer, flush = self.observer, self.observer.flush if isinstance(self.observer, Flushing) else None
        yield_at = 0.0
        while True:
            item = self.queue.get()
            if item is not _STOP and self.queue.qsize() < BATCH_BACKLOG:
                time.sleep(BATCH_WAIT_S)
            while item is not _STOP:  # taken one at a time: the queue's bound stays what the loop may hold
                try:
                    observer.observe(item)  # type: ignore[arg-type]  # everything else put is an Exchanged
                except Exception as exc:
                    self.faults("failed", exc)
                if time.perf_counter() >= yield_at:
                    time.sleep(0)  # the GIL, to the event loop if it waits for it
                    yield_at = time.perf_counter() + GIL_SLICE_S
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
            if flush is not None:
                try:
                    flush()
                except Exception as exc:
                    self.faults("failed", exc)
            if item is _STOP:
                break
        try:
            observer.close()
        except Exception as exc:
            self.faults("failed", exc)

    def stop(self, timeout_s: float) -> None:
        """Let the thread observe what is queued, then close its observer; a thread still busy after `timeout_s`
        is left (a daemon), said in one line."""
        try:
            self.queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            pass
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            log.error("observer %s did not finish within %g s of the gateway's stop; left behind",
                      self.faults.name, timeout_s)


class Observers:
    """The seam: every finished exchange goes to `finished`, which hands it to each registered observer."""

    def __init__(self, metrics: ObserverMetrics) -> None:
        self.metrics = metrics
        self._inline: list[tuple[Observer, _Faults]] = []
        self._lanes: list[_Lane] = []
        self._names: set[str] = set()

    @property
    def names(self) -> Sequence[str]:
        return sorted(self._names)

    def add(self, name: str, observer: Observer, *, queue_size: int = 4096, inline: bool = False) -> None:
        """Register `observer` under `name` (its `observer` label). Off the loop, on a thread of its own with a
        queue of `queue_size` exchanges, unless `inline`: only for work as cheap as a counter's, which then runs
        on the event loop for every exchange."""
        if name in self._names:
            raise FieldError("observers", f"two observers named {name!r}")
        self._names.add(name)
        faults = _Faults(name, self.metrics.watch(name))
        if inline:
            self._inline.append((observer, faults))
        else:
            self._lanes.append(_Lane(name, observer, queue_size, faults))

    def finished(self, exchanged: Exchanged) -> None:
        """Hand one exchange to every observer; nothing an observer does reaches the caller."""
        for observer, faults in self._inline:
            try:
                observer.observe(exchanged)
            except Exception as exc:
                faults("failed", exc)
        for lane in self._lanes:
            lane.offer(exchanged)

    def close(self, timeout_s: float = 5.0) -> None:
        """Every exchange queued is observed, then each observer is closed (the gateway's stop)."""
        lanes, self._lanes = self._lanes, []
        for lane in lanes:
            lane.stop(timeout_s)
        for observer, faults in self._inline:
            try:
                observer.close()
            except Exception as exc:
                faults("failed", exc)
