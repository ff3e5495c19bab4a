"""Commands `dfserve loadtest run`, `dfserve loadtest merge`, `dfserve compare`, `dfserve promote` and
`dfserve baseline show|history`.

Each command parses its flags into typed objects and calls one entry point; user mistakes raise `UserError`.
`compare` exits 0 on PASS, 1 on FAIL and 3 on INCONCLUSIVE (2 is left to usage errors); `loadtest run` exits 4 when
an arm failed more requests than `--max-error-rate` allows (its run is kept), 130 when interrupted.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import click
import uvloop
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from dfserve.baselines import BaselineRegistry, entry
from dfserve.errors import UserError
from dfserve.http1 import is_base_url
from dfserve.loadtest.config import RunConfig, Sampling, SequentialDesign, read_config
from dfserve.loadtest.exporter import Exporter
from dfserve.loadtest.judge import comparability, judge, load_gate
from dfserve.loadtest.merge import merge, read_shard
from dfserve.loadtest.progress import Progress
from dfserve.loadtest.records import RequestRecord, read_records
from dfserve.loadtest.report import Summary, over_error_rate, read_lag_warning, render_html, summarize
from dfserve.loadtest.runner import Halt, Observer, RunOutcome, RunPlan, execute
from dfserve.loadtest.schedule import LoadShape
from dfserve.loadtest.sequential import SequentialMonitor, judge_sequential
from dfserve.loadtest.shard import parse_shard, shard_indices
from dfserve.loadtest.tasks import load_tasks
from dfserve.loadtest.verdict import FILENAME, Verdict, arm_ref, read_verdict
from dfserve.runs import Provenance, create_run_dir, new_run_id, write_atomic, write_model
from dfserve.stamped_socket import ReadLag
from dfserve.terminal import compact_table, terminal_width, wrapped

EXIT = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}
EXIT_TOO_MANY_ERRORS = 4


def _arm(value: str) -> tuple[str, str]:
    """`NAME=URL` of a server's root: under a path such as `/v1` (an OpenAI client's base URL) every request would
    miss (`/v1/v1/chat/completions`), while the probes, which a router may not answer, would not say so."""
    name, sep, url = value.partition("=")
    if not sep or not name or not is_base_url(url):
        raise UserError(f"--arm: {value!r} is not NAME=http://HOST:PORT")
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
    by_server: dict[tuple[str, str, int | None], list[str]] = {}
    for name, url in arms:
        parts = urlsplit(url)
        by_server.setdefault((parts.scheme, parts.hostname or "", parts.port), []).append(name)
    shared = [names for names in by_server.values() if len(names) > 1]
    if not shared:
        return None
    return ("warning: " + "; ".join(f"arms {', '.join(names)}" for names in shared) + " share one URL without "
            "--pin-arms, so they get the same traffic and compare it with itself; behind a dfserve gateway, add "
            "--pin-arms to measure each gateway arm")


_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def request_headers(headers: tuple[str, ...], api_key: str | None) -> tuple[tuple[str, str], ...]:
    """`--header NAME: VALUE` (repeatable) and `--api-key` (SGLang's `--api-key`: `Authorization: Bearer KEY`)."""
    parsed: list[tuple[str, str]] = []
    for header in headers:
        name, sep, value = header.partition(":")
        value = value.strip()
        if not sep or not name or not set(name) <= _TOKEN:
            raise UserError(f"--header: {header!r} is not NAME: VALUE")
        if not value.isascii() or any(c in value for c in "\r\n\0"):
            raise UserError(f"--header {name}: CR, LF, NUL or a non-ASCII character in the value")
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
              help="An SGLang server, router or dfserve gateway; repeat for an A/B test (first = baseline).")
@click.option("--api", type=click.Choice(["native", "chat"]), default="native", show_default=True,
              help="native /generate or streamed OpenAI chat; both give exact acceptance from SGLang 0.5.23 on "
                   "(chat through return_spec_tokens_details; estimated from older servers).")
