"""`dfserve demo`: the main job end to end on simulated engines, with the real commands a user would run.

Online (the default), it deploys two simulated engines with `dfserve deploy --engine sim` (baseline: the z-lab drafter's profile;
candidate: the in-house profile), puts `dfserve gateway` in front of them, runs a paired A/B `dfserve loadtest run`
of HumanEval tasks through the gateway (each request pinned to its arm by the gateway's arm header), and prints
`dfserve compare`'s table and verdict. Every process it started is stopped on the way out, on Ctrl-C and on error.

With `--offline` it builds tiny real models once (`dfserve.eval.tiny`: a random-weight Qwen3 target, a DFlash
drafter distilled from it and the same drafter undertrained) and runs `dfserve eval run` on them: offline
evaluation, its table and its verdict, on a CPU, in about a minute the first time.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from dfserve.errors import FieldError, UserError, command_flags, flags_for
from dfserve.flags import FINITE
from dfserve.listen import wait_healthy, wait_listening
from dfserve.runs import new_run_id
from dfserve.terminal import terminal_width, wrapped

LOOPBACK = "127.0.0.1"
HEALTHY_AT = re.compile(r": healthy at (http://\S+) after")
"""How `dfserve deploy` says where the engine it started listens (its port is chosen by the engine: --port 0)."""
ARMS = (("baseline", "zlab"), ("candidate", "sim:inhouse"))
"""(arm name, drafter): the z-lab drafter is the baseline; the candidate is the simulator's undertrained in-house
profile, deployed under a simulated identity so that no record mistakes it for a real checkpoint."""
ONLINE_ONLY = ("num_requests", "concurrency", "max_new_tokens", "time_scale", "seed", "keep_running")
"""Options of the simulated A/B run that `--offline` has no use for (refused there, never ignored)."""


def _dfserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "dfserve", *args]


def _say(message: str, **style: Any) -> None:
    """One of the demo's own lines, broken between words on a terminal."""
    click.secho(wrapped(message, terminal_width()), **(style or {"fg": "cyan", "bold": True}))


