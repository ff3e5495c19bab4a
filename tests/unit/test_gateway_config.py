"""Gateway config: YAML plus flags, validated when built, with errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dfserve.errors import UserError
from dfserve.gateway.cli import parse_arm_flag
from dfserve.gateway.config import endpoint, load_config, parse_routing

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
    for unnamed in ("ärm", "a.b", "a b"):  # `dfserve dashboards` refused the first; --set paths split the second
        with pytest.raises(UserError, match=rf"arm name '{unnamed}': use ASCII letters, digits, '-' and '_'"):
            load_config(None, {"routing.mode": "split", "routing.arms": {unnamed: {"weight": 1,
                                                                                  "replicas": ["http://h:1"]}}})
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


ARM = "arms: {a: {weight: 1, replicas: ['http://h:1']}}\n"
SHADOW = ("mode: shadow\nprimary: a\narms: {a: {weight: 1, replicas: ['http://h:1']}, "
          "b: {weight: 0, replicas: ['http://h:2']}}\n")


def _refused(tmp_path: Path, text: str) -> str:
    path = tmp_path / "g.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as caught:
        load_config(path, {})
    return str(caught.value).removeprefix(f"{path}: ")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("port: true\n" + ARM, "port: Input should be a valid integer"),
        ("arms: {a: {weight: '50', replicas: ['http://h:1']}}\n", "routing.arms.a.weight: Input should be a valid number"),
        ("arms: {a: {weight: true, replicas: ['http://h:1']}}\n", "routing.arms.a.weight: Input should be a valid number"),
        ("shed: 'yes'\n" + ARM, "routing.shed: Input should be a valid boolean"),
        ("shadow_fraction: '0.5'\n" + ARM, "routing.shadow_fraction: Input should be a valid number"),
        ("limits: {max_retries: '2'}\n" + ARM, "limits.max_retries: Input should be a valid integer"),
        ("limits: {max_retries: 2.0}\n" + ARM, "limits.max_retries: Input should be a valid integer"),
        ("scrape: {enabled: 1}\n" + ARM, "scrape.enabled: Input should be a valid boolean"),
        ("admin: {port: '9001'}\n" + ARM, "admin.port: Input should be a valid integer"),
        ("seed: false\n" + ARM, "seed: Input should be a valid integer"),
        ("observers: [{kind: x, queue_size: '3'}]\n" + ARM, "observers.0.queue_size: Input should be a valid integer"),
        ("schema_version: true\n" + ARM, "schema_version: Input should be 1"),
        ("schema_version: 1.0\n" + ARM, "schema_version: Input should be 1"),
        ("capture: {dir: c, fraction: '0.5'}\n" + ARM, "capture.fraction: Input should be a valid number"),
        ("capture: {dir: c, seed: true}\n" + ARM, "capture.seed: Input should be a valid integer"),
        (SHADOW + "shadow: {dir: s, until_decided: 'no'}\n", "shadow.until_decided: Input should be a valid boolean"),
        (SHADOW + "shadow: {dir: s, max_folders: 2.0}\n", "shadow.max_folders: Input should be a valid integer"),
    ],
)
def test_numbers_and_booleans_are_not_guessed(tmp_path: Path, text: str, message: str) -> None:
    """`port: true` is not port 1, `weight: "50"` is not 50: the file says what it means or is refused."""
    assert _refused(tmp_path, text) == message


def test_ints_pass_for_floats_and_lists_for_tuples(tmp_path: Path) -> None:
    """Strict, not stricter: `weight: 50` is a number and YAML lists fill tuples; `weight: 50.0` is no count."""
    path = tmp_path / "g.yaml"
    path.write_text("arms: {a: {weight: 50, replicas: ['http://h:1']}}\nlimits: {head_timeout_s: 5}\n"
                    "health: {max_ejection_percent: 50}\nobservers: [{kind: x}]\nschema_version: 1\n")
    config = load_config(path, {})
    assert config.routing.arms["a"].weight == 50 and isinstance(config.routing.arms["a"].weight, float)
    assert config.limits.head_timeout_s == 5.0 and config.health.max_ejection_percent == 50.0
    assert config.routing.arms["a"].replicas == ("http://h:1",) and config.observers[0].kind == "x"
    assert _refused(tmp_path, ARM + "limits: {max_connections: 50.0}\n") == (
        "limits.max_connections: Input should be a valid integer")
    path.write_text(SHADOW + "shadow: {dir: s, until_decided: true, gate: g.yaml}\n"
                    "capture: {dir: c, redact: drop, drop_fields: [user], drop_headers: [x-team], fraction: 1}\n")
    config = load_config(path, {})
    assert config.shadow is not None and (config.shadow.dir, config.shadow.gate) == (Path("s"), Path("g.yaml"))
    assert config.capture is not None and config.capture.dir == Path("c") and config.capture.fraction == 1.0
    assert (config.capture.drop_fields, config.capture.drop_headers) == (("user",), ("x-team",))


def test_flag_values_still_validate(tmp_path: Path) -> None:
    """What click hands over (ints, floats, bools, `--arm`'s ArmConfig) passes the strict models."""
    path = tmp_path / "g.yaml"
    path.write_text(GOOD)
    config = load_config(path, {"port": 0, "routing.shed": True, "seed": 7, "health.interval_s": 0.5,
                                "scrape.interval_s": 2.0, "watch_interval_s": 1.0, "admin.port": 0,
                                "routing.arms": dict([parse_arm_flag("c=10@http://127.0.0.1:1")])})
    assert (config.port, config.seed, config.admin.port, config.routing.shed) == (0, 7, 0, True)
    assert config.routing.arms["c"].weight == 10.0
    with pytest.raises(UserError, match=r"^--port: Input should be a valid integer$"):
        load_config(path, {"port": True}, {"port": "--port"})


def test_admin_body_is_strict_too() -> None:
    arms = {"a": {"weight": "50", "replicas": ["http://h:1"]}}
    with pytest.raises(UserError) as caught:
        parse_routing({"arms": arms}, "body")
    assert str(caught.value) == "body: arms.a.weight: Input should be a valid number"
    assert parse_routing({"arms": {"a": {"weight": 50, "replicas": ["http://h:1"]}}}).arms["a"].weight == 50.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (ARM + "routing: {arms: {b: {weight: 1, replicas: ['http://h:2']}}}\n",
         "arms: also given as routing.arms; set it in one place"),
        ("mode: split\nrouting: {mode: split}\n" + ARM, "mode: also given as routing.mode; set it in one place"),
    ],
)
def test_routing_key_given_twice_is_refused(tmp_path: Path, text: str, message: str) -> None:
    """Top-level `arms:` and `routing: {arms: ...}` both set the arms: neither may silently win."""
    assert _refused(tmp_path, text) == message


