"""Commands `dfserve loadtest run`, `dfserve loadtest merge`, `dfserve compare`, `dfserve promote` and
`dfserve baseline show|history`.

Each command parses its flags into typed objects and calls one entry point; user mistakes raise `UserError`.
`compare` exits 0 on PASS, 1 on FAIL and 3 on INCONCLUSIVE (2 is left to usage errors); `loadtest run` exits 4 when
an arm failed more requests than `--max-error-rate` allows (its run is kept), 130 when interrupted.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import math
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import cast
from urllib.parse import urlsplit

import click
import uvloop
from click.core import ParameterSource
from pydantic import ValidationError
from rich.console import Console

from dfserve.baselines import BaselineEntry, BaselineRegistry, promote_verdict
from dfserve.capture.replay import CaptureTaskSet
from dfserve.deploy.hashes import file_sha256
from dfserve.errors import Untrusted, UserError, command_flags, flags_for, invalid_field
from dfserve.flags import FINITE, FiniteFloat
from dfserve.headers import is_field_name
from dfserve.http1 import is_base_url
from dfserve.loadtest.config import RunConfig, Sampling, SequentialDesign, shared_servers
from dfserve.loadtest.exporter import Exporter
from dfserve.loadtest.judge import load_gate
from dfserve.loadtest.merge import merge, read_shard
from dfserve.loadtest.progress import Progress
from dfserve.loadtest.records import RequestRecord
from dfserve.loadtest.report import Summary, over_error_rate, read_lag_warning, render_html, summarize
from dfserve.loadtest.routes import ROUTE_FOR
from dfserve.loadtest.runner import Halt, Observer, RunOutcome, RunPlan, execute
from dfserve.loadtest.schedule import LoadShape
from dfserve.loadtest.sequential import SequentialMonitor
from dfserve.loadtest.verdict import compare_runs, unfounded
from dfserve.metrics import ARM_NAME, ARM_NAME_RULE, GENERATION_ROUTES
from dfserve.runs import create_run_dir, new_run_id, run_name, write_atomic, write_model
from dfserve.sglang import Api
from dfserve.shadow.cli import compare_shadow_folder
from dfserve.shadow.verdict import is_shadow_folder
from dfserve.shard import parse_shard, shard_indices
from dfserve.stamped_socket import ReadLag
from dfserve.tasks import load_tasks
from dfserve.terminal import Output, compact_table, terminal_width, wrapped
from dfserve.verdict.printer import print_verdict
from dfserve.verdict.report import REPORT
from dfserve.verdict.verdict import EXIT, Verdict, read_verdict, verdict_file

EXIT_TOO_MANY_ERRORS = 4


def _name(name: str | None) -> str | None:
    """`--name`, checked before any work: a run folder is one name under `--out`."""
    with flags_for({"name": "--name"}):
        return None if name is None else run_name(name)


def _arm(value: str) -> tuple[str, str]:
    """`NAME=URL` of a server's root: under a path such as `/v1` (an OpenAI client's base URL) every request would
    miss (`/v1/v1/chat/completions`), while the probes, which a router may not answer, would not say so."""
    name, sep, url = value.partition("=")
    if not sep or not name or not is_base_url(url):
        raise UserError(f"--arm: {value!r} is not NAME=http://HOST:PORT")
    if not ARM_NAME.fullmatch(name):  # a Prometheus label, a --pin-arms header and a gate's arm, as the gateway's
        raise UserError(f"--arm: {name!r} is not an arm name ({ARM_NAME_RULE}, as the gateway takes them)")
    parts = urlsplit(url)
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise UserError(f"--arm {name}: {url} is not a server's root; give {parts.scheme}://{parts.netloc} (dfserve "
                        "adds /generate, /v1/chat/completions and the rest itself)")
    return name, url


def same_server_warning(arms: Sequence[tuple[str, str]], pin_arms: bool) -> str | None:
    """Two arms at one URL without --pin-arms get the same traffic (behind a dfserve gateway, the same split): the
    run then compares one mix with itself. Warned, not refused: the same server twice is also an A/A test."""
    if pin_arms:
        return None
    shared = shared_servers(arms)
    if not shared:
        return None
    return ("warning: " + "; ".join(f"arms {', '.join(names)}" for names in shared) + " share one URL without "
            "--pin-arms, so they get the same traffic and compare it with itself; behind a dfserve gateway, add "
            "--pin-arms to measure each gateway arm")


_OWN_HEADERS = frozenset({"host", "content-length", "content-type", "accept", "transfer-encoding", "connection",
                          "keep-alive", "te", "upgrade", "expect"})
"""Headers the load tester writes itself or that change how a request is framed: a second Host or Content-Length
makes every request a 400, `Transfer-Encoding: chunked` a hang."""


def request_headers(headers: tuple[str, ...], api_key: str | None) -> tuple[tuple[str, str], ...]:
    """`--header NAME: VALUE` (repeatable) and `--api-key` (SGLang's `--api-key`: `Authorization: Bearer KEY`)."""
    parsed: list[tuple[str, str]] = []
    for header in headers:
        name, sep, value = header.partition(":")
        value = value.strip()
        if not sep or not is_field_name(name):
            raise UserError(f"--header: {header!r} is not NAME: VALUE")
        if not value.isascii() or any(c in value for c in "\r\n\0"):
            raise UserError(f"--header {name}: CR, LF, NUL or a non-ASCII character in the value")
        if name.lower() in _OWN_HEADERS:
            raise UserError(f"--header {name}: set by dfserve on every request, or part of its framing; not given")
        parsed.append((name, value))
    if api_key is not None:
        if any(name.lower() == "authorization" for name, _ in parsed):
            raise UserError("--api-key, --header Authorization: give one")
        if not api_key or not api_key.isascii() or any(c in api_key for c in "\r\n\0 "):
            raise UserError("--api-key: empty, or a space, CR, LF, NUL or a non-ASCII character in it")
        parsed.append(("Authorization", f"Bearer {api_key}"))
    return tuple(parsed)


@click.group()
def loadtest() -> None:
    """Replay coding tasks against every arm at once and record each request."""


@loadtest.command("run")
@click.option("--arm", "arms", multiple=True, required=True, metavar="NAME=URL",
              help="An SGLang server, router or dfserve gateway; repeat for an A/B test (first = baseline). NAME: ASCII "
                   "letters, digits, - and _.")
@click.option("--api", type=click.Choice(list(ROUTE_FOR)), default=None,
              help="native /generate, streamed OpenAI chat or completions; each gives exact acceptance from SGLang "
                   "0.5.23 on (OpenAI through return_spec_tokens_details; estimated from older servers). Default: "
                   "native, or with --tasks capture:DIR each request on the route it was captured on (a capture with "
                   "requests of another route than --api is refused).")
@click.option("--tasks", default="humaneval", show_default=True,
              help="'humaneval', a JSONL file of {id, prompt|messages}, or capture:DIR (captured requests, each with "
                   "its own sampling settings).")
@click.option("--num-requests", type=int, default=400, show_default=True, help="Measured requests per arm.")
@click.option("--warmup", type=int, default=8, show_default=True, help="Requests before them, left out of every figure.")
@click.option("--max-new-tokens", type=int, default=512, show_default=True)
@click.option("--temperature", type=FINITE, default=0.0, show_default=True)
@click.option("--top-p", type=FINITE, default=1.0, show_default=True)
@click.option("--concurrency", type=int, default=None, help="Closed loop: requests in flight per arm; open loop: a cap.")
@click.option("--rate", type=FINITE, default=None, help="Open loop: requests per second per arm.")
@click.option("--arrival", type=click.Choice(["poisson", "constant", "trace"]), default="poisson", show_default=True,
              help="trace: the captured arrival times of --tasks capture:DIR, in order (no --rate).")
@click.option("--speed", type=FINITE, default=None, help="With --arrival trace: replay this many times faster "
              "(default 1).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds task order and Poisson gaps.")
@click.option("--duration", type=FINITE, default=None, help="Stop sending new requests after this many seconds.")
@click.option("--request-timeout", type=FINITE, default=600.0, show_default=True, help="Seconds per request.")
@click.option("--model", default=None, help="Model name for OpenAI bodies (default: the server's first model).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs"), show_default=True)
@click.option("--name", default=None, help="Run directory name (must not exist).")
@click.option("--metrics-port", type=int, default=None, help="Serve live per-arm metrics on 127.0.0.1:PORT (0: a free port, named on stderr); if scraped, the run "
              "ends by waiting for the next scrape to read its last requests (at most a minute; Ctrl-C stops it).")
