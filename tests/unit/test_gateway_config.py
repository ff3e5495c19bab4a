"""Gateway config: YAML plus flags, validated when built, with errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from dfserve.errors import UserError
from dfserve.gateway.cli import parse_arm_flag
from dfserve.gateway.config import load_config, parse_routing

GOOD = """
mode: split
arms:
  baseline: {weight: 90, replicas: ["http://127.0.0.1:30000/", "http://127.0.0.1:30001"]}
  candidate: {weight: 10, replicas: ["http://127.0.0.1:30002"]}
admin: {port: 9001}
"""


def test_yaml_with_flag_overrides(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text(GOOD)
    config = load_config(path, {"port": 9000, "routing.shed": True, "admin.host": "0.0.0.0"})
    assert config.port == 9000 and config.routing.shed and config.admin.host == "0.0.0.0"
    assert config.routing.arms["baseline"].replicas == ("http://127.0.0.1:30000", "http://127.0.0.1:30001")
    assert config.admin.port == 9001


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("mode: split\narms: {}\n", "routing.arms"),
        ("arms: {a: {weight: 0, replicas: ['http://h:1']}}\n", "positive weight"),
        ("arms: {a: {weight: 1, replicas: ['ftp://h:1']}}\n", "routing.arms.a.replicas"),
        ("arms: {a: {weight: 1, replicas: ['http://h:1/v1']}}\n", "routing.arms.a.replicas"),
        ("arms: {a: {weight: -1, replicas: ['http://h:1']}}\n", "routing.arms.a.weight"),
        ("arms: {a: {weight: .inf, replicas: ['http://h:1']}}\n", "routing.arms.a.weight: Input should be a finite"),
        ("arms: {a: {weight: 1.0e+400, replicas: ['http://h:1']}}\n", "routing.arms.a.weight"),
        ("arms: {a: {weight: .nan, replicas: ['http://h:1']}}\n", "routing.arms.a.weight"),
        ("arms: {a: {weight: 1.0e+308, replicas: ['http://h:1']}}\n", "routing.arms.a.weight: Input should be less"),
        ("arms: {a: {weight: 1, replicas: ['http://h:1'], extra: 1}}\n", "routing.arms.a.extra"),
        ("mode: shadow\narms: {a: {weight: 1, replicas: ['http://h:1']}, b: {weight: 1, replicas: ['http://h:2']}}\n",
         "primary"),
        ("arms: {a: {weight: 1, replicas: ['http://h:1']}}\nlimits: {max_body_bytes: 0}\n", "limits.max_body_bytes"),
        ("arms: {a: {weight: 1, replicas: ['http://h:1']}}\nlimits: {head_timeout_s: 0}\n", "limits.head_timeout_s"),
        ("arms: {a: {weight: 1, replicas: ['http://h:1']}}\nlimits: {max_connections: -1}\n",
         "limits.max_connections"),
        ("- not a mapping\n", "mapping"),
        ("arms: [unclosed\n", "invalid YAML"),
    ],
)
def test_bad_config_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "g.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=field.replace(".", r"\.")):
        load_config(path, {})


def test_arm_flag() -> None:
    name, arm = parse_arm_flag("candidate=10@http://127.0.0.1:1,http://127.0.0.1:2")
    assert name == "candidate" and arm.weight == 10 and len(arm.replicas) == 2
    for bad in ("candidate", "c=x@http://h:1", "c=1@", "=1@http://h:1"):
        with pytest.raises(UserError, match="--arm"):
            parse_arm_flag(bad)
    for unbounded in ("inf", "-inf", "nan", "1e400", "1e308"):
        with pytest.raises(UserError, match=r"^--arm: weight: Input should be"):
            parse_arm_flag(f"c={unbounded}@http://h:1")


def test_admin_port_needs_a_long_token(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text(GOOD)
    config = load_config(path, {})
    with pytest.raises(UserError, match="DFSERVE_ADMIN_TOKEN"):
        config.admin_token({})
    with pytest.raises(UserError):
        config.admin_token({"DFSERVE_ADMIN_TOKEN": "short"})
    assert config.admin_token({"DFSERVE_ADMIN_TOKEN": "x" * 16}) == "x" * 16


def test_routing_document_is_checked_whole() -> None:
    with pytest.raises(UserError, match=r"body: arms\.b\.replicas"):
        parse_routing({"arms": {"a": {"weight": 1, "replicas": ["http://h:1"]}, "b": {"weight": 1, "replicas": []}}},
                      "body")
