"""The routing source every gateway replica watches: versions, atomic apply, refusal of a bad file, the kubelet's
symlink swap."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest

from dfserve import metrics as m
from dfserve.gateway.app import Gateway
from dfserve.gateway.config import load_config, parse_routing, routing_version
from dfserve.gateway.watch import ConfigWatcher, reload_routing, restart_fields


def document(candidate: float, **extra: Any) -> dict[str, Any]:
    return {"mode": "sticky", "arms": {"baseline": {"weight": 90, "replicas": ["http://127.0.0.1:1"]},
                                       "candidate": {"weight": candidate, "replicas": ["http://127.0.0.1:2"]}},
            **extra}


def replace(path: Path, text: str) -> None:
    """Write a new version the way a careful writer does: a whole new file renamed over the old one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def watcher_on(path: Path) -> tuple[ConfigWatcher, Gateway]:
    gateway = Gateway(load_config(path, {}))
    return ConfigWatcher(path, lambda: load_config(path, {}), gateway, 0.1), gateway


def exposed(gateway: Gateway) -> str:
    return generate_latest(gateway.registry).decode()


def test_version_follows_the_routing_not_the_file_layout() -> None:
    routing = parse_routing(document(10))
    reordered = parse_routing(dict(reversed(list(document(10).items()))))
    assert routing_version(routing) == routing_version(reordered)
    assert len(routing_version(routing)) == 12
    assert routing_version(parse_routing(document(11))) != routing_version(routing)


def test_a_new_version_is_applied_and_shown(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(document(10)))
    watcher, gateway = watcher_on(path)
    old = gateway.version
    assert f'{m.ROUTING_VERSION}{{version="{old}"}} 1.0' in exposed(gateway)
    assert watcher.poll() == "unchanged"  # the version it started with
    assert watcher.poll() is None
    replace(path, "# a comment changes the bytes, not the routing\n" + yaml.safe_dump(document(10)))
    assert watcher.poll() == "unchanged"
    replace(path, yaml.safe_dump(document(30)))
    assert watcher.poll() == "applied"
    assert gateway.routing.arms["candidate"].weight == 30
    assert gateway.router.weights["candidate"] == 30
    assert gateway.version == routing_version(parse_routing(document(30))) != old
    text = exposed(gateway)
    assert f'version="{gateway.version}"' in text and f'version="{old}"' not in text
    assert f'{m.ROUTING_RELOADS}_total{{outcome="applied"}} 1.0' in text


@pytest.mark.parametrize("bad", [
    "arms: {candidate: {weight: -1}}\n",
    "arms: [unclosed\n",
    yaml.safe_dump(document(10, mode="shadow")),
    "- a list\n",
])
def test_a_bad_version_is_refused_once_and_the_last_good_one_stays(
        tmp_path: Path, bad: str, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(document(10)))
    watcher, gateway = watcher_on(path)
    good = gateway.version
    replace(path, bad)
    with caplog.at_level(logging.ERROR, "dfserve.gateway"):
        assert watcher.poll() == "refused"
        assert watcher.poll() is None  # reported once per version, not on every poll
    (message,) = [r.getMessage() for r in caplog.records]
    assert str(path) in message and f"routing {good} stays" in message
    assert gateway.version == good and gateway.routing.arms["candidate"].weight == 10
    assert f'{m.ROUTING_RELOADS}_total{{outcome="refused"}} 1.0' in exposed(gateway)
    replace(path, yaml.safe_dump(document(50)))
    assert watcher.poll() == "applied" and gateway.routing.arms["candidate"].weight == 50


def test_a_missing_file_is_refused_like_a_bad_one(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(document(10)))
    watcher, gateway = watcher_on(path)
    path.unlink()
    assert watcher.poll() == "refused" and watcher.poll() is None
    assert gateway.routing.arms["candidate"].weight == 10


