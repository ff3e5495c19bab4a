from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dfserve import __version__
from dfserve.cli import COMMANDS, root


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dfserve", *args], capture_output=True, text=True, timeout=60)


def test_help_lists_every_command_with_its_purpose() -> None:
    result = run("--help")
    assert result.returncode == 0
    for name, (_, purpose) in COMMANDS.items():
        assert name in result.stdout
        assert purpose.split()[0] in result.stdout


def test_version() -> None:
    result = run("--version")
    assert result.returncode == 0 and __version__ in result.stdout


def test_every_registered_command_imports() -> None:
    for name in COMMANDS:
        assert root.get_command(None, name) is not None, name  # type: ignore[arg-type]


def test_unknown_command_is_a_usage_error() -> None:
    result = run("no-such-command")
    assert result.returncode == 2
    assert "No such command" in result.stderr


BAD_INVOCATIONS = {
    "deploy more GPUs than a host has": (["deploy", "--drafter", "zlab", "--tp-size", "100000", "--dry-run"],
                                         "--tp-size: Input should be less than or equal to 8"),
    "deploy port out of range": (["deploy", "--drafter", "zlab", "--port", "65536", "--dry-run"], "--port:"),
    "sim time scale": (["deploy", "--drafter", "zlab", "--engine", "sim", "--time-scale", "0", "--dry-run"],
                       "--time-scale:"),
    "unknown host profile": (["deploy", "--drafter", "zlab", "--profile", "h100x8", "--dry-run"],
                             "--profile: 'h100x8' is neither a known profile"),
    "simulated drafter on sglang": (["deploy", "--drafter", "sim:inhouse", "--dry-run"],
                                    "runs only on a simulated engine"),
    "unwritable output folder": (["dashboards", "--out", "/proc/no-such-dir"], "/proc/no-such-dir"),
    "broken gateway yaml": (["gateway", "--config", "{bad_yaml}"], "invalid YAML at line 2"),
    "gateway port taken": (["gateway", "--port", "{taken}", "--arm", "a=1@http://127.0.0.1:9"], "already in use"),
    "sim port taken": (["sim", "--port", "{taken}"], "already in use"),
    "duplicate gateway arms": (["gateway", "--port", "0", "--arm", "a=1@http://127.0.0.1:9",
                                "--arm", "a=2@http://127.0.0.1:9"], "its own name"),
    "shadow records without shadow mode": (["gateway", "--port", "0", "--arm", "a=1@http://127.0.0.1:9",
                                            "--record", "/tmp/dfserve-never-written"], "need mode: shadow"),
    "secondary that is the primary": (["gateway", "--port", "0", "--mode", "shadow", "--primary", "a",
                                       "--arm", "a=1@http://127.0.0.1:9", "--arm", "b=1@http://127.0.0.1:9",
                                       "--record", "/tmp/dfserve-never-written", "--secondary", "a"],
                                      "shadow.secondary: 'a' is the noise floor, and cannot be the primary"),
    "until decided without shadow mode": (["gateway", "--port", "0", "--arm", "a=1@http://127.0.0.1:9",
                                           "--until-decided"], "--until-decided: the gate is decided on mirrored"),
    "until decided without records": (["gateway", "--port", "0", "--mode", "shadow", "--primary", "a",
                                       "--arm", "a=1@http://127.0.0.1:9", "--arm", "b=1@http://127.0.0.1:9",
                                       "--until-decided"], "give --record DIR"),
    "gate without until decided": (["gateway", "--port", "0", "--mode", "shadow", "--primary", "a",
                                    "--arm", "a=1@http://127.0.0.1:9", "--arm", "b=1@http://127.0.0.1:9",
                                    "--record", "/tmp/dfserve-never-written", "--look-every", "4"],
                                   "--gate, --look-every: only with --until-decided"),
    "until decided on a per-token rule": (["gateway", "--port", "0", "--mode", "shadow", "--primary", "a",
                                           "--arm", "a=1@http://127.0.0.1:9", "--arm", "b=1@http://127.0.0.1:9",
                                           "--record", "/tmp/dfserve-never-written", "--until-decided",
                                           "--gate", "{itl_gate}"], "--gate: rule itl_per_token_p95"),
    "infinite gateway weight": (["gateway", "--port", "0", "--arm", "a=inf@http://127.0.0.1:9"],
                                "--arm: weight: Input should be a finite number"),
    "loadtest without a load shape": (["loadtest", "run", "--arm", "a=http://127.0.0.1:9"], "--concurrency or --rate"),
    "loadtest speed without a trace": (["loadtest", "run", "--arm", "a=http://127.0.0.1:9", "--rate", "2",
                                        "--speed", "2"], "--speed: only with trace arrivals"),
    "gateway without arms": (["gateway", "--port", "0"], "give the arms: --arm NAME=WEIGHT@URL for each, or --config"),
    "gateway arm without a url": (["gateway", "--port", "0", "--arm", "a=1@"], "--arm 'a=1@': expected NAME=WEIGHT@URL"),
    "loadtest force without a capture": (["loadtest", "run", "--arm", "a=http://127.0.0.1:9", "--concurrency", "2",
                                          "--force"], "--force: only with --tasks capture:DIR"),
    "loadtest concurrency below 1": (["loadtest", "run", "--arm", "a=http://127.0.0.1:9", "--concurrency", "0"],
                                     "--concurrency: must be >= 1"),
    "served model name naming another field": (["deploy", "--drafter", "zlab", "--served-model-name", "{{nope}}",
                                                 "--dry-run"], "--served-model-name: '{nope}': only {drafter}"),
    "health timeout not a number": (["deploy", "--drafter", "zlab", "--health-timeout", "nan", "--emit", "k8s",
                                     "--dry-run"], "--health-timeout: 'nan' is not a finite number"),
    "SGLang arguments to the simulator": (["deploy", "--drafter", "zlab", "--engine", "sim",
                                           "--sglang-arg=--log-level=debug", "--dry-run"],
                                          "--sglang-arg: the simulated engine takes no SGLang arguments"),
    "infinite simulator time scale": (["deploy", "--drafter", "zlab", "--engine", "sim", "--time-scale", "inf",
                                       "--dry-run"], "--time-scale: 'inf' is not a finite number"),
    "compare with an empty arm name": (["compare", "/tmp", "--baseline", ""], "--baseline: give an arm's name"),
    "capture tasks without a folder": (["loadtest", "run", "--arm", "a=http://127.0.0.1:9", "--concurrency", "1",
                                        "--tasks", "capture:"], "--tasks: capture:: name what follows"),
    "pushgateway of another scheme": (["loadtest", "run", "--arm", "a=http://127.0.0.1:9", "--concurrency", "1",
                                       "--pushgateway", "ftp://x"], "--pushgateway: 'ftp://x' is not http(s)"),
    "gate with a key twice": (["loadtest", "run", "--arm", "a=http://127.0.0.1:9", "--arm", "b=http://127.0.0.1:9",
                               "--concurrency", "1", "--until-decided", "--gate", "{dup_gate}"],
                              "invalid YAML at line 2, column 1: key 'rules' given twice"),
    "gateway config nested too deeply": (["gateway", "--config", "{deep_yaml}"], "invalid YAML: nested too deeply"),
    "gateway config not UTF-8": (["gateway", "--config", "{latin1_yaml}"], "not UTF-8 text"),
    "gateway health path without its slash": (["gateway", "--config", "{health_yaml}"], "health.path"),
    "gateway port out of range": (["gateway", "--port", "65536", "--arm", "a=1@http://127.0.0.1:9"],
                                  "--port: Input should be less than or equal to 65535"),
    "gateway health interval of nothing": (["gateway", "--port", "0", "--arm", "a=1@http://127.0.0.1:9",
                                            "--health-interval", "0"], "--health-interval: Input should be greater"),
    "gateway arm port out of range": (["gateway", "--port", "0", "--arm", "a=1@http://127.0.0.1:99999"],
                                      "is not a base URL"),
    "loadtest arm port out of range": (["loadtest", "run", "--arm", "a=http://127.0.0.1:99999", "--concurrency", "1"],
                                       "--arm"),
    "loadtest error rate not a number": (["loadtest", "run", "--arm", "a=http://127.0.0.1:9", "--concurrency", "1",
                                          "--max-error-rate", "nan"], "--max-error-rate: 'nan' is not a finite number"),
    "loadtest metrics port out of range": (["loadtest", "run", "--arm", "a=http://127.0.0.1:9", "--concurrency", "1",
                                            "--metrics-port", "70000"], "--metrics-port: 70000 is not a port"),
    "loadtest infinite temperature": (["loadtest", "run", "--arm", "a=http://127.0.0.1:9", "--concurrency", "1",
                                       "--temperature", "inf"], "--temperature:"),
    "loadtest arm under a path": (["loadtest", "run", "--arm", "a=http://127.0.0.1:9/v1", "--concurrency", "1"],
                                  "--arm a: http://127.0.0.1:9/v1 is not a server's root; give http://127.0.0.1:9 "),
    "loadtest arm name the gateway would refuse": (["loadtest", "run", "--arm", "zlab.v1=http://127.0.0.1:9",
                                                    "--concurrency", "1"],
                                                   "--arm: 'zlab.v1' is not an arm name (ASCII letters, digits, "),
    "loadtest no measured request": (["loadtest", "run", "--arm", "a=http://127.0.0.1:9", "--concurrency", "1",
                                      "--num-requests", "-1", "--warmup", "3"], "--num-requests: must be from 1 to"),
    "loadtest schedule too long to build": (["loadtest", "run", "--arm", "a=http://127.0.0.1:9", "--concurrency", "1",
                                             "--num-requests", "1000000000000"], "--num-requests: must be from 1 to"),
    "loadtest constant arrivals without a rate": (["loadtest", "run", "--arm", "a=http://127.0.0.1:9", "--concurrency",
                                                   "2", "--arrival", "constant"], "--arrival constant: an open loop's"),
    "loadtest header it writes itself": (["loadtest", "run", "--arm", "a=http://127.0.0.1:9", "--concurrency", "1",
                                          "--header", "Content-Length: 3"], "--header Content-Length: set by dfserve"),
    "loadtest framing header": (["loadtest", "run", "--arm", "a=http://127.0.0.1:9", "--concurrency", "1",
                                 "--header", "transfer-encoding: chunked"], "--header transfer-encoding: set by"),
}


