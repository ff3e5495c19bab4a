"""`dfserve eval run` and `dfserve eval compare`: screen drafters offline before any of them is deployed.

    dfserve eval run --target Qwen/Qwen3.6-27B --drafter zlab --drafter step4000=/ckpt/step-4000/checkpoint.pt
    dfserve eval compare runs/eval-A runs/eval-B --baseline zlab --candidate step4000

torch, transformers and z-lab's dflash load only inside these commands (`pip install 'dfserve[eval]'`), so
`dfserve --help` stays instant and the core install needs none of them.
`compare` exits 0 on PASS, 1 on FAIL, 3 on INCONCLUSIVE, like `dfserve compare`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.table import Table

from dfserve.errors import Untrusted, UserError, command_flags, flags_for
from dfserve.eval.records import EvalConfig, EvalSummary
from dfserve.eval.verdict import DEFAULT_EVAL_GATE, compare_eval_runs
from dfserve.flags import FiniteFloat
from dfserve.terminal import Output, compact_table
from dfserve.verdict.gate import read_gate
from dfserve.verdict.printer import print_judgement
from dfserve.verdict.report import REPORT
from dfserve.verdict.verdict import EXIT

if TYPE_CHECKING:
    from dfserve.eval.runner import EvalPlan

NEEDS = ("torch", "transformers", "safetensors", "dflash")


def require_packages(command: str = "dfserve eval") -> None:
    if missing := [name for name in NEEDS if importlib.util.find_spec(name) is None]:
        raise UserError(f"{command} needs {', '.join(missing)}: pip install 'dfserve[eval]'")


def _drafter(value: str) -> tuple[str | None, str]:
    """`LABEL=DRAFTER` or `DRAFTER`; a path holding '=' is taken whole when it exists."""
    label, sep, spec = value.partition("=")
    if not sep or Path(value).exists():
        return None, value
    if not label or not spec:
        raise UserError(f"--drafter: {value!r} is not DRAFTER or LABEL=DRAFTER")
    return label, spec


def _budgets(value: str) -> tuple[int, ...]:
    try:
        budgets = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise UserError(f"--ddtree-budgets: {value!r} is not a comma-separated list of node counts") from None
    if any(b < 1 for b in budgets) or len(set(budgets)) != len(budgets):
        raise UserError(f"--ddtree-budgets: {value!r}: each budget is a distinct count of at least 1 node")
    return tuple(sorted(budgets))


@click.group("eval")
def eval_group() -> None:
    """Screen drafters offline: greedy references, cached target features, τ along the online trajectory."""


@eval_group.command("run", context_settings={"show_default": True})
@click.option("--target", required=True, help="Target model: a local folder or a Hugging Face id in the local cache.")
@click.option("--drafter", "drafters", multiple=True, required=True, metavar="[LABEL=]DRAFTER",
              help="zlab, baseline, a checkpoint (.pt/.safetensors) or a Hugging Face DFlash folder; repeat to "
                   "compare (the first is the baseline of the paired verdicts).")
@click.option("--drafter-config", type=click.Path(path_type=Path, dir_okay=False),
              help="config.json for checkpoints (default: z-lab's architecture from --profile).")
@click.option("--profile", "profile_name", default="pro6000", help="Host profile naming z-lab's drafter.")
@click.option("--tasks", default="humaneval", help="'humaneval' or a JSONL file of {id, prompt|messages}.")
@click.option("--num-tasks", type=click.IntRange(min=1), default=10, help="The first N tasks of the set.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=512)
@click.option("--block-size", type=click.IntRange(min=2, max=1024), default=None,
              help="Draft blocks of this size instead of each drafter's own.")
@click.option("--ddtree-budgets", default="4,8", help="DDTree node budgets, comma-separated ('' for none).")
@click.option("--prompt-format", type=click.Choice(["chat", "raw"]), default="chat",
              help="chat: the target's chat template (like OpenAI chat); raw: the text as native /generate takes it.")
@click.option("--thinking/--no-thinking", default=False, help="enable_thinking for the chat template.")
@click.option("--reference", default="local", metavar="local|URL",
              help="Greedy references from the target here, or from a running SGLang at URL (native /generate).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32",
              help="Target and drafter dtype (a 27B target needs about 108 GB in float32, 54 GB in bfloat16).")
@click.option("--anchors-per-forward", type=click.IntRange(min=1), default=32,
              help="Anchors scored by one drafter forward; 1 runs z-lab's own forward per anchor.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads torch computes with (default: one per core). Set fewer when other work shares the "
                   "machine: torch's threads wait for any that lose their core, several times slower than fewer.")
@click.option("--cache", type=click.Path(path_type=Path, file_okay=False), default=Path("eval-cache"),
              help="Folder of cached references and target features (content-addressed).")
@click.option("--features", type=click.Path(path_type=Path, file_okay=False),
              help="Use this feature cache folder; refused if it was built under other settings.")
@click.option("--drafter-store", "store", type=click.Path(path_type=Path, file_okay=False),
              default=Path("deployments/drafters"), help="Converted checkpoints, shared with dfserve deploy.")
@click.option("--registry", type=click.Path(path_type=Path, file_okay=False), default=Path("runs"),
              help="Baseline registry folder: --drafter baseline, and where offline τ is recorded.")
@click.option("--gate", type=click.Path(path_type=Path, dir_okay=False),
              help="A YAML gate file, e.g. `rules: [{metric: tau_vanilla, max_worse: 0.02}]` (the default; metrics "
                   "tau_vanilla, tau_ddtreeN).")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=Path("runs"))
@click.option("--name", default=None, help="Run directory name (must not exist).")
@click.option("--shard", default=None, metavar="I/N",
              help="Only tasks I, I+N, ... of the first --num-tasks (0-based): one part of a feature cache built "
                   "on several machines, joined by `dfserve eval cache merge`.")
@click.option("--quiet", is_flag=True, help="No progress.")
@click.pass_context
def run_command(ctx: click.Context, **opts: Any) -> None:
    """Score drafters on cached target features of coding tasks, as online greedy decoding would."""
    require_packages()
    from dfserve.eval.runner import run_eval

    console = Console(stderr=True, quiet=opts["quiet"])
    with flags_for(command_flags(ctx.command) | {"drafter": "--drafter"}):
        plan = _eval_plan(opts, tuple(_drafter(d) for d in opts["drafters"]), opts["out"], opts["name"])
        outcome = run_eval(plan, console)
    _print_run(outcome.config, outcome.summary)
    click.echo(f"run: {outcome.run_dir}")
    if outcome.summary.interrupted:
        click.echo("interrupted: partial run kept", err=True)
        sys.exit(130)


def _shard(value: str | None) -> tuple[int, int] | None:
    from dfserve.shard import parse_shard

    if value is None:
        return None
    shard = parse_shard(value)
    return shard.index, shard.count


def _eval_plan(opts: dict[str, Any], drafters: tuple[tuple[str | None, str], ...], out: Path,
               name: str | None) -> EvalPlan:
    """The plan of `eval run`'s settings (`eval watch` shares them), built inside the command's `flags_for`."""
    from dfserve.deploy.profiles import load_profile
    from dfserve.eval.runner import EvalPlan
    from dfserve.tasks import load_tasks

    plan = EvalPlan(
        target=opts["target"], drafters=drafters,
        profile=load_profile(opts["profile_name"]), drafter_config=opts["drafter_config"],
        tasks=load_tasks(opts["tasks"]), num_tasks=opts["num_tasks"], max_new_tokens=opts["max_new_tokens"],
        block_size=opts["block_size"], ddtree_budgets=_budgets(opts["ddtree_budgets"]),
        prompt_format=opts["prompt_format"], thinking=opts["thinking"], reference=opts["reference"],
        dtype=opts["dtype"], anchors_per_forward=opts["anchors_per_forward"], cache=opts["cache"],
        features=opts["features"], store=opts["store"], registry=opts["registry"], out=out,
        name=name, gate=read_gate(opts["gate"], DEFAULT_EVAL_GATE), threads=opts["threads"],
        shard=_shard(opts.get("shard")),
    )
    if plan.reference != "local" and not plan.reference.startswith(("http://", "https://")):
        raise UserError(f"--reference: {plan.reference!r} is neither 'local' nor an http(s) URL")
    return plan


def results_table(title: str, summary: EvalSummary) -> Table:
    """One row per drafter and method, so that it fits 80 columns however many DDTree budgets were scored; the
    drafter's per-position draft accuracy on its first row."""
    table = compact_table(title, {"drafter": False, "method": False, "τ [95% CI]": True, "τ as\nSGLang": True,
                                  "accepted\ndrafts": True, "accuracy\npos 1/2/3": True})
    for drafter in summary.drafters:
        accuracy = "/".join(f"{a:.2f}" if a is not None else "-" for a in drafter.positions.accuracy[:3])
        for number, m in enumerate(drafter.methods):
            table.add_row(drafter.drafter if number == 0 else "", m.method,
                          f"{m.tau.estimate:.2f} [{m.tau.low:.2f}, {m.tau.high:.2f}]", f"{m.tau_as_sglang:.2f}",
                          f"{m.accepted_drafts:.2f}", accuracy if number == 0 else "")
    return table


