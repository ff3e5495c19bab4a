"""bench/tcp_floor_proxy.py, the benchmark's floor row: it must relay streams whole and keep connections alive,
or the floor it measures is not a proxy's."""

from __future__ import annotations

import json
import sys

import httpx
import pytest

from tests import ROOT
from tests.integration.servers import serve, sim_server

pytestmark = pytest.mark.slow
FLOOR = ROOT / "bench" / "tcp_floor_proxy.py"


def stream_text(client: httpx.Client, url: str, prompt: str) -> tuple[str, int]:
    """A native stream's final text, and the local port of the connection that carried it."""
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 24}, "stream": True}
    with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
        port = response.extensions["network_stream"].get_extra_info("client_addr")[1]
    return json.loads(events[-1])["text"], port


def test_floor_proxy_relays_streams_over_kept_alive_connections() -> None:
    with sim_server() as sim:
        argv = [sys.executable, str(FLOOR), "0", sim.rsplit(":", 1)[1]]
        with serve(argv) as floor, httpx.Client(timeout=30) as direct, httpx.Client(timeout=30) as proxied:
            prompts = [f"def task_{i}():" for i in range(3)]
            expected = [stream_text(direct, sim + "/generate", p)[0] for p in prompts]
            through = [stream_text(proxied, floor.url + "/generate", p) for p in prompts]
    assert [text for text, _ in through] == expected and all(expected)
    assert len({port for _, port in through}) == 1