@click.option("--tasks", default="humaneval", show_default=True, help="'humaneval' or a JSONL file of {id, prompt|messages}.")
@click.option("--num-requests", type=int, default=400, show_default=True, help="Measured requests per arm.")
@click.option("--warmup", type=int, default=8, show_default=True, help="Requests before them, left out of every figure.")
@click.option("--max-new-tokens", type=int, default=512, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--concurrency", type=int, default=None, help="Closed loop: requests in flight per arm; open loop: a cap.")
@click.option("--rate", type=float, default=None, help="Open loop: requests per second per arm.")
@click.option("--arrival", type=click.Choice(["poisson", "constant"]), default="poisson", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds task order and Poisson gaps.")
@click.option("--duration", type=float, default=None, help="Stop sending new requests after this many seconds.")
@click.option("--request-timeout", type=float, default=600.0, show_default=True, help="Seconds per request.")
@click.option("--model", default=None, help="Model name for OpenAI bodies (default: the server's first model).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs"), show_default=True)
@click.option("--name", default=None, help="Run directory name (must not exist).")
@click.option("--metrics-port", type=int, default=None, help="Serve live per-arm metrics on 127.0.0.1:PORT (0: a free port, named on stderr).")
@click.option("--pushgateway", default=None, metavar="URL", help="Push the final metrics to a Prometheus Pushgateway.")
@click.option("--max-error-rate", type=click.FloatRange(0.0, 1.0), default=0.05, show_default=True,
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
def run_command(arms: tuple[str, ...], api: str, tasks: str, num_requests: int, warmup: int, max_new_tokens: int,
                temperature: float, top_p: float, concurrency: int | None, rate: float | None, arrival: str,
                seed: int, duration: float | None, request_timeout: float, model: str | None, out: Path,
                name: str | None, metrics_port: int | None, pushgateway: str | None, max_error_rate: float,
                pin_arms: bool, shard: str | None, headers: tuple[str, ...], api_key: str | None, quiet: bool,
                until_decided: bool, gate: Path | None, look_every: int | None) -> None:
    """Run one load test; every arm gets the identical schedule. Ctrl-C stops and keeps what was recorded."""
    if concurrency is None and rate is None:
        raise UserError("--concurrency or --rate: give one (closed loop or open loop)")
    try:
        load = LoadShape(kind="closed" if rate is None else arrival, concurrency=concurrency, rate=rate, seed=seed)
        sampling = Sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    except ValidationError as exc:
        raise UserError(f"load/sampling: {exc.errors()[0]['msg']}") from None
    plan = RunPlan(arms=tuple(_arm(a) for a in arms), api="chat" if api == "chat" else "native",
                   task_set=load_tasks(tasks), num_requests=num_requests, warmup=warmup, sampling=sampling,
                   load=load, out=out, name=name, duration_s=duration, request_timeout_s=request_timeout, model=model,
                   pin_arms=pin_arms, sequential=_design(until_decided, gate, look_every),
                   shard=None if shard is None else parse_shard(shard), headers=request_headers(headers, api_key))
    monitor = (SequentialMonitor(plan.sequential, plan.arms[0][0], plan.arms[1][0], temperature,
                                 len(plan.task_set.tasks), warmup) if plan.sequential else None)
    if (warning := same_server_warning(plan.arms, pin_arms)) is not None:
        click.echo(wrapped(warning, terminal_width(stderr=True)), err=True)
    exporter = Exporter(route=api)
    if metrics_port is not None:
        click.echo(f"dfserve loadtest metrics: listening on {exporter.serve(metrics_port)}", err=True)
    indices = shard_indices(num_requests + warmup, plan.shard)
    progress = Progress([n for n, _ in plan.arms], sum(i >= warmup for i in indices), Console(stderr=True, quiet=quiet),
                        monitor, warmup=sum(i < warmup for i in indices), duration_s=duration)
    gc.collect()
    gc.freeze()  # keep full collections off the imported heap: their pauses would show up as latency
    try:
        with progress:
            observers = [exporter.observe, progress.observe, *([monitor.observe] if monitor else [])]
            outcome = uvloop.run(_until_signal(plan, observers, (lambda: monitor.stopped) if monitor else None))
    finally:
        exporter.close()
    summary = _finish_run(outcome.run_dir, outcome.config, outcome.records, outcome.interrupted, outcome.read_lag)
    if monitor:
        _print_sequential(monitor)
    if pushgateway:
        exporter.push(pushgateway, outcome.config.run_id)
    if outcome.interrupted:
        click.echo("interrupted: partial run kept", err=True)
        sys.exit(130)
    failing = over_error_rate(summary, max_error_rate)
    if failing:
        click.echo(f"errors over --max-error-rate {max_error_rate:g}: " + "; ".join(
            f"{a.arm} failed {a.requests - a.succeeded} of {a.requests} ({a.error_rate:.1%}: "
            + ", ".join(f"{kind}={count}" for kind, count in a.errors.items()) + ")" for a in failing)
            + f"; run kept: {outcome.run_dir}", err=True)
        sys.exit(EXIT_TOO_MANY_ERRORS)


def _design(until_decided: bool, gate: Path | None, look_every: int | None) -> SequentialDesign | None:
    if not until_decided:
        if gate is not None or look_every is not None:
            raise UserError("--gate, --look-every: only with --until-decided (dfserve compare --gate judges a run)")
        return None
    try:
        return SequentialDesign(gate=load_gate(gate), **({"look_every": look_every} if look_every is not None else {}))
    except ValidationError as exc:
        raise UserError(f"--look-every: {exc.errors()[0]['msg']}") from None


def _print_sequential(monitor: SequentialMonitor) -> None:
    look = monitor.decision or monitor.latest
    if look is None:
        click.echo(f"until decided: no look yet ({monitor.pairs} pairs, a look every {monitor.design.look_every})")
        return
    why = {"decided": "decided", "task_set": "undecided, limited by the task set", None: "undecided at the end"}
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
def merge_command(shards: tuple[Path, ...], out: Path | None, name: str | None) -> None:
    """Build one run from every shard of a `loadtest run --shard I/N` run; refuses a set that is not whole."""
    merged = merge([read_shard(path) for path in shards], name or new_run_id())
    run_dir = create_run_dir(out or shards[0].parent, merged.config.run_id)
    write_model(run_dir / "config.json", merged.config)
    write_atomic(run_dir / "requests.jsonl", "".join(r.model_dump_json() + "\n" for r in merged.records))
    _finish_run(run_dir, merged.config, merged.records, merged.interrupted, merged.read_lag)
    if merged.interrupted:
        click.echo("interrupted: a shard stopped early", err=True)


def _finish_run(run_dir: Path, config: RunConfig, records: list[RequestRecord], interrupted: bool,
                read_lag: Mapping[str, ReadLag]) -> Summary:
    """Write the summary and report of a run whose records are complete, and print the summary."""
    summary = summarize(config, records, interrupted, read_lag)
    write_model(run_dir / "summary.json", summary)
    write_atomic(run_dir / "report.html", render_html(config, summary, records))
    _print_summary(config, summary)
    warning = read_lag_warning(summary)
    if warning is not None:
        click.echo(wrapped(warning, terminal_width(stderr=True)), err=True)
    click.echo(f"run: {run_dir}")
    return summary


async def _until_signal(plan: RunPlan, observers: list[Observer], halt: Halt | None = None) -> RunOutcome:
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
        return await execute(plan, observers, stop, halt)
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
        errors = ", ".join(f"{k}={v}" for k, v in a.errors.items()) or "0"
        rate = f"{a.output_tokens_per_s:.0f}" if a.output_tokens_per_s else "-"
        table.add_row(a.arm, f"{a.succeeded}/{a.requests}", errors, tau, ttft, tpot, rate)
    Console().print(table)


def _load_run(run_dir: Path) -> tuple[RunConfig, list[RequestRecord]]:
    return read_config(run_dir), list(read_records(run_dir / "requests.jsonl"))


def _pick_arms(runs: list[tuple[Path, RunConfig]], baseline: str | None, candidate: str | None) -> tuple[str, str]:
    """One run: its first two arms by default; two runs: each run's only arm unless named."""
    if len(runs) == 1:
        names = [a.name for a in runs[0][1].arms]
        if baseline is None and candidate is None and len(names) != 2:
            raise UserError(f"--baseline/--candidate: run has arms {names}; name the two to compare")
        chosen = (baseline or names[0], candidate or next(n for n in names if n != (baseline or names[0])))
        if chosen[0] == chosen[1]:
            raise UserError("--baseline/--candidate: the same arm on both sides")
        return chosen
    picked = []
    for (path, config), wanted, flag in zip(runs, (baseline, candidate), ("--baseline", "--candidate"), strict=True):
        names = [a.name for a in config.arms]
        if wanted is None and len(names) != 1:
            raise UserError(f"{flag}: run {path} has arms {names}; name one")
        picked.append(wanted or names[0])
    return picked[0], picked[1]


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
@click.option("--force", is_flag=True, help="Compare runs that differ in tasks, sampling or load; stamped in the verdict.")
def compare(run: Path, run2: Path | None, baseline: str | None, candidate: str | None, gate: Path | None,
            out: Path | None, force: bool) -> None:
    """Judge a candidate against a baseline (two arms of RUN, or RUN vs RUN2). Exit 0 PASS, 1 FAIL, 3 INCONCLUSIVE."""
    rules = load_gate(gate)
    paths = [run] if run2 is None else [run, run2]
    loaded = [_load_run(p) for p in paths]
    base_name, cand_name = _pick_arms([(p, c) for p, (c, _) in zip(paths, loaded, strict=True)], baseline, candidate)
    (base_cfg, base_records), (cand_cfg, cand_records) = loaded[0], loaded[-1]
    mismatches = comparability(base_cfg, base_name, cand_cfg, cand_name)
    if mismatches and not force:
        raise UserError("runs are not comparable (" + "; ".join(mismatches) + "); --force compares anyway")
    sequential = base_cfg.sequential if run2 is None else None
    report = None
    if sequential is not None:  # a run that stopped on its own intervals is judged on always-valid ones
        rules = sequential.gate if gate is None else rules
        judgement, report = judge_sequential(base_records, base_name, cand_name, rules, base_cfg)
    else:
        judgement = judge([r for r in base_records if r.arm == base_name],
                          [r for r in cand_records if r.arm == cand_name], rules, temperature=base_cfg.sampling.temperature)
    verdict = Verdict(verdict=judgement.verdict, baseline=arm_ref(base_cfg, paths[0], base_name),
                      candidate=arm_ref(cand_cfg, paths[-1], cand_name), forced=bool(mismatches), mismatches=mismatches,
                      judgement=judgement, gate=rules, provenance=Provenance.here(), sequential=report)
    verdict_dir = create_run_dir(out or run.parent, prefix="verdict")
    write_model(verdict_dir / FILENAME, verdict)
    _print_verdict(verdict)
    _print_offline(verdict, BaselineRegistry(run.parent))
    click.echo(f"verdict: {verdict_dir / FILENAME}")
    sys.exit(EXIT[verdict.verdict])


def _print_verdict(verdict: Verdict) -> None:
    j = verdict.judgement
    console = Console()
    if verdict.forced:
        console.print(f"[bold red]FORCED comparison of runs that differ:[/] {'; '.join(verdict.mismatches)}")
    table = Table(title=f"{verdict.candidate.arm} vs {verdict.baseline.arm}: {j.paired_requests} paired requests over "
                  f"{j.tasks} tasks" + (" (SIMULATED)" if verdict.baseline.simulated else ""))
    for column in ("metric", "baseline", "candidate", "change [95% CI" + (", fixed-n]" if verdict.sequential else "]"), "n"):
        table.add_column(column)
    for m in j.metrics:
        if m.change is None:
            if m.baseline is None or m.candidate is None:
                table.add_row(m.label, "-", "-", "no data", "0")
            else:
                table.add_row(m.label, f"{m.baseline:.4g}", f"{m.candidate:.4g}", "undefined: baseline is 0",
                              f"{m.n_baseline}/{m.n_candidate}")
            continue
        scale = "%" if m.relative else " pts"
        factor = 100.0
        table.add_row(m.label, f"{m.baseline:.4g}", f"{m.candidate:.4g}",
                      f"{m.change * factor:+.2f}{scale} [{(m.change_low or 0) * factor:+.2f}, "
                      f"{(m.change_high or 0) * factor:+.2f}]", f"{m.n_baseline}/{m.n_candidate}")
    console.print(table)
    loss = j.lossless
    console.print(f"lossless: {loss.identical}/{loss.pairs} identical outputs"
                  + ("" if loss.applicable else " (temperature > 0: not judged)")
                  + (f"; differing tasks: {', '.join(loss.differing_tasks[:20])}" if loss.differing_tasks else ""))
    for rule in j.rules:
        needed = (f" (about {rule.tasks_needed} distinct tasks needed)" if rule.tasks_needed else
                  f" (about {rule.requests_needed} paired requests needed)" if rule.requests_needed else "")
        console.print(f"  {rule.status:<14} {rule.metric}: {rule.detail}{needed}")
    if verdict.sequential:
        seq = verdict.sequential
        console.print(f"sequential: {seq.method}; alpha {seq.design.alpha}, a look every {seq.design.look_every} "
                      f"pairs, decisions from {seq.design.min_tasks} tasks. The run stopped at look {seq.looks} after "
                      f"{seq.stopped_after_pairs} pairs ({seq.stopped}, {seq.verdict_when_stopped}); judged over "
                      f"{seq.pairs} pairs. The table's intervals are fixed-n, for reading only.")
    console.print(f"[bold]verdict: {verdict.verdict}[/]" +
                  (f" (about {j.tasks_needed} distinct tasks would decide it)" if j.tasks_needed else ""))


def _print_offline(verdict: Verdict, registry: BaselineRegistry) -> None:
    """Each drafter's offline τ (`dfserve eval`, recorded in the registry) beside its online τ, where both exist."""
    online = next(m for m in verdict.judgement.metrics if m.metric == "accept_length")
    lines = []
    for side, value in ((verdict.baseline, online.baseline), (verdict.candidate, online.candidate)):
        score = registry.offline(side.drafter)
        if score is not None and value is not None:
            lines.append(f"  {side.arm} ({side.drafter}): online {value:.3f}, offline {score.tau_as_sglang:.3f} "
                         f"(eval run {score.run_id}, {score.tasks} tasks, features {score.features})")
    if lines:
        click.echo("acceptance length offline (dfserve eval, counted as SGLang does) beside online:\n" + "\n".join(lines))


@click.command()
@click.argument("verdict_path", metavar="VERDICT", type=click.Path(path_type=Path, exists=True))
@click.option("--registry", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Directory of baselines.json (default: the directory holding the verdict, beside the runs).")
@click.option("--force", is_flag=True, help="Promote without a PASS or a matching baseline; needs --reason.")
@click.option("--reason", default=None, help="Why a forced promotion is right; recorded.")
def promote(verdict_path: Path, registry: Path | None, force: bool, reason: str | None) -> None:
    """Record the candidate of a PASS verdict as the new baseline of its target (history kept)."""
    if force and not reason:
        raise UserError("--force: give --reason TEXT; it is recorded with the promotion")
    verdict = read_verdict(verdict_path)
    verdict_file = (verdict_path / FILENAME if verdict_path.is_dir() else verdict_path).resolve()
    store = BaselineRegistry(registry or verdict_file.parent.parent)
    base, cand = verdict.baseline, verdict.candidate
    refusals = []
    if verdict.verdict != "PASS":
        refusals.append(f"the verdict is {verdict.verdict}, only PASS promotes")
    current = store.current(base.target)
    if current is not None and current.drafter != base.drafter:
        refusals.append(f"the verdict's baseline {base.drafter!r} is not the current baseline {current.drafter!r}")
    if refusals and not force:
        raise UserError("promote: " + "; ".join(refusals) + " (--force --reason TEXT overrides)")
    new = []
    if current is None:
        new.append(entry(base.target, base.drafter, base.run_id, base.arm, reason="baseline of the first promotion"))
    new.append(entry(cand.target, cand.drafter, cand.run_id, cand.arm, str(verdict_file), forced=bool(refusals),
                     reason=reason if refusals else None))
    store.append(*new)
    click.echo(f"baseline of {cand.target}: {cand.drafter} (run {cand.run_id}, arm {cand.arm})"
               + (" FORCED: " + "; ".join(refusals) if refusals else ""))


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
    targets = sorted({e.target for e in store.history(target)})
    if not targets:
        raise UserError(f"--registry: no baseline recorded in {store.path}" + (f" for {target}" if target else ""))
    for name in targets:
        current = store.current(name)
        assert current is not None
        click.echo(f"{name}: {current.drafter} (run {current.run_id}, arm {current.arm}, since {current.recorded_at}"
                   + (", FORCED" if current.forced else "") + ")")


@baseline.command("history")
@_registry_option
@click.option("--target", default=None, help="Only this target.")
def baseline_history(registry: Path, target: str | None) -> None:
    """Every change of baseline, oldest first."""
    for e in BaselineRegistry(registry).history(target):
        click.echo(f"{e.recorded_at}  {e.target}: {e.drafter}  run {e.run_id} arm {e.arm}"
                   + (f"  verdict {e.verdict}" if e.verdict else "")
                   + (f"  FORCED ({e.reason})" if e.forced else ""))