@click.option("--pushgateway", default=None, metavar="URL", help="Push the final metrics to a Prometheus Pushgateway.")
@click.option("--max-error-rate", type=FiniteFloat(0.0, 1.0), default=0.05, show_default=True,
              help="Exit 4 when any arm's share of failed measured requests is above this (the run is kept).")
@click.option("--pin-arms", is_flag=True,
              help="Send x-dfserve-arm: NAME with every request, so arms behind one dfserve gateway are each measured.")
@click.option("--shard", default=None, metavar="I/N",
              help="Send only shard I (0-based) of N of the schedule, with 1/N of the concurrency; "
              "`dfserve loadtest merge` makes one run of the N shard directories.")
@click.option("--header", "headers", multiple=True, metavar="'NAME: VALUE'",
              help="Send this header with every request to every arm; repeatable (names are recorded, values not).")
@click.option("--api-key", envvar="DFSERVE_API_KEY", default=None, show_envvar=True,
              help="The arms' API key (SGLang's --api-key): sent as Authorization: Bearer KEY.")
@click.option("--quiet", is_flag=True, help="No live table.")
@click.option("--until-decided", is_flag=True,
              help="Stop sending once the gate is decided on always-valid intervals, looked at after every batch of "
                   "pairs; --num-requests is then the maximum. Two arms: baseline, candidate.")
