"""The offline evaluation as a source of pairs for the verdict core: two drafters scored on the same feature cache,
paired by task, each method's τ a metric (`tau_vanilla`, `tau_ddtree8`).

A unit is one drafter's totals on one task (Σ tokens and Σ rounds per method), so tasks are the clusters of the
bootstrap and a prompt's difficulty cancels out of the difference. The default rule asks the candidate's vanilla
τ to be at most 2% below the baseline's with confidence, like `dfserve compare`'s acceptance rule; a gate file may
name any method the run scored::

    judgement = judge_offline("zlab", base_records, "step-4000", cand_records, task_ids, methods, gate)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dfserve.errors import FieldError, Untrusted, UserError
from dfserve.eval.metrics import method_totals
from dfserve.eval.records import VANILLA, AnchorRecord, DrafterInfo, EvalConfig, EvalSummary, metric_of
from dfserve.runs import Provenance, read_jsonl, read_model, unsealed
from dfserve.verdict.fixed import FixedN
from dfserve.verdict.gate import Gate, Rule, check_rules, read_gate
from dfserve.verdict.pairs import MetricSpec, Pairs
from dfserve.verdict.report import write_verdict_report
from dfserve.verdict.results import Judgement
from dfserve.verdict.verdict import Side, Verdict, write_verdict

DEFAULT_EVAL_GATE = Gate(rules=(Rule(metric=metric_of(VANILLA), max_worse=0.02),))


@dataclass(frozen=True)
class TaskTotals:
    """One drafter on one task: tokens committed and rounds made by each method's trajectory."""

    tokens: dict[str, float]
    rounds: dict[str, float]
    ok: bool = True


def _tau(method: str) -> MetricSpec[TaskTotals]:
    return MetricSpec(f"τ {method} (Σ tokens / Σ rounds)", "ratio", True, numerator=lambda u: u.tokens[method],
                      denominator=lambda u: u.rounds[method])


def metrics_of(methods: Sequence[str]) -> dict[str, MetricSpec[TaskTotals]]:
    return {metric_of(method): _tau(method) for method in methods}


def judge_offline(
    baseline: str, base_records: Sequence[AnchorRecord], candidate: str, cand_records: Sequence[AnchorRecord],
    task_ids: Sequence[str], methods: Sequence[str], gate: Gate,
) -> Judgement:
    """The fixed-n verdict over the tasks where both drafters made a round."""
    totals = {m: (method_totals(base_records, task_ids, m), method_totals(cand_records, task_ids, m)) for m in methods}

    def unit(side: int, task: int) -> TaskTotals:
        return TaskTotals({m: float(t[side][0][task]) for m, t in totals.items()},
                          {m: float(t[side][1][task]) for m, t in totals.items()})

    (_, base_rounds), (_, cand_rounds) = totals[methods[0]]
    both = [i for i in range(len(task_ids)) if base_rounds[i] > 0 and cand_rounds[i] > 0]
    pairs = Pairs.match((baseline, candidate), ((i, task_ids[i], unit(0, i)) for i in both),
                        ((i, task_ids[i], unit(1, i)) for i in both), deterministic=True)
    return FixedN().judge(pairs, metrics_of(methods), gate).judgement


def judged_against_itself(baseline: str, base: DrafterInfo, candidate: str, cand: DrafterInfo) -> str | None:
    """Why a verdict of `cand` against `base` would judge one checkpoint against itself, which passes any gate at
    exactly 0%; None when nothing proves them one (`DrafterInfo.checkpoint_shared_with`)."""
    if (shared := base.checkpoint_shared_with(cand)) is None:
        return None
    return (f"drafters {baseline} and {candidate} are one checkpoint ({shared}): a drafter is never "
            "judged against itself")


