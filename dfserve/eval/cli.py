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
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from dfserve.errors import UserError, command_flags, flags_for
from dfserve.eval.records import AnchorRecord, EvalConfig, EvalSummary, Judgement
from dfserve.eval.verdict import DEFAULT_EVAL_GATE, EvalVerdict, Side, check_gate, judge_offline
from dfserve.loadtest.config import read_model
from dfserve.loadtest.judge import read_gate
from dfserve.runs import Provenance, create_run_dir, read_jsonl, write_model

EXIT = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}
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
@click.option("--block-size", type=click.IntRange(min=2), default=None,
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
@click.option("--quiet", is_flag=True, help="No progress.")
@click.pass_context
def run_command(ctx: click.Context, **opts: Any) -> None:
    """Score drafters on cached target features of coding tasks, as online greedy decoding would."""
    require_packages()
    from dfserve.deploy.profiles import load_profile
    from dfserve.eval.runner import EvalPlan, run_eval
    from dfserve.loadtest.tasks import load_tasks

    console = Console(stderr=True, quiet=opts["quiet"])
    with flags_for(command_flags(ctx.command) | {"drafter": "--drafter"}):
        plan = EvalPlan(
            target=opts["target"], drafters=tuple(_drafter(d) for d in opts["drafters"]),
            profile=load_profile(opts["profile_name"]), drafter_config=opts["drafter_config"],
            tasks=load_tasks(opts["tasks"]), num_tasks=opts["num_tasks"], max_new_tokens=opts["max_new_tokens"],
            block_size=opts["block_size"], ddtree_budgets=_budgets(opts["ddtree_budgets"]),
            prompt_format=opts["prompt_format"], thinking=opts["thinking"], reference=opts["reference"],
            dtype=opts["dtype"], anchors_per_forward=opts["anchors_per_forward"], cache=opts["cache"],
            features=opts["features"], store=opts["store"], registry=opts["registry"], out=opts["out"],
            name=opts["name"], gate=read_gate(opts["gate"], DEFAULT_EVAL_GATE), threads=opts["threads"],
        )
        if plan.reference != "local" and not plan.reference.startswith(("http://", "https://")):
            raise UserError(f"--reference: {plan.reference!r} is neither 'local' nor an http(s) URL")
        outcome = run_eval(plan, console)
    _print_run(outcome.config, outcome.summary)
    click.echo(f"run: {outcome.run_dir}")
    if outcome.summary.interrupted:
        click.echo("interrupted: partial run kept", err=True)
        sys.exit(130)


def _print_run(config: EvalConfig, summary: EvalSummary) -> None:
    features = config.features
    table = Table(title=f"offline evaluation {config.run_id}: {len(config.tasks.tasks)} tasks, features {features.key} "
                  + ("reused (no target forward)" if features.reused else "built by this run"))
    for column in ("drafter", *(f"τ {m} [95% CI]" for m in config.methods()), "accepted drafts", "τ as SGLang",
                   "acc pos 1/2/3"):
        table.add_column(column)
    for drafter in summary.drafters:
        vanilla = drafter.method("vanilla")
        accuracy = "/".join(f"{a:.2f}" if a is not None else "-" for a in drafter.positions.accuracy[:3])
        table.add_row(drafter.drafter, *(f"{m.tau.estimate:.3f} [{m.tau.low:.3f}, {m.tau.high:.3f}]"
                                         for m in drafter.methods),
                      f"{vanilla.accepted_drafts:.3f}", f"{vanilla.tau_as_sglang:.3f}", accuracy)
    console = Console()
    console.print(table)
    health = features.health
    console.print(f"health: the target's own greedy choice matches the reference at {health.agree}/{health.positions} "
                  f"positions ({health.fraction:.4f})" + (f"\n[bold red]warning:[/] {health.warning}" if health.warning else ""))
    for judgement in summary.judgements:
        _print_judgement(console, judgement)


def _print_judgement(console: Console, j: Judgement) -> None:
    console.print(f"[bold]{j.candidate} vs {j.baseline}: {j.verdict}[/] ({j.tasks} paired tasks"
                  + (f"; about {j.tasks_needed} distinct tasks would decide it" if j.tasks_needed else "") + ")")
    for m in j.metrics:
        if m.change is not None:
            console.print(f"  {m.label}: {m.baseline:.3f} -> {m.candidate:.3f}, {m.change * 100:+.2f}% "
                          f"[{(m.change_low or 0) * 100:+.2f}, {(m.change_high or 0) * 100:+.2f}]")
    for rule in j.rules:
        console.print(f"  {rule.status:<14} {rule.metric}: {rule.detail}")


def _load(run_dir: Path) -> tuple[EvalConfig, list[AnchorRecord]]:
    config = read_model(run_dir / "config.json", EvalConfig, f"{run_dir}: not an evaluation run (no config.json)")
    return config, list(read_jsonl(run_dir / "anchors.jsonl", AnchorRecord, "an anchor record"))


def _label(config: EvalConfig, wanted: str | None, flag: str, default_index: int) -> str:
    labels = [d.label for d in config.drafters]
    if wanted is None:
        if len(labels) <= default_index:
            raise UserError(f"{flag}: run {config.run_id} has drafters {labels}; name one")
        return labels[default_index]
    if wanted not in labels:
        raise UserError(f"{flag}: run {config.run_id} has no drafter {wanted!r} (drafters: {', '.join(labels)})")
    return wanted


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
def compare_command(run: Path, run2: Path | None, baseline: str | None, candidate: str | None, gate: Path | None,
                    out: Path | None) -> None:
    """Pair two drafters by task, in one run or across two runs on the same feature cache (else refused)."""
    rules = read_gate(gate, DEFAULT_EVAL_GATE)
    base_cfg, base_records = _load(run)
    cand_cfg, cand_records = _load(run2) if run2 is not None else (base_cfg, base_records)
    if problems := base_cfg.comparable_with(cand_cfg):
        raise UserError("runs are not comparable (" + "; ".join(problems) + "); evaluate both drafters on one cache")
    base_label = _label(base_cfg, baseline, "--baseline", 0)
    cand_label = _label(cand_cfg, candidate, "--candidate", 1 if run2 is None else 0)
    if run2 is None and base_label == cand_label:
        raise UserError("--baseline/--candidate: the same drafter on both sides")
    methods = [m for m in base_cfg.methods() if m in cand_cfg.methods()]
    check_gate(rules, methods)
    judgement = judge_offline(base_label, [r for r in base_records if r.drafter == base_label], cand_label,
                              [r for r in cand_records if r.drafter == cand_label],
                              [t.id for t in base_cfg.tasks.tasks], methods, rules)

    def side(config: EvalConfig, path: Path, label: str) -> Side:
        info = next(d for d in config.drafters if d.label == label)
        return Side(run_id=config.run_id, run_dir=str(path.resolve()), drafter=label, identity=info.identity)

    verdict = EvalVerdict(baseline=side(base_cfg, run, base_label), candidate=side(cand_cfg, run2 or run, cand_label),
                          features=base_cfg.features.key, judgement=judgement, gate=rules, provenance=Provenance.here())
    verdict_dir = create_run_dir(out or run.parent, prefix="eval-verdict")
    write_model(verdict_dir / "eval-verdict.json", verdict)
    _print_judgement(Console(), judgement)
    click.echo(f"verdict: {verdict_dir / 'eval-verdict.json'}")
    sys.exit(EXIT[judgement.verdict])
