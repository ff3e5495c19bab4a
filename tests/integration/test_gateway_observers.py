"""Observers of a real gateway (`gateway.entrypoint.serve`, in this process) in front of a simulated engine: each
exchange reaches each observer once, shadow mirrors and failed ones included, paired by request; an observer that
raises or stalls costs clients nothing."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections import Counter
from typing import Any

import httpx
import pytest

from dfserve.gateway import entrypoint, observers
from dfserve.gateway.config import load_config
from dfserve.gateway.observers import Exchanged
from tests.integration.servers import refusing_port, sim_server, url_of

pytestmark = pytest.mark.slow


class Recorder:
    def __init__(self, gate: threading.Event | None = None, expected: int = 0) -> None:
        self.seen: list[Exchanged] = []
        self.closed = False
        self.gate = gate
        self.expected = expected
        self.all_seen = threading.Event()

    def observe(self, exchanged: Exchanged) -> None:
        if self.gate is not None:
            self.gate.wait()
        self.seen.append(exchanged)
        if len(self.seen) == self.expected:
            self.all_seen.set()

    def close(self) -> None:
        self.closed = True


class Raising:
    def observe(self, exchanged: Exchanged) -> None:
        raise RuntimeError("observer down")

    def close(self) -> None:
        """Nothing is held."""


RAISED = 'dfserve_gateway_observer_failures_total{observer="raising",reason="failed"} 36.0'


def test_every_exchange_reaches_every_observer_once(monkeypatch: pytest.MonkeyPatch) -> None:
    requests = 12
    listening: list[str] = []
    gate = threading.Event()
    recorder, stalled = Recorder(expected=3 * requests), Recorder(gate)
    monkeypatch.setitem(observers.KINDS, "test_stalled", lambda options: stalled)
    with sim_server("zlab", 0.02, 0) as engine, refusing_port() as dead:
        config = load_config(None, {
            "host": "127.0.0.1", "port": 0, "scrape.enabled": False, "health.interval_s": 60,
            "health.eject_after_failures": 1000, "observers": [{"kind": "test_stalled", "queue_size": 2}],
            "routing.mode": "shadow", "routing.primary": "baseline",
            "routing.arms": {"baseline": {"weight": 1, "replicas": [engine]},
                             "candidate": {"weight": 1, "replicas": [engine]},
                             "dead": {"weight": 1, "replicas": [url_of(dead)]}}})

        async def run() -> tuple[list[int], str]:
            announced = asyncio.Event()

            def announce(name: str, sock: socket.socket) -> None:
                listening.append(url_of(sock))
                announced.set()

            monkeypatch.setattr(entrypoint, "announce", announce)
            served = asyncio.ensure_future(entrypoint.serve(config, observers={
                "recorder": recorder, "raising": Raising()}))
            await asyncio.wait_for(announced.wait(), 30)
            async with httpx.AsyncClient(base_url=listening[0], timeout=30) as client:
                bodies: list[dict[str, Any]] = [
                    {"text": f"prompt {i}", "sampling_params": {"max_new_tokens": 8}, "stream": i % 2 == 0}
                    for i in range(requests)]
                statuses = [(await client.post("/generate", json=body)).status_code for body in bodies]
                await asyncio.to_thread(recorder.all_seen.wait, 20)
                # each observer's thread takes its batches on its own: the raising one may still be waiting for its
                # last batch (BATCH_WAIT_S) when the recorder has seen every exchange
                for _ in range(100):
                    text = (await client.get("/metrics")).text
                    if RAISED in text:
                        break
                    await asyncio.sleep(0.1)
            gate.set()
            served.cancel()
            await asyncio.gather(served, return_exceptions=True)
            return statuses, text

        statuses, metrics = asyncio.run(run())
    assert statuses == [200] * requests  # neither the raising nor the stalled observer touched a client
    seen = recorder.seen
    assert len(seen) == 3 * requests and recorder.closed
    by_request = Counter(e.request_id for e in seen)
    assert len(by_request) == requests and set(by_request.values()) == {3}
    assert any(e.streamed for e in seen) and all(e.pieces is None for e in seen)  # no shadow records: none kept
    for request_id in by_request:
        arms = {e.outcome.arm: e for e in seen if e.request_id == request_id}
        assert set(arms) == {"baseline", "candidate", "dead"}
        assert not arms["baseline"].mirror and arms["candidate"].mirror and arms["dead"].mirror
        assert arms["baseline"].body == arms["candidate"].body and arms["baseline"].path == "/generate"
        assert all(e.request == json.loads(e.body) for e in arms.values())  # decoded once, by the gateway
        assert arms["baseline"].outcome.status == arms["candidate"].outcome.status == 200
        assert arms["baseline"].outcome.measure == "exact" and arms["baseline"].outcome.accept_length
        assert arms["dead"].outcome.error == "connect" and arms["dead"].outcome.status == 502
    assert RAISED in metrics
    (behind,) = [line for line in metrics.splitlines()
                 if line.startswith('dfserve_gateway_observer_failures_total{observer="test_stalled",reason="behind"}')]
    assert float(behind.rsplit(" ", 1)[1]) >= 3 * requests - 3 and stalled.closed
    assert 'dfserve_gateway_observer_failures_total{observer="recorder",reason="behind"} 0.0' in metrics
    assert 'dfserve_gateway_observer_failures_total{observer="recorder",reason="failed"} 0.0' in metrics
