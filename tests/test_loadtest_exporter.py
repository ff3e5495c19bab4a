"""Live Prometheus export of a load test: dfserve.metrics names, per arm, warm-up left out, served on loopback."""

from __future__ import annotations

import httpx
import pytest

from dfserve import metrics
from dfserve.errors import UserError
from loadtest.exporter import Exporter
from tests.servers import free_port
from tests.test_judge import synthetic


def test_records_become_per_arm_families_and_are_served_on_loopback() -> None:
    exporter = Exporter(route="/generate")
    records = synthetic("zlab", 5, 8.0, seed=1, tokens=32) + synthetic("inhouse", 5, 8.0, seed=1, tokens=32, errors=1.0)
    records.append(records[0].model_copy(update={"warmup": True, "index": 99}))
    for r in records:
        exporter.observe(r)
    sample = exporter.registry.get_sample_value
    labels = {"arm": "zlab", "route": "/generate"}
    assert sample(f"{metrics.REQUESTS}_total", {**labels, "replica": "", "status": "ok"}) == 5
    assert sample(f"{metrics.REQUESTS}_total", {"arm": "inhouse", "route": "/generate", "replica": "",
                                                "status": "http_status"}) == 5
    assert sample(f"{metrics.OUTPUT_TOKENS}_total", labels) == 5 * 32
    assert sample(f"{metrics.TTFT}_count", labels) == 5
    assert sample(f"{metrics.ITL_PER_TOKEN}_count", labels) == 5 * 31
    assert sample(f"{metrics.ACCEPT_LENGTH}_count", {**labels, "measure": "exact"}) == 5
    port = free_port()
    exporter.serve(port)
    try:
        body = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert f'{metrics.SPEC_VERIFY_ROUNDS}_total{{arm="zlab",route="/generate"}}' in body
        with pytest.raises(UserError, match="--metrics-port"):
            Exporter(route="/generate").serve(port)
    finally:
        exporter.close()