def test_routing_keys_at_either_level(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text("mode: sticky\nrouting: {shed: true, arms: {a: {weight: 1, replicas: ['http://h:1']}}}\n")
    config = load_config(path, {})
    assert config.routing.mode == "sticky" and config.routing.shed and list(config.routing.arms) == ["a"]
    path.write_text("shed: false\n" + path.read_text())
    assert _refused(tmp_path, path.read_text()) == "shed: also given as routing.shed; set it in one place"


@pytest.mark.parametrize("header", ["", "bad header:", "x y", "key\n", "{a}", "é"])
def test_sticky_header_must_be_a_header_name(tmp_path: Path, header: str) -> None:
    """No request can carry a header named `""` or `bad header:`; sticky mode would never see its key."""
    message = _refused(tmp_path, f"mode: sticky\nsticky_header: {json.dumps(header)}\n" + ARM)
    assert message == (f"routing.sticky_header: {header!r} is not an HTTP header name "
                       "(letters, digits and !#$%&'*+-.^_`|~)")


def test_sticky_header_token_characters(tmp_path: Path) -> None:
    path = tmp_path / "g.yaml"
    path.write_text("mode: sticky\nsticky_header: \"X-User_id.v2!#$%&'*+^`|~\"\n" + ARM)
    assert load_config(path, {}).routing.sticky_header == "X-User_id.v2!#$%&'*+^`|~"
    assert _refused(tmp_path, "mode: sticky\nsticky_header: 'X-User_id:'\n" + ARM).startswith(
        "routing.sticky_header: 'X-User_id:' is not an HTTP header name")


def test_a_flag_that_makes_the_files_section_invalid_is_named_beside_the_file(tmp_path: Path) -> None:
    """`--mode shadow` over a file without a primary was blamed on the file alone."""
    path = tmp_path / "split.yaml"
    path.write_text('routing:\n  mode: split\n  arms:\n    a: {weight: 1, replicas: ["http://127.0.0.1:1"]}\n')
    with pytest.raises(UserError) as caught:
        load_config(path, {"routing.mode": "shadow"}, {"routing.mode": "--mode"})
    assert str(caught.value) == f"{path} with --mode: routing: shadow mode needs primary: one of ['a']"


def test_one_replica_spelled_otherwise_is_one_endpoint() -> None:
    """A noise floor on the primary's own engine is refused however either URL spells it."""
    same = ["http://127.0.0.1:30000", "HTTP://LOCALHOST:30000/", "http://127.1:30000", "http://[::ffff:127.0.0.1]:30000"]
    assert len({endpoint(url) for url in same}) == 1
    assert endpoint("http://h") == endpoint("http://h:80") != endpoint("https://h")
    assert endpoint("http://10.0.0.1:30000") != endpoint("http://10.0.0.2:30000")
    assert endpoint("http://h:0") != endpoint("http://h") and endpoint("http://h:99999")[2] == 80  # not a port