@dataclass(frozen=True)
class EvalRun:
    path: Path
    config: EvalConfig
    records: list[AnchorRecord]
    summary: EvalSummary | None
    """None: the run was killed before it wrote one."""

    @classmethod
    def load(cls, path: Path) -> EvalRun:
        config = read_model(path / "config.json", EvalConfig, f"{path}: not an evaluation run (no config.json)")
        records = list(read_jsonl(path / "anchors.jsonl", AnchorRecord, "an anchor record"))
        summary_path = path / "summary.json"
        summary = read_model(summary_path, EvalSummary, "") if summary_path.exists() else None
        return cls(path, config, records, summary)

    def drafter_records(self, label: str) -> list[AnchorRecord]:
        """`label`'s records; refused when they cannot be the run's: an anchor recorded twice, or a task the run
        does not have (its writer records each anchor of each task once)."""
        records = [r for r in self.records if r.drafter == label]
        tasks = {t.id for t in self.config.tasks.tasks}
        if foreign := next((r for r in records if r.task not in tasks), None):
            raise UserError(f"{self.path / 'anchors.jsonl'}: drafter {label} has a record of task {foreign.task!r}, "
                            "which the run does not have (edited?)")
        twice = [key for key, n in Counter((r.task, r.anchor) for r in records).items() if n > 1]
        if twice:
            raise UserError(f"{self.path / 'anchors.jsonl'}: drafter {label} has task {twice[0][0]}'s anchor "
                            f"{twice[0][1]} recorded more than once; duplicated records are never judged")
        return records

    def incomplete(self, label: str, records: Sequence[AnchorRecord]) -> list[str]:
        """Why `label`'s records are not all its drafter scored: the run was killed or interrupted, or its
        records are not those summary.json was made from."""
        where = f"eval run {self.config.run_id}"
        if self.summary is None:
            return [f"{where}: no summary.json (killed before its end)"]
        if self.summary.run_id != self.config.run_id:
            return [f"{where}: summary.json is run {self.summary.run_id}'s"]
        if self.summary.interrupted:
            return [f"{where}: interrupted (summary.json), a part of its tasks scored"]
        written = next((d for d in self.summary.drafters if d.drafter == label), None)
        tasks = [t.id for t in self.config.tasks.tasks]
        problems = []
        if written is None or written.anchors != len(records) or any(
                (m.tokens, m.rounds) != tuple(int(v.sum()) for v in method_totals(records, tasks, m.method))
                for m in written.methods):
            problems.append(f"{where} drafter {label}: summary.json's figures are not those of its records in "
                            "anchors.jsonl (records missing or edited)")
        for why in (unsealed(self.path / "anchors.jsonl", self.summary.records_sha256),
                    unsealed(self.path / "config.json", self.summary.config_sha256),
                    self.summary.unsealed(self.path / "summary.json")):
            if why is not None:
                problems.append(f"{where}: {why}")
        return problems

    def label(self, wanted: str | None, field: str, default_index: int) -> str:
        labels = [d.label for d in self.config.drafters]
        if wanted is None:
            if len(labels) <= default_index:
                raise FieldError(field, f"run {self.config.run_id} has drafters {labels}; name one")
            return labels[default_index]
        if wanted not in labels:
            raise FieldError(field, f"run {self.config.run_id} has no drafter {wanted!r} (drafters: "
                             f"{', '.join(labels)})")
        return wanted

    def drafter(self, label: str) -> DrafterInfo:
        return next(d for d in self.config.drafters if d.label == label)

    def side(self, label: str) -> Side:
        info = self.drafter(label)
        return Side(run_id=self.config.run_id, run_dir=str(self.path.resolve()), name=label,
                    target=self.config.target.model, drafter=info.identity)


def compare_eval_runs(run: Path, run2: Path | None, baseline: str | None, candidate: str | None,
                      gate: Path | None, out: Path | None, force: bool = False) -> tuple[Verdict, Path]:
    """Pair two drafters by task, in one run or across two runs on the same feature cache (else refused), and
    write the offline verdict and its report.html into a new folder under `out` (default: beside `run`).

    Refused always: one run given twice, a drafter judged against itself (`judged_against_itself`), records that
    cannot be the run's (`EvalRun.drafter_records`). Refused unless `force`, and then stamped in the verdict: a run
    that is not whole (`EvalRun.incomplete`), or drafters scored on other anchors."""
    rules = read_gate(gate, DEFAULT_EVAL_GATE)
    base = EvalRun.load(run)
    cand = EvalRun.load(run2) if run2 is not None else base
    if run2 is not None and base.config.run_id == cand.config.run_id:
        raise UserError(f"{run} and {run2} are one run ({base.config.run_id}): give it once, with both drafters")
    if problems := base.config.comparable_with(cand.config):
        raise UserError("runs are not comparable (" + "; ".join(problems) + "); evaluate both drafters on one cache")
    base_label = base.label(baseline, "baseline", 0)
    cand_label = cand.label(candidate, "candidate", 1 if run2 is None else 0)
    if run2 is None and base_label == cand_label:
        raise FieldError("baseline", "the same drafter as {other}", other="candidate")
    names = (base_label, cand_label) if run2 is None else (f"{base_label} (run {base.config.run_id})",
                                                            f"{cand_label} (run {cand.config.run_id})")
    if why := judged_against_itself(names[0], base.drafter(base_label), names[1], cand.drafter(cand_label)):
        raise UserError(why)
    methods = [m for m in base.config.methods() if m in cand.config.methods()]
    check_rules(rules, metrics_of(methods), gate)
    base_records, cand_records = base.drafter_records(base_label), cand.drafter_records(cand_label)
    incomplete = base.incomplete(base_label, base_records)
    incomplete += [why for why in cand.incomplete(cand_label, cand_records) if why not in incomplete]
    anchors = ({(r.task, r.anchor) for r in base_records}, {(r.task, r.anchor) for r in cand_records})
    if anchors[0] != anchors[1]:
        incomplete.append(f"{len(anchors[0] ^ anchors[1])} anchors are scored for one of {base_label} and "
                          f"{cand_label} only; both are scored on every anchor of the cache")
    if incomplete and not force:
        raise Untrusted("not the whole run (" + "; ".join(incomplete) + ")")
    judgement = judge_offline(base_label, base_records, cand_label, cand_records,
                              [t.id for t in base.config.tasks.tasks], methods, rules)
    verdict = Verdict(source="eval", verdict=judgement.verdict, baseline=base.side(base_label),
                      candidate=cand.side(cand_label), forced=bool(incomplete), incomplete=incomplete,
                      features=base.config.features.key, judgement=judgement, gate=rules,
                      provenance=Provenance.here())
    file = write_verdict(verdict, out or run.parent)
    write_verdict_report(verdict, file.parent)
    return verdict, file