def _print_run(config: EvalConfig, summary: EvalSummary) -> None:
    features = config.features
    console = Output()
    console.print(results_table(f"offline evaluation {config.run_id}: {len(config.tasks.tasks)} tasks", summary))
    console.print(f"features {features.key} " + ("reused (no target forward)" if features.reused else "built by this run"))
    health = features.health
    console.print(f"health: the target's own greedy choice matches the reference at {health.agree}/{health.positions} "
                  f"positions ({health.fraction:.4f})" + (f"\n[bold red]warning:[/] {health.warning}" if health.warning else ""))
    for judgement in summary.judgements:
        print_judgement(console, judgement)


@eval_group.command("compare")
@click.argument("run", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.argument("run2", type=click.Path(path_type=Path, exists=True, file_okay=False), required=False)
@click.option("--baseline", default=None, help="Baseline drafter label (default: RUN's first drafter).")
@click.option("--candidate", default=None, help="Candidate drafter label (default: the second drafter / RUN2's first).")
@click.option("--gate", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="A YAML gate file, e.g. `rules: [{metric: tau_ddtree4, max_worse: 0.02}]` (metrics tau_vanilla, "
                   "tau_ddtreeN; default: tau_vanilla, 0.02).")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Where the verdict folder goes (default: "
              "beside RUN).")
@click.option("--force", is_flag=True, help="Judge a run that is not whole (killed, interrupted, records missing); "
              "stamped in the verdict.")
def compare_command(run: Path, run2: Path | None, baseline: str | None, candidate: str | None, gate: Path | None,
                    out: Path | None, force: bool) -> None:
    """Pair two drafters by task, in one run or across two runs on the same feature cache (else refused)."""
    try:
        with flags_for(command_flags(compare_command)):
            verdict, path = compare_eval_runs(run, run2, baseline, candidate, gate, out, force)
    except Untrusted as exc:
        raise UserError(f"{exc}; --force judges anyway, stamped in the verdict") from None
    for why in verdict.incomplete:
        click.echo(f"forced: {why}", err=True)
    print_judgement(Output(), verdict.judgement)
    click.echo(f"verdict: {path}")
    click.echo(f"report:  {path.parent / REPORT}")
    sys.exit(EXIT[verdict.verdict])


_NOT_WATCHED = {"drafters", "out", "name", "shard"}
"""`eval run`'s settings a watch sets itself (the drafter: each checkpoint; the run folder and its name) or has no
use for (a part of the tasks)."""


@eval_group.command("watch", context_settings={"show_default": True})
@click.argument("checkpoints", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--baseline", default="zlab", metavar="zlab|DIR|baseline",
              help="The reference drafter every checkpoint is paired with (scored once): zlab, a folder or "
                   "checkpoint, or the registry's baseline.")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=Path("eval-watch"),
              help="The watch folder: state, staged checkpoints, one eval run per checkpoint, trend.json, "
                   "report.html. A restarted watch resumes from it.")