@pytest.mark.parametrize("case", list(BAD_INVOCATIONS))
def test_bad_input_is_one_line_naming_what_to_fix_and_exit_2(case: str, tmp_path: Path) -> None:
    argv, expected = BAD_INVOCATIONS[case]
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("arms: [\n")
    itl_gate = tmp_path / "gate.yaml"
    itl_gate.write_text("rules: [{metric: itl_per_token_p95, max_worse: 0.05}]\n")
    files = {"dup_gate": "rules: [{metric: accept_length, max_worse: 0.02}]\nrules: [{metric: error_rate, max_worse: 1}]\n",
             "deep_yaml": "arms: " + "[" * 5000 + "]" * 5000 + "\n",
             "health_yaml": "arms: {a: {weight: 1, replicas: ['http://127.0.0.1:9']}}\nhealth: {path: health}\n"}
    named = {name: tmp_path / f"{name}.yaml" for name in [*files, "latin1_yaml"]}
    for name, text in files.items():
        named[name].write_text(text)
    named["latin1_yaml"].write_bytes("arms: {caf\u00e9: {}}\n".encode("latin-1"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = run(*(a.format(bad_yaml=bad_yaml, taken=port, itl_gate=itl_gate, **named) for a in argv))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("dfserve: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert expected in result.stderr


def test_two_arms_at_one_url_without_pin_arms_are_warned_about_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as closed:  # a port nothing listens on: the run stops at its probes, after the warning
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    arms = ["--arm", f"baseline={url}", "--arm", f"candidate={url}/"]
    common = ["loadtest", "run", *arms, "--concurrency", "1", "--num-requests", "1", "--out", str(tmp_path)]
    warned = run(*common)
    assert warned.returncode == 2
    warning, error = warned.stderr.splitlines()
    assert warning == ("warning: arms baseline, candidate share one URL without --pin-arms, so they get the same "
                       "traffic and compare it with itself; behind a dfserve gateway, add --pin-arms to measure each "
                       "gateway arm")
    assert error.startswith("dfserve: error: --arm: baseline=")
    pinned = run(*common, "--pin-arms")
    assert pinned.returncode == 2 and "warning" not in pinned.stderr
