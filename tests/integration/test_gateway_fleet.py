"""Several gateway replicas on one config file, as the replicated overlay runs them: they follow the file, show the
version they run, route sticky keys alike, are ready only after their first health round, and refuse admin PUTs."""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from dfserve import metrics as m
from dfserve.listen import wait_listening
from tests.integration.servers import gateway_argv, gateway_server, refusing_port, serve, sim_server, url_of

TOKEN = "t0ken-for-fleet-tests-only"
VERSION = re.compile(rf'^{m.ROUTING_VERSION}{{version="(\w+)"}} 1\.0$', re.M)
ADMIN_LISTENING = re.compile(r"dfserve gateway admin: listening on http://(\S+:\d+)")


def config(engine: str, baseline: float, candidate: float, **extra: Any) -> str:
    arms = {"baseline": {"weight": baseline, "replicas": [engine]}, "candidate": {"weight": candidate, "replicas": [engine]}}
    return yaml.safe_dump({"mode": "sticky", "arms": arms, "watch_interval_s": 0.1, "health": {"interval_s": 60},
                           "scrape": {"enabled": False}, **extra})


def replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def scrape(url: str) -> str:
    return httpx.get(url + "/metrics").text


def versions(urls: list[str]) -> list[str]:
    return [VERSION.findall(scrape(url))[0] for url in urls]


def arm_for(url: str, key: str) -> str:
    response = httpx.post(url + "/generate", headers={"x-dfserve-route-key": key},
                          json={"text": "def f():", "sampling_params": {"max_new_tokens": 2}}, timeout=10)
    assert response.status_code == 200, response.text
    return response.headers["x-dfserve-arm"]


def wait_for(condition: Any, timeout_s: float = 10.0) -> float:
    """Seconds until `condition()` held; fails after `timeout_s`."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "not reached in time"
        time.sleep(0.05)
    return time.monotonic() - start


def test_three_gateways_follow_one_file_and_route_sticky_keys_alike(tmp_path: Path) -> None:
    keys = [f"conversation-{i}" for i in range(24)]
    path = tmp_path / "gateway.yaml"
    with sim_server("zlab", 0.001, 0) as engine, contextlib.ExitStack() as stack:
        path.write_text(config(engine, 50, 50))
        urls = [stack.enter_context(gateway_server(path, log=tmp_path / f"gateway-{i}.log")) for i in range(3)]
        first = versions(urls)
        assert len(set(first)) == 1
        routes = {key: {arm_for(url, key) for url in urls} for key in keys}
        assert all(len(arms) == 1 for arms in routes.values()), routes
        assert {arms.pop() for arms in routes.values()} == {"baseline", "candidate"}

        replace(path, config(engine, 0, 1))
        wait_for(lambda: len(set(versions(urls))) == 1 and versions(urls)[0] != first[0])
        for url in urls:
            text = scrape(url)
            assert 'dfserve_arm_weight{arm="baseline"} 0.0' in text
            assert f'{m.ROUTING_RELOADS}_total{{outcome="applied"}} 1.0' in text
        assert {arm_for(url, key) for url in urls for key in keys} == {"candidate"}

        applied = versions(urls)
        replace(path, "arms: {candidate: {weight: -1}}\n")
        wait_for(lambda: all(f'{m.ROUTING_RELOADS}_total{{outcome="refused"}} 1.0' in scrape(url) for url in urls))
        assert versions(urls) == applied
        for i in range(3):
            assert "refused, routing " + applied[0] + " stays" in (tmp_path / f"gateway-{i}.log").read_text()


def test_ready_only_after_the_first_health_round(tmp_path: Path) -> None:
    """A replica that accepts connections and never answers holds the first round for the health timeout."""
    with refusing_port() as silent:
        silent.listen()
        path = tmp_path / "gateway.yaml"
        path.write_text(config(url_of(silent), 1, 1, health={"interval_s": 60, "timeout_s": 4}))
        with gateway_server(path) as url:
            starting = httpx.get(url + "/ready")
            assert starting.status_code == 503 and starting.json() == {"status": "starting"}
            assert httpx.get(url + "/health").status_code == 200
            wait_for(lambda: httpx.get(url + "/ready").status_code == 200)


def test_admin_put_is_refused_while_the_file_is_watched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFSERVE_ADMIN_TOKEN", TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with refusing_port() as unused:
        path = tmp_path / "gateway.yaml"
        path.write_text(config(url_of(unused), 9, 1, admin={"port": 0}))
        log = tmp_path / "gateway.log"
        with serve(gateway_argv(path), log=log) as gateway:
            base = wait_listening(log, gateway.process.poll, 10, ADMIN_LISTENING)
            described = httpx.get(base + "/admin/arms", headers=auth).json()
            assert described["watched"] == str(path) and described["version"] == versions([gateway.url])[0]
            refused = httpx.put(base + "/admin/arms", headers=auth, json=described["routing"])
            assert refused.status_code == 409
            assert refused.json()["error"]["message"] == (f"routing comes from {path}, which every replica watches: "
                                                          "change it there")
