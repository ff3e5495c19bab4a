"""`dfserve compare` as a library call: load the runs, refuse what must not be judged, pick the design, judge,
write verdict.json and its report.html.

Refused always: a run judged against itself (one folder twice, two folders of one run id or of one start instant, a
merged run and one of its shards). Refused unless forced, and then stamped in the verdict (`forced`, with `mismatches` and
`incomplete`): runs that differ in what shapes their numbers (two arms of one run on one server, unpinned, among
them: they got the same traffic), a run whose data is not whole (interrupted, killed before its summary, one shard
of a schedule, or with fewer records than its schedule or its summary counts), records that cannot be the run's
(an index recorded twice or outside its schedule, figures of summary.json that its records do not give), and a
candidate whose records are timed as the baseline's, to the microsecond from each request's send (a copy of the same
requests, its clock moved or not). A run that stopped
on its own always-valid intervals (`--until-decided`) is judged on them again; any other on the fixed-n bootstrap.

    verdict, path = compare_runs([Path("runs/ab")], None, None, gate=None, force=False, out=None)
"""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dfserve.errors import FieldError, Untrusted, UserError
from dfserve.loadtest.config import RunConfig, read_config
from dfserve.loadtest.judge import METRICS, comparability, load_gate, pairs_of
from dfserve.loadtest.records import RequestRecord, copied, impossible_records, measured_records, read_records
from dfserve.loadtest.report import Summary, figures_differ
from dfserve.loadtest.sequential import design_of
from dfserve.runs import Provenance, read_model, unsealed
from dfserve.sglang import parse_server_info
from dfserve.shadow.verdict import compare_shadow, is_shadow_folder
from dfserve.shard import shard_indices
from dfserve.verdict.design import Design, another_gate
from dfserve.verdict.fixed import FixedN
from dfserve.verdict.report import write_verdict_report
from dfserve.verdict.verdict import Side, Verdict, write_verdict


@dataclass(frozen=True)
class Run:
    path: Path
    config: RunConfig
    records: list[RequestRecord]

    @classmethod
    def load(cls, path: Path) -> Run:
        return cls(path, read_config(path), list(read_records(path / "requests.jsonl")))

    def side(self, arm: str) -> Side:
        info = self.config.arm(arm)
        server = parse_server_info(info.server_info) if info.server_info is not None else None
        return Side(run_id=self.config.run_id, run_dir=str(self.path.resolve()), name=arm, url=info.url,
                    target=server.model_path if server and server.model_path else info.model,
                    drafter=server.draft_model_path if server and server.draft_model_path else "none",
                    simulated=info.simulated)


def incomplete(run: Run) -> list[str]:
    """Why a run's records are not the whole run; empty when they are."""
    name = run.config.run_id
    summary_file = run.path / "summary.json"
    if not summary_file.exists():
        return [f"run {name} has no summary.json: it was killed, or is still running"]
    summary = read_model(summary_file, Summary, f"{summary_file} does not exist")
    problems = [f"run {name} was interrupted before its end"] if summary.interrupted else []
    if run.config.tasks.incomplete is not None:
        problems.append(f"run {name} replayed {run.config.tasks.name}, and {run.config.tasks.incomplete}")
    if summary.run_id != name:
        problems.append(f"run {name}: its summary.json is run {summary.run_id}'s")
    config = run.config
    if config.shard is not None:
        problems.append(f"run {name} is shard {config.shard.index}/{config.shard.count} of a schedule: merge its "
                        "shards to judge the whole")
    schedule = shard_indices(config.warmup + config.num_requests, config.shard)
    expected = None
    if config.sequential is None and config.duration_s is None:
        expected = sum(1 for i in schedule if i >= config.warmup)
    summarized = {arm.arm for arm in summary.arms}
    problems.extend(f"run {name} arm {arm.name}: not in summary.json" for arm in config.arms
                    if arm.name not in summarized)
    problems.extend(f"run {name}: summary.json has an arm {arm} the run does not" for arm in sorted(
        summarized - {arm.name for arm in config.arms}))
    for arm in summary.arms:
        measured = measured_records(r for r in run.records if r.arm == arm.arm)
        recorded = len(measured)
        if recorded != arm.requests:
            problems.append(f"run {name} arm {arm.arm}: requests.jsonl holds {recorded} measured records, "
                            f"summary.json counts {arm.requests}")
        elif expected is not None and recorded < expected:
            problems.append(f"run {name} arm {arm.arm}: {recorded} of the {expected} scheduled requests recorded")
        problems.extend(f"run {name} arm {arm.arm}: {line}" for line in _foreign(measured, schedule, config))
        if figures_differ(arm, measured):
            problems.append(f"run {name} arm {arm.arm}: summary.json's figures are not those of its records in "
                            "requests.jsonl (edited?)")
    for why in (unsealed(run.path / "requests.jsonl", summary.records_sha256),
                unsealed(run.path / "config.json", summary.config_sha256), summary.unsealed(summary_file)):
        if why is not None:
            problems.append(f"run {name}: {why}")
    return problems