@click.option("--gate", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="With --until-decided: the gate file to decide, as for compare, e.g. "
                   "`rules: [{metric: accept_length, max_worse: 0.02}]` (default: the default gate).")
@click.option("--look-every", type=int, default=None, help="With --until-decided: pairs between looks (default 16).")
@click.option("--force", is_flag=True, help="Replay a capture that lost requests between those it holds, or holds "
              "some that cannot be replayed as one (left out): recorded in the run's config.json, and a verdict on "
              "the run says so.")
def run_command(arms: tuple[str, ...], api: str, tasks: str, num_requests: int, warmup: int, max_new_tokens: int,
                temperature: float, top_p: float, concurrency: int | None, rate: float | None, arrival: str,
                speed: float | None, seed: int, duration: float | None, request_timeout: float, model: str | None, out: Path,
                name: str | None, metrics_port: int | None, pushgateway: str | None, max_error_rate: float,
                pin_arms: bool, shard: str | None, headers: tuple[str, ...], api_key: str | None, quiet: bool,
                until_decided: bool, gate: Path | None, look_every: int | None, force: bool) -> None:
    """Run one load test; every arm gets the identical schedule. Ctrl-C stops and keeps what was recorded."""
    trace = arrival == "trace"
    if concurrency is None and rate is None and not trace:
        raise UserError("--concurrency or --rate: give one (closed loop or open loop)")
    if rate is None and not trace and click.get_current_context().get_parameter_source("arrival") is not ParameterSource.DEFAULT:
        raise UserError(f"--arrival {arrival}: an open loop's arrivals; give --rate")
    if math.isnan(max_error_rate):
        raise UserError("--max-error-rate: must be a number from 0 to 1")
    if pushgateway is not None and not is_base_url(pushgateway if "://" in pushgateway else "http://" + pushgateway):
        raise UserError(f"--pushgateway: {pushgateway!r} is not http(s)://HOST:PORT")
    if metrics_port is not None and not 0 <= metrics_port <= 65535:
        raise UserError(f"--metrics-port: {metrics_port} is not a port (0 to 65535)")
    flags = command_flags(run_command) | {"duration_s": "--duration", "request_timeout_s": "--request-timeout",
                                          "sequential": "--until-decided"}
    with flags_for(flags):
        try:
            load = LoadShape(kind=arrival if trace or rate is not None else "closed", concurrency=concurrency,
                             rate=rate, speed=1.0 if trace and speed is None else speed, seed=seed)
            sampling = Sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        except ValidationError as exc:
            raise invalid_field(exc) from None
        task_set = load_tasks(tasks)
        if force and not isinstance(task_set, CaptureTaskSet):
            raise UserError("--force: only with --tasks capture:DIR (it replays a capture that lost requests)")
        if task_set.incomplete is not None and not force:
            raise UserError(f"--tasks {tasks}: {task_set.incomplete}: a replay of it is not the traffic captured; "
                            "--force replays what it holds, recorded in the run's config.json")
        notes = []  # said once the run is known to go ahead: a refusal is one line
        if isinstance(task_set, CaptureTaskSet):  # its own settings; the flags fill what a request did not set
            if task_set.shortened is not None:
                notes.append(f"note: --tasks {tasks}: {task_set.shortened}")
            if unset := task_set.unset():
                filled = ", ".join(f"{n} no {key} (sent with --{key.replace('_', '-')} {getattr(sampling, key):g})"
                                   for key, n in sorted(unset.items()))
                notes.append(f"note: --tasks {tasks}: of its {len(task_set.tasks)} requests, {filled}: the run's "
                             "flags, not the server's defaults")
            task_set, sampling = task_set.for_run(sampling)
        plan = RunPlan(arms=tuple(_arm(a) for a in arms), api=cast("Api | None", api),
                       task_set=task_set, num_requests=num_requests, warmup=warmup, sampling=sampling,
                       load=load, out=out, name=_name(name), duration_s=duration, request_timeout_s=request_timeout,
                       model=model, pin_arms=pin_arms, sequential=_design(until_decided, gate, look_every),
                       shard=None if shard is None else parse_shard(shard), headers=request_headers(headers, api_key))
        monitor = (SequentialMonitor(plan.sequential, plan.arms[0][0], plan.arms[1][0], plan.sampling.temperature,
                                     len(plan.task_set.tasks), warmup, plan.sampling.mixes_greedy)
                   if plan.sequential else None)
    if (warning := same_server_warning(plan.arms, pin_arms)) is not None:
        click.echo(wrapped(warning, terminal_width(stderr=True)), err=True)
    exporter = Exporter(route=plan.default_api)
    for arm, _ in plan.arms:
        exporter.metrics.start(arm, (plan.api,) if plan.api else GENERATION_ROUTES, ("",))
    if metrics_port is not None:
        with flags_for(flags):
            click.echo(f"dfserve loadtest metrics: listening on {exporter.serve(metrics_port)}", err=True)
    indices = shard_indices(num_requests + warmup, plan.shard)
    progress = Progress([n for n, _ in plan.arms], sum(i >= warmup for i in indices), Console(stderr=True, quiet=quiet),
                        monitor, warmup=sum(i < warmup for i in indices), duration_s=duration)
    gc.collect()
    gc.freeze()  # keep full collections off the imported heap: their pauses would show up as latency
    try:
        with progress, flags_for(flags):
            observers = [exporter.observe, progress.observe, *([monitor.observe] if monitor else [])]
            outcome = uvloop.run(_until_signal(plan, observers, (lambda: monitor.stopped) if monitor else None,
                                               functools.partial(_say, notes)))
        if outcome.records_lost:
            _refuse_lost(outcome)
        summary = _finish_run(outcome.run_dir, outcome.config, outcome.records, outcome.interrupted, outcome.read_lag)
        if monitor:
            _print_sequential(monitor, outcome.interrupted)
        if pushgateway:
            with flags_for(flags):
                exporter.push(pushgateway, outcome.config.run_id)
        if not outcome.interrupted:
            exporter.linger(lambda line: click.echo(line, err=True))  # the run's files are all written
    finally:
        exporter.close()
    if outcome.interrupted:
        click.echo("interrupted: partial run kept", err=True)
        sys.exit(130)
    failing = over_error_rate(summary, max_error_rate)
    if failing:
        click.echo(f"errors over --max-error-rate {max_error_rate:g}: " + "; ".join(
            f"{a.arm} failed {sum(a.errors.values())} of {a.requests - a.cancelled} ({a.error_rate:.1%}: "
            + ", ".join(f"{kind}={count}" for kind, count in a.errors.items()) + ")" for a in failing)
            + f"; run kept: {outcome.run_dir}", err=True)
        sys.exit(EXIT_TOO_MANY_ERRORS)