@click.option("--every-checkpoint", is_flag=True,
              help="Score every checkpoint, oldest first (default: the newest first, skipping older pending ones).")
@click.option("--poll-seconds", type=FiniteFloat(min=0.01), default=30.0,
              help="Between two looks at CHECKPOINTS; a file is complete once unchanged over two looks.")
@click.option("--stop-after-idle", type=FiniteFloat(min=0), default=None, metavar="SECONDS",
              help="Stop once nothing new has appeared for this long (default: watch until stopped).")
@click.option("--stage", type=click.Choice(["link", "copy"]), default="link",
              help="Stage each checkpoint beside the runs by hard link, or by copy (CHECKPOINTS on another file "
                   "system, e.g. a read-only volume).")
@click.option("--pushgateway", default=None, metavar="URL", help="Push each scored checkpoint's gauges here.")
@click.option("--watch-name", default=None, help="The watch's name in the Pushgateway and the report (default: "
              "the --out folder's name).")
@click.option("--nice", "niceness", type=click.IntRange(min=0, max=19), default=10,
              help="Lower the watch's CPU priority by this much (os.nice), so the trainer keeps its pace.")
@click.pass_context
def watch_command(ctx: click.Context, checkpoints: Path, baseline: str, out: Path, every_checkpoint: bool,
                  poll_seconds: float, stop_after_idle: float | None, stage: str, pushgateway: str | None,
                  watch_name: str | None, niceness: int, **opts: Any) -> None:
    """Score each checkpoint a trainer writes to CHECKPOINTS against a baseline, and project whether the run will
    reach it (trend.json, report.html). The checkpoint folder is only read."""
    import os

    require_packages()
    from dfserve.eval.watch import WatchPlan, watch

    if out.resolve().is_relative_to(checkpoints.resolve()):
        raise UserError(f"--out: {out} lies inside {checkpoints}; the watch never writes into the checkpoint folder")
    os.nice(niceness)
    console = Console(stderr=True, quiet=opts["quiet"])
    with flags_for(command_flags(ctx.command) | {"checkpoint": "CHECKPOINTS", "stage": "--stage"}):
        plan = WatchPlan(checkpoints=checkpoints, out=out, eval=_eval_plan(opts, (), out / "runs", None),
                         baseline=baseline, every_checkpoint=every_checkpoint, poll_s=poll_seconds,
                         stop_after_idle_s=stop_after_idle, stage="copy" if stage == "copy" else "link",
                         pushgateway=pushgateway, name=watch_name or out.resolve().name)
        try:
            result = watch(plan, console, lambda line: click.echo(line, err=True))
        except KeyboardInterrupt:
            click.echo(f"stopped; `dfserve eval watch` on {out} again resumes", err=True)
            sys.exit(130)
    click.echo(f"scored {len(result.scored)} checkpoints; trend: {out / 'trend.json'}")


watch_command.params.extend(p for p in run_command.params if p.name not in _NOT_WATCHED)


@eval_group.group("cache")
def cache_group() -> None:
    """The feature cache: merge the parts built by `eval run --shard I/N`."""


@cache_group.command("merge")
@click.argument("parts", nargs=-1, required=True, type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--cache", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="The cache folder every later run reads (its --cache).")
@click.option("--tasks", default="humaneval", help="The task set the parts were built from.")
@click.option("--num-tasks", type=click.IntRange(min=1), required=True, help="--num-tasks the parts were built with.")
def cache_merge_command(parts: tuple[Path, ...], cache: Path, tasks: str, num_tasks: int) -> None:
    """Join the --cache folders of `eval run --shard I/N` into one cache: the references and target features of
    every task, as `eval run` on all of them would find them. Refuses a part missing, twice, or built otherwise."""
    from dfserve.eval.cache_merge import merge_caches
    from dfserve.tasks import load_tasks

    with flags_for({"shards": "PARTS", "cache": "--cache", "tasks": "--tasks"}):
        merged = merge_caches(list(parts), cache, load_tasks(tasks), num_tasks)
    click.echo(f"merged {merged.tasks} tasks from {len(parts)} parts: {merged.features}")