def _foreign(measured: Sequence[RequestRecord], schedule: range, config: RunConfig) -> list[str]:
    """Records that cannot be the run's own: an index twice, one its schedule never sent (measured), or one no
    recorder wrote (`records.impossible`)."""
    counts = Counter(r.index for r in measured)
    twice = sorted(i for i, n in counts.items() if n > 1)
    outside = sorted(i for i in counts if i not in schedule or i < config.warmup) if config.duration_s is None else []
    return [f"index {found[0]} {what}" + (f" (and {len(found) - 1} more)" if len(found) > 1 else "")
            for found, what in ((twice, "recorded twice"), (outside, "is not a measured request of its schedule"))
            if found] + impossible_records(measured)


def pick_arms(runs: Sequence[Run], baseline: str | None, candidate: str | None) -> tuple[str, str]:
    """One run: its first two arms by default; two runs: each run's only arm unless named. An arm named that the
    run has not is a `FieldError` on the side that named it."""
    for field, wanted, run in (("baseline", baseline, runs[0]), ("candidate", candidate, runs[-1])):
        names = [a.name for a in run.config.arms]
        if wanted is not None and wanted not in names:
            raise FieldError(field, f"{run.path} has no arm named {wanted!r} (its arms: {', '.join(names)})")
    if len(runs) == 1:
        names = [a.name for a in runs[0].config.arms]
        if baseline is None and candidate is None and len(names) != 2:
            raise FieldError("baseline", f"the run has arms {names}; name the two to compare (and {{other}})",
                             other="candidate")
        chosen = (baseline or names[0], candidate or next(n for n in names if n != (baseline or names[0])))
        if chosen[0] == chosen[1]:
            raise FieldError("baseline", "the same arm as {other}", other="candidate")
        return chosen
    picked = []
    for run, wanted, field in zip(runs, (baseline, candidate), ("baseline", "candidate"), strict=True):
        names = [a.name for a in run.config.arms]
        if wanted is None and len(names) != 1:
            raise FieldError(field, f"run {run.path} has arms {names}; name one")
        picked.append(wanted or names[0])
    return picked[0], picked[1]