def _refuse_lost(outcome: RunOutcome) -> None:
    """A run whose records could not all be written: kept as interrupted where its summary can still be written,
    one line either way."""
    try:
        _finish_run(outcome.run_dir, outcome.config, outcome.records, True, outcome.read_lag)
        kept = f"run kept, marked interrupted: {outcome.run_dir}"
    except OSError as exc:
        kept = (f"its summary and report could not be written either ({exc.strerror}): {outcome.run_dir} is "
                "incomplete")
    raise UserError(f"{outcome.records_lost}; {kept}")


def _design(until_decided: bool, gate: Path | None, look_every: int | None) -> SequentialDesign | None:
    if not until_decided:
        if gate is not None or look_every is not None:
            raise UserError("--gate, --look-every: only with --until-decided (dfserve compare --gate judges a run)")
        return None
    try:
        return SequentialDesign(gate=load_gate(gate), **({"look_every": look_every} if look_every is not None else {}))
    except ValidationError as exc:
        raise UserError(f"--look-every: {exc.errors()[0]['msg']}") from None


def _print_sequential(monitor: SequentialMonitor, interrupted: bool = False) -> None:
    """The live decision's last word; `interrupted`: the run was stopped before its end (an undecided look is then
    the stop's, not the run's end)."""
    look = monitor.decision or monitor.latest
    if look is None:
        click.echo(f"until decided: no look yet ({monitor.pairs} pairs, a look every {monitor.design.look_every})")
        return
    why = {"decided": "decided", "task_set": "undecided, limited by the task set",
           None: "undecided when the run was stopped" if interrupted else "undecided at the end"}
    width = terminal_width()
    click.echo(wrapped(f"until decided: {look.verdict} at look {look.number}, after {look.pairs} paired requests "
                       f"({why[look.stop]}); {monitor.pairs} pairs finished in all. `dfserve compare` writes the "
                       "verdict.", width))
    for rule in look.rules:
        click.echo(wrapped(f"  {rule.status:<14} {rule.metric}: {rule.detail}", width, indent=17))




