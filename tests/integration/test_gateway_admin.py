"""The admin API on its own loopback listener: bearer token required, atomic routing replacement."""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from dfserve.listen import wait_listening
from tests.integration.servers import gateway_argv, refusing_port, serve, url_of

TOKEN = "t0ken-for-admin-tests-only"


ADMIN_LISTENING = re.compile(r"dfserve gateway admin: listening on http://(\S+:\d+)")


@pytest.fixture
def unused() -> Iterator[str]:
    """A replica address that refuses connections: no test here sends a request to a replica."""
    with refusing_port() as sock:
        yield url_of(sock)


@pytest.fixture
def admin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unused: str) -> Iterator[tuple[str, str]]:
    monkeypatch.setenv("DFSERVE_ADMIN_TOKEN", TOKEN)
    config = {
        "arms": {"baseline": {"weight": 90, "replicas": [unused]}, "candidate": {"weight": 10, "replicas": [unused]}},
        "health": {"interval_s": 60},
        "scrape": {"enabled": False},
        "admin": {"port": 0},
    }
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "gateway.log"
    with serve(gateway_argv(path), log=log) as gw:
        yield gw.url, wait_listening(log, gw.process.poll, 10, ADMIN_LISTENING)


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_refuses_missing_or_wrong_token(admin: tuple[str, str]) -> None:
    _, base = admin
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        for method in ("GET", "PUT"):
            response = httpx.request(method, base + "/admin/arms", headers=headers, json={})
            assert response.status_code == 401
            assert response.headers["www-authenticate"] == "Bearer"
            assert response.json()["error"]["type"] == "authentication_error"


def test_another_method_is_405_naming_those_allowed(admin: tuple[str, str]) -> None:
    _, base = admin
    response = httpx.post(base + "/admin/arms", headers=AUTH, json={})
    assert response.status_code == 405 and response.headers["allow"] == "GET, PUT"


def test_admin_is_not_served_on_the_client_listener(admin: tuple[str, str]) -> None:
    gw, _ = admin
    assert httpx.get(gw + "/admin/arms", headers=AUTH).status_code == 404


def test_put_replaces_weights_and_bad_documents_change_nothing(admin: tuple[str, str]) -> None:
    gw, base = admin
    current = httpx.get(base + "/admin/arms", headers=AUTH).json()
    assert current["routing"]["arms"]["candidate"]["weight"] == 10
    routing = current["routing"]
    routing["arms"]["candidate"]["weight"] = 50
    response = httpx.put(base + "/admin/arms", headers=AUTH, json=routing)
    assert response.status_code == 200 and response.json()["routing"]["arms"]["candidate"]["weight"] == 50
    assert 'dfserve_arm_weight{arm="candidate"} 50.0' in httpx.get(gw + "/metrics").text

    bad_documents = [
        (b"{not json", 400),
        (b'{"arms": {"baseline": {"weight": 0, "replicas": ["http://h:1"]}}}', 422),
        (b'{"mode": "shadow", "arms": {"baseline": {"weight": 1, "replicas": ["http://h:1"]}}}', 422),
        (b'{"arms": {"x": {"weight": 1, "replicas": ["not a url"]}}}', 422),
        (b'{"arms": {}, "surprise": 1}', 422),
    ]
    for body, status in bad_documents:
        refused = httpx.put(base + "/admin/arms", headers=AUTH, content=body)
        assert refused.status_code == status, body
        assert refused.json()["error"]["message"]
    assert httpx.get(base + "/admin/arms", headers=AUTH).json()["routing"] == routing


def _standard_json(text: str) -> object:
    def refuse(constant: str) -> object:
        raise ValueError(f"{constant} is not standard JSON")
    return json.loads(text, parse_constant=refuse)


def test_weights_must_be_finite_and_bounded(admin: tuple[str, str]) -> None:
    """An infinite weight (or one that overflows to it) would reverse the split and make GET answer non-standard
    JSON; a nested body is a 400, not a traceback."""
    gw, base = admin
    before = httpx.get(base + "/admin/arms", headers=AUTH).text
    for weight in (b"Infinity", b"1e400", b"NaN", b"1e308"):
        body = b'{"arms": {"baseline": {"weight": 1, "replicas": ["http://h:1"]}, "candidate": {"weight": %s, ' \
               b'"replicas": ["http://h:1"]}}}' % weight
        refused = httpx.put(base + "/admin/arms", headers=AUTH, content=body)
        assert refused.status_code == 422, weight
        assert refused.json()["error"]["message"].startswith("body: arms.candidate.weight: "), refused.text
    nested = httpx.put(base + "/admin/arms", headers=AUTH, content=b"[" * 100_000)
    assert nested.status_code == 400 and "nested too deeply" in nested.json()["error"]["message"]
    long = httpx.put(base + "/admin/arms", headers=AUTH, content=b'{"arms": ' + b"9" * 5000 + b"}")
    assert long.status_code == 400 and "4300" in long.json()["error"]["message"]
    after = httpx.get(base + "/admin/arms", headers=AUTH).text
    assert after == before and _standard_json(after)
    assert 'dfserve_arm_weight{arm="candidate"} 10.0' in httpx.get(gw + "/metrics").text


def test_put_can_add_and_remove_arms(admin: tuple[str, str], unused: str) -> None:
    gw, base = admin
    routing = {"mode": "split", "arms": {"only": {"weight": 1, "replicas": [unused]}}}
    assert httpx.put(base + "/admin/arms", headers=AUTH, json=routing).status_code == 200
    described = httpx.get(base + "/admin/arms", headers=AUTH).json()
    assert list(described["replicas"]) == ["only"]
    assert 'dfserve_arm_weight{arm="baseline"}' not in httpx.get(gw + "/metrics").text


def test_sighup_reloads_the_file_and_a_bad_file_changes_nothing(tmp_path: Path, unused: str) -> None:
    def write(weight: float) -> None:
        arms = {"baseline": {"weight": 90, "replicas": [unused]}, "candidate": {"weight": weight, "replicas": [unused]}}
        path.write_text(yaml.safe_dump({"arms": arms, "health": {"interval_s": 60}, "scrape": {"enabled": False}}))

    def weight() -> float:
        for line in httpx.get(base + "/metrics").text.splitlines():
            if line.startswith('dfserve_arm_weight{arm="candidate"}'):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("no weight series")

    def hangup_and_wait(expected: float) -> float:
        process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while weight() != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        return weight()

    path = tmp_path / "g.yaml"
    write(10)
    log = tmp_path / "gateway.log"
    with serve(gateway_argv(path), log=log) as gateway:
        base, process = gateway.url, gateway.process
        assert weight() == 10
        write(30)
        assert hangup_and_wait(30) == 30
        for bad, said in (("arms: {candidate: {weight: -1}}\n", "arms.candidate"),
                          ("routing: 5\n", "routing: expected a mapping")):
            path.write_text(bad)
            process.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 5
            while said not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert said in log.read_text()  # the handler ran and said why; only then is "unchanged" meaningful
            assert process.poll() is None and weight() == 30
        text = log.read_text()
        refused = [line for line in text.splitlines() if "refused" in line]
        assert len(refused) == 2 and all(f"config {path} refused, routing" in line for line in refused)
        assert "Traceback" not in text
        assert 'dfserve_gateway_routing_reloads_total{outcome="refused"} 2.0' in httpx.get(base + "/metrics").text