def compare_runs(paths: Sequence[Path], baseline: str | None, candidate: str | None, gate: Path | None,
                 force: bool, out: Path | None) -> tuple[Verdict, Path]:
    """Judge a candidate arm against a baseline arm (two arms of one run, or one arm of each of two runs) and
    write the verdict into a new folder under `out` (default: beside the first run)."""
    rules = load_gate(gate)
    runs = [Run.load(path) for path in paths]
    if len(runs) == 2 and runs[0].config.run_id == runs[1].config.run_id:
        raise UserError(f"{paths[0]} and {paths[1]} are one run ({runs[0].config.run_id}): a run is never judged "
                        "against itself")
    if len(runs) == 2 and runs[0].config.t0_unix_s == runs[1].config.t0_unix_s:
        raise UserError(f"{paths[0]} and {paths[1]} started at the same instant (t0_unix_s): one run under two "
                        "names, never judged against itself")
    if len(runs) == 2 and {runs[0].config.run_id, *runs[0].config.merged_from} & {runs[1].config.run_id,
                                                                                  *runs[1].config.merged_from}:
        raise UserError(f"{paths[0]} and {paths[1]} share a shard (merged_from): a run is never judged against "
                        "itself")
    base_arm, cand_arm = pick_arms(runs, baseline, candidate)
    base, cand = runs[0], runs[-1]
    mismatches = comparability(base.config, base_arm, cand.config, cand_arm)
    if mismatches and not force:
        raise Untrusted("runs are not comparable (" + "; ".join(mismatches) + ")")
    missing = [line for run in runs for line in incomplete(run)]
    if missing and not force:
        raise Untrusted("not the whole run: " + "; ".join(missing))
    design: Design = FixedN()
    if len(runs) == 1 and base.config.sequential is not None:  # a run that stopped on its own intervals
        design = design_of(base.config)
        rules = base.config.sequential.gate if gate is None else rules
        if (why := another_gate(base.config.sequential, rules)) is not None:
            mismatches.append(why)
            if not force:
                raise Untrusted(why)
    elif stopped := [run.config.run_id for run in runs if run.config.sequential is not None]:
        why = (f"run {stopped[0]} stopped once its own gate was decided (--until-decided): its records are no fixed "
               "sample, and pairs across two runs have no sequential design to judge them by")
        mismatches.append(why)
        if not force:
            raise Untrusted(why)
    pairs = pairs_of([r for r in base.records if r.arm == base_arm], [r for r in cand.records if r.arm == cand_arm],
                     base.config.sampling.temperature)
    if copied(pairs.base, pairs.cand):
        missing.append(f"the records of {cand_arm} ({cand.config.run_id}) are those of {base_arm} "
                       f"({base.config.run_id}), to the microsecond: a run judged against itself")
        if not force:
            raise Untrusted(missing[-1])
    outcome = design.judge(pairs, METRICS, rules)
    verdict = Verdict(source="loadtest", verdict=outcome.judgement.verdict, baseline=base.side(base_arm),
                      candidate=cand.side(cand_arm), forced=bool(mismatches or missing), mismatches=mismatches,
                      incomplete=missing, judgement=outcome.judgement, gate=rules, provenance=Provenance.here(),
                      sequential=outcome.sequential)
    file = write_verdict(verdict, out or paths[0].parent)
    write_verdict_report(verdict, file.parent)
    return verdict, file


def unfounded(verdict: Verdict) -> list[str]:
    """Why `verdict` is not what its runs give, judged again as `dfserve compare` judged them (the same arms, gate
    and `--force`); empty when it is. A verdict edited by hand, or whose runs changed since, says so here."""
    base, cand = verdict.baseline, verdict.candidate
    folders = [Path(base.run_dir)] if base.run_dir == cand.run_dir else [Path(base.run_dir), Path(cand.run_dir)]
    if not all((folder / "config.json").is_file() for folder in folders):
        return [f"the runs it judged are not at {', '.join(map(str, folders))}: it cannot be judged again"]
    with tempfile.TemporaryDirectory(prefix="dfserve-rejudge-") as scratch:
        gate = Path(scratch) / "gate.yaml"
        gate.write_text(verdict.gate.model_dump_json())  # JSON is YAML
        try:
            if is_shadow_folder(folders[0]):
                again = compare_shadow(folders[0], cand.name, gate, verdict.forced, Path(scratch)).verdict
            else:
                again = compare_runs(folders, base.name, cand.name, gate, verdict.forced, Path(scratch))[0]
        except UserError as exc:
            return [f"its runs are refused now ({exc})"]
    for role, said, given in (("baseline", verdict.baseline, again.baseline),
                              ("candidate", verdict.candidate, again.candidate)):
        if edited := [name for name in type(said).model_fields if getattr(said, name) != getattr(given, name)]:
            return [f"its {role}'s {', '.join(edited)} are not those of the run it names (edited: what it says was "
                    "judged was not)"]
    if again.verdict != verdict.verdict:
        return [f"its runs give {again.verdict}, not the {verdict.verdict} it says, judged again (edited, or the "
                "runs changed since)"]
    if again.judgement.model_dump_json() != verdict.judgement.model_dump_json():
        return [f"its figures are not those its runs give, judged again, though both say {again.verdict} (edited, "
                "or the runs changed since)"]
    return []