@loadtest.command("merge")
@click.argument("shards", nargs=-1, required=True, type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Where the merged run directory goes (default: beside the first shard).")
@click.option("--name", default=None, help="Merged run directory name (must not exist).")
@click.option("--force", is_flag=True, help="Merge shards that lost records (cut, missing lines, no summary.json), "
              "were not started together, or whose arms reached other servers; the merged run is marked interrupted, "
              "so it is judged only as an incomplete run.")
def merge_command(shards: tuple[Path, ...], out: Path | None, name: str | None, force: bool) -> None:
    """Build one run from every shard of a `loadtest run --shard I/N` run; refuses a set that is not whole, or a
    shard whose records do not match its summary and schedule."""
    try:
        with flags_for({"shards": "SHARDS", "shard": "--shard"}):
            merged = merge([read_shard(path) for path in shards], _name(name) or new_run_id(), force)
    except Untrusted as exc:
        raise UserError(f"{exc}; --force merges what the shards hold, marked interrupted") from None
    for lost in merged.incomplete:
        click.echo(f"forced: {lost}", err=True)
    with flags_for({"name": "--name"}):
        run_dir = create_run_dir(out or shards[0].parent, merged.config.run_id)
    write_model(run_dir / "config.json", merged.config)
    write_atomic(run_dir / "requests.jsonl", "".join(r.model_dump_json() + "\n" for r in merged.records))
    _finish_run(run_dir, merged.config, merged.records, merged.interrupted, merged.read_lag)
    if merged.interrupted:
        click.echo("interrupted: " + ("shards merged by --force" if merged.incomplete
                                      else "a shard stopped early"), err=True)


def _finish_run(run_dir: Path, config: RunConfig, records: list[RequestRecord], interrupted: bool,
                read_lag: Mapping[str, ReadLag]) -> Summary:
    """Write the summary and report of a run (`interrupted` when its records may not all be there), and print the
    summary."""
    summary = summarize(config, records, interrupted, read_lag).model_copy(
        update={"records_sha256": file_sha256(run_dir / "requests.jsonl"),
                "config_sha256": file_sha256(run_dir / "config.json")}).sealed()
    write_model(run_dir / "summary.json", summary)
    write_atomic(run_dir / "report.html", render_html(config, summary, records))
    _print_summary(config, summary)
    for arm, fidelity in summary.schedule_fidelity.items():
        click.echo(f"schedule fidelity, {arm}: {fidelity.describe()}")
    warning = read_lag_warning(summary)
    if warning is not None:
        click.echo(wrapped(warning, terminal_width(stderr=True)), err=True)
    click.echo(f"run: {run_dir}")
    return summary


def _say(notes: Sequence[str]) -> None:
    for note in notes:
        click.echo(note, err=True)


async def _until_signal(plan: RunPlan, observers: list[Observer], halt: Halt | None = None,
                        going_ahead: Callable[[], None] | None = None) -> RunOutcome:
    """Run the plan; the first SIGINT/SIGTERM stops it cleanly, a second one is not caught."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)

    def on_signal() -> None:
        stop.set()
        for sig in signals:
            loop.remove_signal_handler(sig)

    for sig in signals:
        loop.add_signal_handler(sig, on_signal)
    try:
        return await execute(plan, observers, stop, halt, going_ahead)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def _print_summary(config: RunConfig, summary: Summary) -> None:
    table = compact_table(f"run {config.run_id}" + (" (SIMULATED engines)" if any(a.simulated for a in config.arms) else ""),
                          {"arm": False, "ok/all": True, "errors": False, "τ [95% CI]": True, "TTFT ms\np50/p99": True,
                           "TPOT ms\np50/p95": True, "out\ntok/s": True})
    for a in summary.arms:
        tau = (f"{a.accept_length.estimate:.2f} [{a.accept_length.low:.2f}, {a.accept_length.high:.2f}]"
               f"{'' if a.acceptance == 'exact' else ' est.'}" if a.accept_length else "unknown")
        ttft = f"{a.ttft_s.p50.estimate * 1e3:.1f}/{a.ttft_s.p99.estimate * 1e3:.1f}" if a.ttft_s else "-"
        tpot = f"{a.tpot_s.p50.estimate * 1e3:.2f}/{a.tpot_s.p95.estimate * 1e3:.2f}" if a.tpot_s else "-"
        errors = (", ".join(f"{k}={v}" for k, v in a.errors.items()) or "0") + (
            f", {a.cancelled} cancelled" if a.cancelled else "")
        rate = f"{a.output_tokens_per_s:.0f}" if a.output_tokens_per_s else "-"
        table.add_row(a.arm, f"{a.succeeded}/{a.requests}", errors, tau, ttft, tpot, rate)
    Output().print(table)


@click.command()
@click.argument("run", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.argument("run2", type=click.Path(path_type=Path, exists=True, file_okay=False), required=False)
@click.option("--baseline", default=None, help="Baseline arm (default: the first arm / RUN's arm).")
@click.option("--candidate", default=None, help="Candidate arm (default: the second arm / RUN2's arm).")
@click.option("--gate", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="A YAML gate file, a top-level `rules:` list, e.g. `rules: [{metric: accept_length, max_worse: "
                   "0.02}, {metric: lossless_fraction, at_least: 0.99}]` (at_least for lossless_fraction, max_worse "
                   "for the others); the defaults are shown in the verdict.")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Where the verdict directory goes "
              "(default: beside RUN).")
@click.option("--force", is_flag=True, help="Compare runs that differ in tasks, sampling or load, or a run that is "
              "incomplete (interrupted, killed, records missing); stamped in the verdict.")
def compare(run: Path, run2: Path | None, baseline: str | None, candidate: str | None, gate: Path | None,
            out: Path | None, force: bool) -> None:
    """Judge a candidate against a baseline (two arms of RUN, or RUN vs RUN2). Exit 0 PASS, 1 FAIL, 3 INCONCLUSIVE.

    Refused: a run against itself; unless --force (then stamped in the verdict): runs that differ, and a run that
    was interrupted, killed or lost records."""
    paths = [run] if run2 is None else [run, run2]
    for flag, arm in (("--baseline", baseline), ("--candidate", candidate)):
        if arm is not None and not arm.strip():
            raise UserError(f"{flag}: give an arm's name (it is empty)")
    if run2 is None and is_shadow_folder(run):
        compare_shadow_folder(run, baseline, candidate, gate, force, out, command_flags(compare))
    shadow = next((path for path in paths if is_shadow_folder(path)), None)
    if shadow is not None:
        raise UserError(f"{shadow} is a shadow record folder: it holds both arms and is judged alone "
                        "(dfserve compare DIR)")
    try:
        with flags_for(command_flags(compare)):
            verdict, path = compare_runs(paths, baseline, candidate, gate, force, out)
    except Untrusted as exc:
        raise UserError(f"{exc}; --force judges anyway, stamped in the verdict") from None
    print_verdict(Output(), verdict)
    _print_offline(verdict, BaselineRegistry(run.parent))
    click.echo(f"verdict: {path}")
    click.echo(f"report:  {path.parent / REPORT}")
    sys.exit(EXIT[verdict.verdict])


def _print_offline(verdict: Verdict, registry: BaselineRegistry) -> None:
    """Each drafter's offline τ (`dfserve eval`, recorded in the registry) beside its online τ, where both exist. A
    registry that cannot be read is said in one line: the verdict is written, and its exit status stands."""
    online = next(m for m in verdict.judgement.metrics if m.metric == "accept_length")
    lines = []
    for side, value in ((verdict.baseline, online.baseline), (verdict.candidate, online.candidate)):
        try:
            score = registry.offline(side.drafter)
        except UserError as exc:
            click.echo(f"offline acceptance not shown: {exc}", err=True)
            return
        if score is not None and value is not None:
            lines.append(f"  {side.name} ({side.drafter}): online {value:.3f}, offline {score.tau_as_sglang:.3f} "
                         f"(eval run {score.run_id}, {score.tasks} tasks, features {score.features})")
    if lines:
        click.echo("acceptance length offline (dfserve eval, counted as SGLang does) beside online:\n" + "\n".join(lines))


@click.command()
@click.argument("verdict_path", metavar="VERDICT", type=click.Path(path_type=Path, exists=True))
@click.option("--registry", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Directory of baselines.json (default: the directory holding the verdict, beside the runs).")
@click.option("--force", is_flag=True, help="Promote without a PASS, a matching baseline or an unforced verdict; "
              "needs --reason.")
@click.option("--reason", default=None, help="Why a forced promotion is right; recorded.")
def promote(verdict_path: Path, registry: Path | None, force: bool, reason: str | None) -> None:
    """Record the candidate of a PASS verdict as the new baseline of its target (history kept). A verdict is
    promoted once; an offline one, or one that judged a drafter against itself, never; a forced one, one of
    simulated engines or of a run that was not whole only with --force."""
    file = verdict_file(verdict_path).resolve()
    try:
        with flags_for(command_flags(promote)):
            verdict = read_verdict(file)
            promotion = promote_verdict(BaselineRegistry(registry or file.parent.parent), verdict, file,
                                        force=force, reason=reason, unfounded=unfounded(verdict))
    except Untrusted as exc:
        raise UserError(f"{exc} (--force --reason TEXT overrides)") from None
    cand = promotion.candidate
    click.echo(f"baseline of {cand.target}: {cand.drafter} (run {cand.run_id}, arm {cand.arm})"
               + (" FORCED: " + "; ".join(promotion.refusals) if promotion.refusals else ""))


@click.group()
def baseline() -> None:
    """Read the baseline registry."""


_registry_option = click.option("--registry", type=click.Path(path_type=Path, file_okay=False), default=Path("runs"),
                                show_default=True, help="Directory of baselines.json.")


@baseline.command("show")
@_registry_option
@click.option("--target", default=None, help="Only this target.")
def baseline_show(registry: Path, target: str | None) -> None:
    """The current baseline of each target."""
    store = BaselineRegistry(registry)
    targets = sorted({e.target for e in _recorded(store, target)})
    for name in targets:
        current = store.current(name)
        assert current is not None
        click.echo(f"{name}: {current.drafter} (run {current.run_id}, arm {current.arm}, since {current.recorded_at}"
                   + (", FORCED" if current.forced else "") + ")")


def _recorded(store: BaselineRegistry, target: str | None) -> list[BaselineEntry]:
    """The registry's changes of baseline (of `target`, where named); a registry with none is refused: a mistyped
    --registry or --target would list nothing and succeed."""
    entries = store.history(target)
    if not entries:
        raise UserError(f"--registry: no baseline recorded in {store.path}" + (f" for {target}" if target else "")
                        + " (`dfserve promote` records one; --registry names another folder than runs/)")
    return entries


@baseline.command("history")
@_registry_option
@click.option("--target", default=None, help="Only this target.")
def baseline_history(registry: Path, target: str | None) -> None:
    """Every change of baseline, oldest first."""
    for e in _recorded(BaselineRegistry(registry), target):
        click.echo(f"{e.recorded_at}  {e.target}: {e.drafter}  run {e.run_id} arm {e.arm}"
                   + (f"  verdict {e.verdict}" if e.verdict else "")
                   + (f"  FORCED ({e.reason})" if e.forced else ""))
