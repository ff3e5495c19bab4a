"""The admin API on its own loopback listener: bearer token required, atomic routing replacement."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.servers import LOOPBACK, dfserve_argv, free_port, gateway_server, serve

TOKEN = "t0ken-for-admin-tests-only"


@pytest.fixture
def admin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    monkeypatch.setenv("DFSERVE_ADMIN_TOKEN", TOKEN)
    port = free_port()
    config = {
        "arms": {"baseline": {"weight": 90, "replicas": [f"http://{LOOPBACK}:{free_port()}"]},
                 "candidate": {"weight": 10, "replicas": [f"http://{LOOPBACK}:{free_port()}"]}},
        "health": {"interval_s": 60},
        "scrape": {"enabled": False},
        "admin": {"port": port},
    }
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(config))
    with gateway_server(path) as gw:
        yield gw, f"http://{LOOPBACK}:{port}"


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_refuses_missing_or_wrong_token(admin: tuple[str, str]) -> None:
    _, base = admin
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        for method in ("GET", "PUT"):
            response = httpx.request(method, base + "/admin/arms", headers=headers, json={})
            assert response.status_code == 401
            assert response.headers["www-authenticate"] == "Bearer"
            assert response.json()["error"]["type"] == "authentication_error"


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


def test_put_can_add_and_remove_arms(admin: tuple[str, str]) -> None:
    gw, base = admin
    routing = {"mode": "split", "arms": {"only": {"weight": 1, "replicas": [f"http://{LOOPBACK}:{free_port()}"]}}}
    assert httpx.put(base + "/admin/arms", headers=AUTH, json=routing).status_code == 200
    described = httpx.get(base + "/admin/arms", headers=AUTH).json()
    assert list(described["replicas"]) == ["only"]
    assert 'dfserve_arm_weight{arm="baseline"}' not in httpx.get(gw + "/metrics").text


def test_sighup_reloads_the_file_and_a_bad_file_changes_nothing(tmp_path: Path) -> None:
    def write(weight: float) -> None:
        arms = {"baseline": {"weight": 90, "replicas": [f"http://{LOOPBACK}:{free_port()}"]},
                "candidate": {"weight": weight, "replicas": [f"http://{LOOPBACK}:{free_port()}"]}}
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
    port = free_port()
    base = f"http://{LOOPBACK}:{port}"
    argv = dfserve_argv("gateway", "--config", str(path), "--host", LOOPBACK, "--port", str(port))
    log = tmp_path / "gateway.log"
    with serve(argv, base + "/health", log=log) as process:
        assert weight() == 10
        write(30)
        assert hangup_and_wait(30) == 30
        path.write_text("arms: {candidate: {weight: -1}}\n")
        process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while "reload refused" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "reload refused" in log.read_text()  # the handler ran and said why; only then is "unchanged" meaningful
        assert process.poll() is None and weight() == 30