class Stack:
    """The processes of one demo, stopped in reverse order whatever happens."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.deployments: list[str] = []
        self.gateway: subprocess.Popen[bytes] | None = None

    def deploy(self, name: str, drafter: str, time_scale: float, seed: int) -> str:
        argv = _dfserve(
            "deploy", "--drafter", drafter, "--engine", "sim", "--name", name,
            "--host", LOOPBACK, "--port", "0", "--root", str(self.root / "deployments"),
            "--time-scale", str(time_scale), "--seed", str(seed), "--health-timeout", "60",
        )
        result = subprocess.run(argv, capture_output=True, text=True)
        if result.returncode != 0:
            raise UserError(f"deploying {name} failed: {result.stderr.strip().splitlines()[-1:]}")
        self.deployments.append(name)
        click.echo(result.stdout.strip())
        healthy = HEALTHY_AT.search(result.stdout)
        if healthy is None:
            raise UserError(f"deploying {name}: no address in its output {result.stdout.strip()!r}")
        return healthy.group(1)

    def start_gateway(self, upstreams: dict[str, str]) -> str:
        arms = [f"--arm={name}=50@{url}" for name, url in upstreams.items()]
        log = self.root / "gateway.log"
        argv = _dfserve("gateway", "--host", LOOPBACK, "--port", "0", "--scrape-interval", "2", *arms)
        with log.open("wb") as out:
            self.gateway = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        (self.root / "gateway.pid").write_text(f"{self.gateway.pid}\n")
        try:
            url = wait_listening(log, self.gateway.poll, 30.0)
        except RuntimeError as exc:
            raise UserError(f"the gateway {exc}") from None
        failure = wait_healthy(f"{url}/health", self.gateway, 30.0)
        if failure is not None:
            raise UserError(f"the gateway {failure}; see {log}")
        click.echo(f"gateway: {url} (arms {', '.join(upstreams)}; log {log})")
        return url

    def stop(self) -> None:
        if self.gateway is not None and self.gateway.poll() is None:
            os.killpg(self.gateway.pid, signal.SIGTERM)
            try:
                self.gateway.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.gateway.pid, signal.SIGKILL)
                self.gateway.wait()
        for name in reversed(self.deployments):
            subprocess.run(_dfserve("deploy", "stop", name, "--root", str(self.root / "deployments")),
                           capture_output=True, text=True)
        self.deployments.clear()


@contextlib.contextmanager
def _terminated_by_signals() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C, so the `finally` that stops the stack runs either way."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _newest_run(out: Path, before: set[Path]) -> Path:
    created = [p for p in out.iterdir() if p.is_dir() and p not in before and p.name.startswith("run-")]
    if len(created) != 1:
        raise FieldError("out", f"expected one new run directory in {out}, found {len(created)}")
    return created[0]


def _default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dfserve"


def check_options(offline: bool, given: Sequence[str], cache: Path | None, counts: Mapping[str, int]) -> None:
    """Options of one mode given to the other (`given`: the fields set on the command line) are refused, never
    ignored; a count below 1 is no run."""
    if offline:
        if given:
            raise FieldError(given[0], "not an option of {other} (it runs `dfserve eval`, no load test)",
                             other="offline")
        return
    if cache is not None:
        raise FieldError("cache", "only {other} keeps models; the simulated demo has none", other="offline")
    for field, count in counts.items():
        if count < 1:
            raise FieldError(field, "must be at least 1")


@click.command()
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=Path("runs"), show_default=True,
              help="Where the run and verdict directories go (never overwritten).")
@click.option("--num-requests", type=int, default=128, show_default=True, help="Measured requests per arm.")
@click.option("--concurrency", type=int, default=16, show_default=True, help="Requests in flight per arm.")
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@click.option("--time-scale", type=FINITE, default=1.0, show_default=True,
              help="Multiplies the modelled Pro6000's latencies: 1 = real time, 0.2 = five times faster, "
                   "2 = twice as slow.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--keep-running", is_flag=True, help="Leave the stack up after the verdict until Ctrl-C.")
@click.option("--offline", is_flag=True,
              help="Offline evaluation instead: tiny real models (built once, cached), `dfserve eval run` on a "
                   "well-distilled and an undertrained drafter, and its verdict. Needs the eval extra: "
                   "pip install 'dfserve[eval]'.")
@click.option("--cache", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="With --offline: where the tiny models and their feature cache are kept  "
                   "[default: $XDG_CACHE_HOME/dfserve or ~/.cache/dfserve].")
@click.pass_context
def demo(ctx: click.Context, out: Path, num_requests: int, concurrency: int, max_new_tokens: int, time_scale: float,
         seed: int, keep_running: bool, offline: bool, cache: Path | None) -> None:
    """Run a whole A/B judgement on simulated engines, end to end. All numbers are SIMULATED.

    With --offline: offline evaluation on tiny real models, on this CPU (about a minute the first time)."""
    given = [name for name in ONLINE_ONLY if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
    with flags_for(command_flags(ctx.command)):
        check_options(offline, given, cache,
                      {"num_requests": num_requests, "concurrency": concurrency, "max_new_tokens": max_new_tokens})
    if offline:
        _offline(out, cache or _default_cache())
        return
    out.mkdir(parents=True, exist_ok=True)
    stack = Stack(out.resolve() / "demo")
    stack.root.mkdir(exist_ok=True)
    _say("dfserve demo: every engine here is SIMULATED (dfserve sim); no GPU, no model weights.", fg="yellow")
    with _terminated_by_signals():
        try:
            _say("1/4 deploy: two simulated Qwen3.6-27B engines, z-lab drafter (baseline) and in-house (candidate)")
            upstreams = {arm: stack.deploy(f"demo-{arm}", drafter, time_scale, seed)
                         for arm, drafter in ARMS}
            _say("2/4 gateway: one endpoint in front of both arms")
            gateway = stack.start_gateway(upstreams)
            _say(f"3/4 loadtest: {num_requests} HumanEval requests per arm, paired, {concurrency} in flight per arm")
            before = set(out.iterdir())
            loadtest = subprocess.run(_dfserve(
                "loadtest", "run", *(f"--arm={arm}={gateway}" for arm, _ in ARMS), "--tasks", "humaneval",
                "--num-requests", str(num_requests), "--concurrency", str(concurrency),
                "--max-new-tokens", str(max_new_tokens), "--seed", str(seed), "--out", str(out), "--pin-arms", "--quiet",
            ))
            if loadtest.returncode != 0:
                raise UserError(f"the load test failed (exit {loadtest.returncode})")
            with flags_for({"out": "--out"}):
                run = _newest_run(out, before)
            _say("4/4 compare: candidate vs baseline, paired by task, with the default gate")
            verdict = subprocess.run(_dfserve("compare", str(run), "--baseline", "baseline", "--candidate", "candidate"))
            if verdict.returncode not in (0, 1, 3):
                raise UserError(f"compare failed (exit {verdict.returncode})")
            click.echo("")
            click.echo(wrapped(f"run folder:  {run}  (config.json, requests.jsonl, summary.json)", terminal_width(),
                               indent=13))
            click.echo(f"report:      {run / 'report.html'}")
            if keep_running:
                click.echo(wrapped(f"metrics:     {gateway}/metrics (gateway, per arm); "
                                   + "; ".join(f"{u}/metrics ({a} engine)" for a, u in upstreams.items()),
                                   terminal_width(), indent=13))
            else:
                click.echo("metrics:     the gateway's and engines' /metrics stop with the demo; dfserve demo "
                           "--keep-running keeps them up")
            _say("These numbers are SIMULATED: they show the workflow, not a drafter's real quality.", fg="yellow")
            if keep_running:
                _print_scrape_config(gateway, upstreams)
                click.echo("The stack stays up; press Ctrl-C to stop it.")
                while True:
                    time.sleep(3600)
        except KeyboardInterrupt:
            click.echo("\ninterrupted: stopping the demo stack", err=True)
            raise click.exceptions.Exit(130) from None
        finally:
            stack.stop()


def _offline(out: Path, cache: Path) -> None:
    """Tiny models from the cache (built the first time), then `dfserve eval run` on them, as a user would run it."""
    from dfserve.eval.cli import require_packages

    require_packages("dfserve demo --offline")
    from dfserve.eval.tiny import DEMO_TASKS, build_demo

    _say("dfserve demo --offline: tiny REAL models on this CPU (a random-weight Qwen3 target and DFlash drafters "
         "distilled from it); no GPU, no downloaded weights.", fg="yellow")
    _say("1/2 models: a tiny target, a well-distilled drafter (baseline) and an undertrained one (candidate)")
    started = time.monotonic()
    models = build_demo(cache)
    click.echo(f"{'built' if models.built else 'reused'}: {models.folder}"
               + (f" ({time.monotonic() - started:.0f} s; reused next time)" if models.built else ""))
    _say(f"2/2 eval: dfserve eval run on {DEMO_TASKS} HumanEval prompts, the undertrained drafter judged against "
         "the distilled one")
    run = out.resolve() / new_run_id("eval")
    evaluation = subprocess.run(_dfserve(
        "eval", "run", "--target", str(models.target), "--drafter", f"distilled={models.distilled}",
        "--drafter", f"undertrained={models.undertrained}", "--tasks", str(models.tasks),
        "--num-tasks", str(DEMO_TASKS), "--max-new-tokens", "40", "--ddtree-budgets", "2,4", "--threads", "1",
        "--cache", str(models.folder / "eval-cache"), "--drafter-store", str(cache / "drafters"),
        "--registry", str(out.resolve() / "demo"), "--out", str(run.parent), "--name", run.name,
    ))
    if evaluation.returncode == 130:
        raise click.exceptions.Exit(130)
    if evaluation.returncode != 0:
        raise UserError(f"the evaluation failed (exit {evaluation.returncode})")
    click.echo("")
    click.echo(wrapped(f"run folder:  {run}  (config.json, anchors.jsonl, summary.json)", terminal_width(), indent=13))
    click.echo(f"report:      {run / 'report.html'}")
    _say("These models are tiny and random: the numbers show offline evaluation working, not a drafter's quality.",
         fg="yellow")


def _print_scrape_config(gateway: str, upstreams: dict[str, str]) -> None:
    """A Prometheus scrape config for the running stack, to paste into prometheus.yml."""
    engines = ", ".join(f"'{u.removeprefix('http://')}'" for u in upstreams.values())
    click.echo(
        "\nPrometheus scrape config for this stack:\n"
        "scrape_configs:\n"
        "  - job_name: dfserve_gateway\n"
        "    scrape_interval: 5s\n"
        f"    static_configs: [{{targets: ['{gateway.removeprefix('http://')}']}}]\n"
        "  - job_name: sglang\n"
        "    scrape_interval: 5s\n"
        f"    static_configs: [{{targets: [{engines}]}}]\n"
    )