def test_follows_the_kubelets_symlink_swap(tmp_path: Path) -> None:
    """A ConfigMap volume: `gateway.yaml -> ..data/gateway.yaml`, `..data -> ..<timestamp>`; an update writes a new
    timestamped folder and renames a new `..data` link over the old one."""
    def version_dir(name: str, candidate: float) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "gateway.yaml").write_text(yaml.safe_dump(document(candidate)))

    version_dir("..2026_12_01_06_00_00.1", 10)
    (tmp_path / "..data").symlink_to("..2026_12_01_06_00_00.1")
    path = tmp_path / "gateway.yaml"
    path.symlink_to("..data/gateway.yaml")
    watcher, gateway = watcher_on(path)
    assert watcher.poll() == "unchanged"
    version_dir("..2026_12_01_06_01_00.2", 25)
    (tmp_path / "..data_tmp").symlink_to("..2026_12_01_06_01_00.2")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    assert watcher.poll() == "applied" and gateway.routing.arms["candidate"].weight == 25


def test_fields_outside_routing_are_named_as_needing_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(document(10)))
    running = load_config(path, {})
    path.write_text(yaml.safe_dump(document(20, port=9999, health={"interval_s": 5})))
    assert restart_fields(running, load_config(path, {})) == ["port", "health"]


def test_a_version_that_changes_only_what_needs_a_restart_says_so(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Its routing unchanged, the reload ended there, without a word of the limits it did not apply."""
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(document(10)))
    watcher, _ = watcher_on(path)
    assert watcher.poll() == "unchanged" and not caplog.records
    replace(path, yaml.safe_dump(document(10, limits={"max_body_bytes": 5})))
    assert watcher.poll() == "unchanged"
    assert [r.getMessage() for r in caplog.records] == [
        f"config {path}: routing unchanged; limits changed, which take effect at the next start"]


@pytest.mark.parametrize(("bad", "overrides", "field"), [
    ("routing: 5\n", {}, "routing"),
    ("admin: 5\n", {"admin.port": 0}, "admin"),
])
def test_a_version_of_the_wrong_type_is_refused_and_the_watch_goes_on(
        tmp_path: Path, bad: str, overrides: dict[str, Any], field: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A mapping where a scalar came used to raise a TypeError out of the watcher's task, which ended it for good:
    no later version was applied and nothing was counted."""
    monkeypatch.setenv("DFSERVE_ADMIN_TOKEN", "x" * 16)
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(document(10)))
    gateway = Gateway(load_config(path, overrides))
    watcher = ConfigWatcher(path, lambda: load_config(path, overrides), gateway, 0.01)

    async def watch_through_a_bad_version() -> None:
        task = asyncio.ensure_future(watcher.run())
        await asyncio.sleep(0.05)
        replace(path, bad + yaml.safe_dump(document(10)))
        await asyncio.sleep(0.05)
        replace(path, yaml.safe_dump(document(40)))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if gateway.routing.arms["candidate"].weight == 40:
                break
        assert not task.done()
        task.cancel()

    with caplog.at_level(logging.ERROR, "dfserve.gateway"):
        asyncio.run(watch_through_a_bad_version())
    (message,) = [r.getMessage() for r in caplog.records]
    assert f"{field}: expected a mapping" in message and str(path) in message
    assert gateway.routing.arms["candidate"].weight == 40
    text = exposed(gateway)
    assert f'{m.ROUTING_RELOADS}_total{{outcome="refused"}} 1.0' in text
    assert f'{m.ROUTING_RELOADS}_total{{outcome="applied"}} 1.0' in text


def test_a_failure_no_check_foresaw_is_refused_in_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Whatever a load raises, the reload is refused and counted, never raised into the loop (SIGHUP, watch)."""
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(document(10)))
    gateway = Gateway(load_config(path, {}))

    def broken() -> Any:
        raise KeyError("unforeseen")

    with caplog.at_level(logging.ERROR, "dfserve.gateway"):
        assert reload_routing(gateway, broken, path) == "refused"
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.endswith("KeyError: 'unforeseen'") and "\n" not in message
    assert f'{m.ROUTING_RELOADS}_total{{outcome="refused"}} 1.0' in exposed(gateway)
