"""The observers' process (`gateway.apart`) without sockets: exchanges cross whole and in order, faults and calls
come back, a failed build is refused in the gateway, and a child that stops reading or dies costs the caller
nothing but counted misses."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from dfserve.errors import FieldError
from dfserve.gateway import apart
from dfserve.gateway.observers import Exchanged, Observers
from dfserve.metrics import ObserverMetrics, Outcome
from tests.unit.test_gateway_observers import exchanged, failures


def streamed(request_id: int) -> Exchanged:
    body = json.dumps({"text": "é\ud800", "sampling_params": {"temperature": 0}}).encode()
    return Exchanged(request_id, True, "POST", "/generate", b"authorization: Bearer x\r\n", body, 3.5,
                     Outcome(arm="b", route="native", replica="http://r", status=200, error=None, ttft_s=0.01,
                             e2e_s=0.2, output_tokens=12, verify_rounds=3, accept_length=4.0, measure="exact"),
                     None, b'data: {"text": "x"}\n\ndata: [DONE]\n\n', True, ("b", "c"),
                     [(3.51, 4), (3.52, 12)], json.loads(body), 3.505)


class Seen:
    """Writes what it sees to a file: it runs in the child, the test reads the file."""

    def __init__(self, path: Path, when_built: Callable[..., None] | None = None) -> None:
        self.path = path
        if when_built is not None:
            when_built("built", os.getpid())

    def observe(self, exchanged: Exchanged) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps([exchanged.request_id, exchanged.body.decode(errors="surrogatepass"),
                                   exchanged.pieces, exchanged.request, exchanged.mirrors, exchanged.sent_s],
                                  ensure_ascii=True) + "\n")

    def close(self) -> None:
        with self.path.open("a") as file:
            file.write("closed\n")


class Raising:
    def observe(self, exchanged: Exchanged) -> None:
        raise RuntimeError(f"cannot take {exchanged.request_id}")

    def close(self) -> None:
        """Nothing is held."""


class Counting(Seen):
    """Counts what it missed (`Missing`), in its file."""

    def missed(self, exchanged: Exchanged) -> None:
        with self.path.open("a") as file:
            file.write(f"missed {exchanged.request_id} {len(exchanged.body)}\n")


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def seam(registry: CollectorRegistry) -> Iterator[Observers]:
    observers = Observers(ObserverMetrics.build(registry))
    yield observers
    observers.close()


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_an_exchange_crosses_whole_but_for_the_metrics_bins() -> None:
    sent = streamed(4)
    assert Exchanged.from_wire(sent.wire()) == sent  # its outcome has no bins: they stay with the gateway's metrics
    light = Exchanged.from_wire(sent.missed_wire())
    assert (light.request_id, light.mirror, light.method, light.outcome) == (4, True, "POST", sent.outcome)
    assert light.body == light.answer == b"" and light.pieces is None and light.request is None


def test_observers_in_the_child_see_every_exchange_in_order_then_close(seam: Observers, tmp_path: Path) -> None:
    calls: list[tuple[object, ...]] = []
    told = seam.remote(lambda *args: calls.append(args))
    seen = tmp_path / "seen.jsonl"
    seam.add_apart("seen", lambda: Seen(seen, told), queue_size=64)
    seam.start()
    for i in range(40):
        seam.finished(streamed(i) if i % 2 else exchanged(i))
    seam.close()
    got = lines(seen)
    assert got[-1] == "closed" and len(got) == 41
    first, second = json.loads(got[0]), json.loads(got[1])
    assert [json.loads(line)[0] for line in got[:-1]] == list(range(40))
    assert first[1:] == ['{"text": "hi"}', None, None, [], None]
    assert second[1] == '{"text": "\\u00e9\\ud800", "sampling_params": {"temperature": 0}}'
    assert second[2:] == [[[3.51, 4], [3.52, 12]], {"text": "é\ud800", "sampling_params": {"temperature": 0}},
                          ["b", "c"], 3.505]
    ((what, pid),) = calls
    assert what == "built" and pid != os.getpid()  # called in the gateway, from the child


def test_an_observer_that_raises_or_falls_behind_in_the_child_is_counted_in_the_gateway(
        seam: Observers, registry: CollectorRegistry, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    go = tmp_path / "go"

    class Stalled(Seen):
        def observe(self, exchanged: Exchanged) -> None:
            while not go.exists():
                time.sleep(0.01)
            super().observe(exchanged)

    seam.add_apart("raising", Raising)
    seam.add_apart("stalled", lambda: Stalled(tmp_path / "stalled.jsonl"), queue_size=2)
    seam.start()
    for i in range(12):
        seam.finished(exchanged(i))
    for _ in range(300):
        if failures(registry, "raising", "failed") == "12.0" and failures(registry, "stalled", "behind") != "0.0":
            break
        time.sleep(0.01)
    go.touch()
    seam.close()
    assert failures(registry, "raising", "failed") == "12.0"
    behind = float(failures(registry, "stalled", "behind"))
    assert behind >= 9 and len(lines(tmp_path / "stalled.jsonl")) == 12 - behind + 1  # and its close
    logged = [r.getMessage() for r in caplog.records if "observer raising missed" in r.getMessage()]
    assert logged == ["observer raising missed an exchange (it raised RuntimeError: cannot take 0); counted in "
                      "dfserve_gateway_observer_failures_total, logged once"]


def test_an_observer_that_cannot_be_built_is_refused_in_the_gateway(seam: Observers, tmp_path: Path) -> None:
    def refuse() -> Seen:
        raise FieldError("capture.dir", "already exists")

    seam.add_apart("capture", refuse)
    with pytest.raises(FieldError, match=r"^capture\.dir: already exists$"):
        seam.start()

    broken = Observers(ObserverMetrics.build(CollectorRegistry()))
    broken.add_apart("broken", lambda: Seen(tmp_path, when_built=lambda *args: 1 / 0))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="building the gateway's observers failed: ZeroDivisionError"):
        broken.start()


def test_the_child_ignores_the_gateways_signals_and_ends_with_its_pipe(seam: Observers, tmp_path: Path) -> None:
    seen = tmp_path / "seen.jsonl"
    seam.add_apart("seen", lambda: Seen(seen))
    seam.start()
    process = seam._process
    assert process is not None and process.pid is not None
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a terminal's ^C, kill on the group
        os.kill(process.pid, signum)
    seam.finished(exchanged(1))
    seam.close()
    assert lines(seen) == [json.dumps([1, '{"text": "hi"}', None, None, [], None]), "closed"]


def test_a_child_that_stops_reading_costs_the_caller_counted_misses(
        seam: Observers, registry: CollectorRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(apart, "BUFFER_BYTES", 4096)
    seen = tmp_path / "seen.jsonl"
    seam.add_apart("counting", lambda: Counting(seen), queue_size=100_000)
    seam.start()
    process = seam._process
    assert process is not None and process.pid is not None
    os.kill(process.pid, signal.SIGSTOP)  # reads nothing: the pipe fills, then the buffer
    big = exchanged(0)

    async def gateway() -> float:
        started = time.perf_counter()
        for i in range(400):
            seam.finished(Exchanged(i, False, "POST", "/generate", b"", b"x" * 20_000, 1.0, big.outcome))
            await asyncio.sleep(0)
        took_s = time.perf_counter() - started
        os.kill(process.pid, signal.SIGCONT)
        seam.seal()
        return took_s

    took_s = asyncio.run(gateway())
    dropped = float(failures(registry, "counting", "behind"))
    seam.close()
    got = lines(seen)
    missed = [line for line in got if line.startswith("missed ")]
    assert took_s < 2.0 and dropped > 0 and len(missed) == dropped
    assert all(line.endswith(" 0") for line in missed)  # told without the body
    assert len(got) - len(missed) - 1 == 400 - dropped and got[-1] == "closed"


def test_a_child_that_died_costs_the_caller_counted_misses(
        seam: Observers, registry: CollectorRegistry, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    seam.add_apart("seen", lambda: Seen(tmp_path / "seen.jsonl"))
    seam.start()
    process = seam._process
    assert process is not None and process.pid is not None
    seam.finished(exchanged(0))
    os.kill(process.pid, signal.SIGKILL)
    os.waitpid(process.pid, 0)
    process.pid = None
    seam.finished(exchanged(1))  # may find the pipe broken before the gateway's reader sees it closed
    assert process._reader is not None
    process._reader.join(5)
    for i in range(2, 5):
        seam.finished(exchanged(i))
    assert failures(registry, "seen", "behind") in ("3.0", "4.0")
    said = [r.getMessage() for r in caplog.records if "the observers' process ended" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("seen miss every later exchange, counted as behind")


def test_on_a_loop_a_turns_exchanges_are_one_write_and_sealing_sends_the_rest(
        seam: Observers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = tmp_path / "seen.jsonl"
    seam.add_apart("seen", lambda: Seen(seen), queue_size=10_000)
    seam.start()
    writes: list[int] = []
    write = os.write

    def counted(fd: int, data: bytes) -> int:
        writes.append(len(data))
        return write(fd, data)

    monkeypatch.setattr(apart.os, "write", counted)

    async def gateway() -> None:
        for turn in range(3):
            for i in range(100):
                seam.finished(exchanged(100 * turn + i))
            await asyncio.sleep(0)
        seam.seal()  # the gateway's stop, on its loop

    asyncio.run(gateway())
    assert len(writes) <= 6  # a turn's 100 exchanges in one write, or two where the pipe was full
    seam.close()
    got = lines(seen)
    assert len(got) == 301 and [json.loads(line)[0] for line in got[:-1]] == list(range(300))
