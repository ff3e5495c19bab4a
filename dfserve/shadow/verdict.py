"""`dfserve compare` on a shadow record folder: live requests as the source of pairs, paired by request.

The gate, the metrics and the decision are the load test's (`loadtest.judge.METRICS`, `verdict.fixed.FixedN`):
only the pairing differs. Each pair is one live request answered by the primary (the baseline: what clients got)
and mirrored to the candidate; identical requests are one cluster. Losslessness is judged on the pairs whose request
was greedy (temperature 0) and whose answers' outputs the gateway held, however many others were sampled; without
one it is reported as not applicable, with the reason said. With a secondary arm (the baseline's drafter again, on another engine) the same
judgement of primary against secondary is the noise floor, written beside the verdict (`noise-floor.json`) and
printed beside it: a difference no larger than the floor is the host's or the engine's, not the drafter's.

A folder the gateway decided on as it recorded it (`shadow.until_decided`, its design in config.json) is judged
with the sequential design, its looks replayed in request-id order (`shadow.monitor.judge_live`): the verdict says
it was decided on live traffic, and where the gateway wrote its decision the replay must find the same. Where it
gave the decision up (decision-given-up.json says why), records that replay to a decision are judged only forced:
the requests in flight when it gave up, the slowest, may be in no folder or in the next.

Refused always: a folder judged against itself (candidate = baseline), a request recorded twice for one arm.
Refused unless forced (then stamped): arms whose engines differ beyond the drafter (target, capacity) or could not
be asked (`/server_info` unrecorded), a secondary arm that is no noise floor (another target or drafter than the
primary's, or the primary's own engine), a folder still being written (no summary.json) or whose records do not
match its summary, one where the gateway wrote requests without all their records (summary `interrupted`) or
holding mirrors' records without their primary's (the gateway writes a request's records together), a decided
folder whose records or design do not replay the gateway's decision (decision.json).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from dfserve.errors import FieldError, Untrusted, UserError
from dfserve.loadtest.judge import LOSSLESS, METRICS, TIMED
from dfserve.loadtest.records import (
    RequestRecord,
    check_same_request,
    copied,
    impossible_records,
    read_records,
)
from dfserve.loadtest.report import READ_WITH_NEXT_WARNED, ReadWithNext, Summary, figures_differ
from dfserve.runs import Provenance, read_model, unsealed, write_model
from dfserve.shadow import arms
from dfserve.shadow.monitor import DECISION, GIVEN_UP, Decided, GivenUp, judge_live
from dfserve.shadow.policy import ShadowPolicy
from dfserve.shadow.recorder import ShadowRunConfig
from dfserve.shadow.records import greedy_held
from dfserve.verdict.design import SequentialDesign, SequentialReport, another_gate
from dfserve.verdict.fixed import FixedN
from dfserve.verdict.gate import Gate, Rule, check_rules, read_gate
from dfserve.verdict.pairs import Pairs
from dfserve.verdict.report import write_verdict_report
from dfserve.verdict.results import Judgement, overall
from dfserve.verdict.sequential import check_sequential_gate
from dfserve.verdict.verdict import Side, Verdict, write_verdict

DEFAULT_GATE = Gate(rules=(
    Rule(metric="accept_length", max_worse=0.02),
    Rule(metric="e2e_p95", max_worse=0.05),
    Rule(metric="error_rate", max_worse=0.01),
    Rule(metric=LOSSLESS, at_least=0.99),
))
"""The load test's default gate with E2E p95 for TPOT p95: a whole (unstreamed) answer has no chunk times, so live
traffic without streams would leave TPOT undecided. TPOT and ITL are measured on recorded streams: a gate that
names them (`--gate`) is judged on those."""
NOISE_FLOOR = "noise-floor.json"
NO_HASH = ("losslessness is judged without the greedy answers that have no output the gateway could read (an "
           "OpenAI stream recorded without its pieces, a native stream from a server that streams deltas "
           "(--incremental-streaming-output), or an answer that is not SGLang's), and not at all without a greedy "
           "pair left")


class NoiseFloor(BaseModel):
    """primary against secondary: the same judgement where the drafters are the same."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: str = "shadow-noise-floor"
    secondary: str
    judgement: Judgement


def live_design(policy: ShadowPolicy, arms: Iterable[str], primary: str) -> tuple[SequentialDesign, str] | None:
    """The design a gateway decides with and the arm it judges, or None when it does not decide; a gate rule the
    sequential design cannot decide (per-token ITL) or a candidate that is not one arm is refused naming its field."""
    if not policy.until_decided:
        return None
    candidates = [arm for arm in arms if arm not in (primary, policy.secondary)]
    if len(candidates) != 1:
        raise FieldError("shadow.until_decided", f"decides one mirrored arm against the primary, and {primary} is "
                         f"mirrored to {candidates}; name the noise-floor arm as shadow.secondary")
    try:
        gate = read_gate(policy.gate, DEFAULT_GATE)
        check_sequential_gate(gate, METRICS)
    except FieldError as exc:
        raise FieldError("shadow.gate", exc.message) from None
    return SequentialDesign(gate=gate, **({"look_every": policy.look_every} if policy.look_every else {})), candidates[0]


def replayed(path: Path, config: ShadowRunConfig, report: SequentialReport, request_ids: Sequence[int]) -> list[str]:
    """How the replayed looks differ from the decision the gateway wrote; empty where it wrote none. `request_ids`:
    the pairs' request ids in the order the looks took them."""
    file = path / DECISION
    if not file.exists():
        if report.stopped != "decided":
            return []
        replay = f"{report.verdict_when_stopped} at look {report.looks}"
        if (why := _given_up(path, config)) is not None:
            return [f"the gateway gave its live decision up ({why}), and the records replay to {replay}, a decision "
                    "it did not take: the requests in flight when it gave up, the slowest, may be missing from them"]
        return [f"{DECISION} is missing, and the records replay to a decision the gateway would have written "
                f"({replay})"]
    try:
        decided = read_model(file, Decided, f"{file} does not exist")
    except UserError as exc:
        return [f"{DECISION} is not the gateway's ({exc})"]
    problems = []
    if decided.design != config.sequential or decided.candidate != config.decides:
        problems.append(f"{DECISION}: the gateway decided {decided.candidate} with another design than config.json "
                        "records")
    again = (report.verdict_when_stopped, report.looks, report.stopped_after_pairs)
    if report.stopped != "decided" or again != (decided.verdict, decided.look, decided.pairs):
        problems.append(f"{DECISION}: the gateway decided {decided.verdict} at look {decided.look} after "
                        f"{decided.pairs} pairs; the records replay to {again[0]} at look {again[1]} after "
                        f"{again[2]} pairs ({report.stopped})")
    elif request_ids[decided.pairs - 1] != decided.last_request_id:
        problems.append(f"{DECISION}: the gateway's last pair was request {decided.last_request_id}, the records' is "
                        f"request {request_ids[decided.pairs - 1]}")
    return problems


def _given_up(path: Path, config: ShadowRunConfig) -> str | None:
    """Why the gateway gave its decision on this folder up (`GivenUp`, for its design and candidate), if it did."""
    try:
        given_up = read_model(path / GIVEN_UP, GivenUp, "")
    except UserError:
        return None
    return given_up.why if given_up.design == config.sequential and given_up.candidate == config.decides else None


def is_shadow_folder(path: Path) -> bool:
    """A folder whose config.json says it holds shadow records (anything else is left to the load test's reader)."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(config, dict) and config.get("kind") == "shadow-run"


@dataclass(frozen=True)
class ShadowJudged:
    verdict: Verdict
    path: Path
    noise_floor: NoiseFloor | None
    notes: list[str]


def incomplete(path: Path, config: ShadowRunConfig, records: Sequence[RequestRecord]) -> list[str]:
    """Why a folder's records are not its whole record; empty when they are."""
    summary_file = path / "summary.json"
    if not summary_file.exists():
        return [f"shadow folder {config.run_id} has no summary.json: it is still being recorded, or the gateway "
                "was killed"]
    summary = read_model(summary_file, Summary, f"{summary_file} does not exist")
    held = Counter(r.arm for r in records)
    problems = [f"shadow folder {config.run_id}: the gateway wrote requests whose records never all came (an "
                "exchange lost behind the recorder's queue, slower than shadow.max_pending later requests, or cut "
                "short by the gateway's stop)"] if summary.interrupted else []
    if summary.run_id != config.run_id:
        problems.append(f"shadow folder {config.run_id}: its summary.json is folder {summary.run_id}'s")
    problems += [f"shadow folder {config.run_id} arm {arm.arm}: requests.jsonl holds {held[arm.arm]} records, "
                f"summary.json counts {arm.requests}" for arm in summary.arms if held[arm.arm] != arm.requests]
    problems += [f"shadow folder {config.run_id}: arm {arm} has records but no summary"
                 for arm in held if arm not in {a.arm for a in summary.arms}]
    primaries = {r.index for r in records if r.arm == config.primary}
    if not summary.interrupted and (orphans := {r.index for r in records if r.arm != config.primary} - primaries):
        problems.append(f"shadow folder {config.run_id}: {len(orphans)} requests have mirrors' records and no "
                        "primary's, which the gateway writes together (edited?)")
    opened_by: dict[int, str] = {}
    for r in records:
        opened_by.setdefault(r.index, r.arm)
    if moved := sum(opened_by[index] != config.primary for index in primaries):
        problems.append(f"shadow folder {config.run_id}: {moved} requests' records do not start with the primary's "
                        f"({config.primary}, config.json), which the gateway writes first (edited?)")
    if (why := unsealed(path / "requests.jsonl", summary.records_sha256)) is not None:
        problems.append(f"shadow folder {config.run_id}: {why}")
    problems += [f"shadow folder {config.run_id}: {line}" for line in impossible_records(records)]
    for why in (unsealed(path / "config.json", summary.config_sha256), summary.unsealed(summary_file)):
        if why is not None:
            problems.append(f"shadow folder {config.run_id}: {why}")
    problems += [f"shadow folder {config.run_id} arm {arm.arm}: summary.json's figures are not those of its records "
                 "in requests.jsonl (edited?)" for arm in summary.arms
                 if held[arm.arm] == arm.requests and figures_differ(arm, [r for r in records if r.arm == arm.arm])]
    return problems


def request_pairs(records: Sequence[RequestRecord], base: str, cand: str) -> tuple[Pairs[RequestRecord], list[str]]:
    """`base` and `cand`'s records paired by request, with what the verdict must say of them; losslessness is judged
    on the greedy requests whose outputs both sides hold (`greedy_held`), however many others are sampled. A request
    recorded twice for one arm is refused."""
    sides: dict[str, list[RequestRecord]] = {base: [], cand: []}
    for r in records:
        if r.arm in sides and not r.cancelled:
            sides[r.arm].append(r)
    for arm, held in sides.items():
        twice = [i for i, n in Counter(r.index for r in held).items() if n > 1]
        if twice:
            raise UserError(f"arm {arm}: request {twice[0]} is recorded {Counter(r.index for r in held)[twice[0]]} "
                            "times; a shadow folder is never judged with duplicated records")
    by_index = {r.index: r for r in sides[cand]}
    paired = [(b, by_index[b.index]) for b in sides[base] if b.index in by_index]
    check_same_request(paired)
    unhashed = any(b.temperature == 0 and c.temperature == 0 and not greedy_held(b, c) for b, c in paired)
    pairs = Pairs.match((base, cand), ((r.index, r.task_id, r) for r in sides[base]),
                        ((r.index, r.task_id, r) for r in sides[cand]),
                        deterministic=all(greedy_held(b, c) for b, c in paired), greedy=greedy_held)
    if not len(pairs):
        raise UserError(f"no request was answered by both {base} and {cand}: nothing to compare")
    alone = [f"{len(sides[arm]) - len(pairs)} of {arm}" for arm in (base, cand) if len(sides[arm]) > len(pairs)]
    said = [NO_HASH] if unhashed else []
    if alone:
        said.append(f"requests recorded without a pair are not judged ({' and '.join(alone)}): not mirrored to "
                    f"{cand} while its arm was down, refused by the gateway's own limit before an arm had them "
                    "(limits.max_concurrent_per_arm), cut short (the primary's client left, or the gateway stopped), "
                    "or written without their other records")
    return pairs, said


def pick_candidate(config: ShadowRunConfig, records: Sequence[RequestRecord], candidate: str | None) -> str:
    arms = [a for a in dict.fromkeys(r.arm for r in records) if a not in (config.primary, config.secondary)]
    if candidate is not None:
        if candidate == config.primary:
            raise FieldError("candidate", f"{candidate} is the primary: a side is never judged against itself")
        if candidate not in arms and candidate != config.secondary:
            raise FieldError("candidate", f"the folder has no mirrored arm named {candidate!r} (its arms: "
                             f"{', '.join(arms)})")
        return candidate
    if len(arms) != 1:
        raise FieldError("candidate", f"the folder has mirrored arms {arms}; name the one to judge")
    return arms[0]


def _side(config: ShadowRunConfig, path: Path, arm: str) -> Side:
    """The arm as its engine described itself; `unknown` where the gateway could not read its `/server_info`."""
    server = arms.server(config, arm)
    info = config.arms.get(arm)
    return Side(run_id=config.run_id, run_dir=str(path.resolve()), name=arm, url=info.url if info else None,
                target=server.model_path if server and server.model_path else "unknown",
                drafter=(server.draft_model_path or "none") if server else f"unknown (shadow arm {arm})",
                simulated=bool(server and server.simulated))


def read_together(records: Sequence[RequestRecord], arms: Iterable[str]) -> list[str]:
    """A note per arm whose chunks surely over `READ_WITH_NEXT_WARNED` came in one read with the next, so carry its
    date: the replica sent them together, or the gateway's loop fell behind (the load tester tells which by its own
    reads' lag; the gateway's records cannot)."""
    notes = []
    for arm in dict.fromkeys(arms):
        together = ReadWithNext.of([r for r in records if r.arm == arm and r.ok])
        if together is not None and together.surely_over(READ_WITH_NEXT_WARNED):
            notes.append(f"{arm}: {together.first_chunks} of {together.of_first_chunks} first chunks and "
                         f"{together.chunks} of {together.of_chunks} chunks came in one read with the next one, so are "
                         "dated by it (the replica sent them together, or the gateway's loop fell behind): TTFT and "
                         "inter-chunk tails may be off by a chunk gap")
    return notes


def untimed(judgement: Judgement, bound: int) -> Judgement:
    """`judgement` with no PASS on a timed rule (`TIMED`): `bound` pairs were left untimed, chosen by how fast the
    baseline streamed, which leaves its faster answers out and flatters the candidate. A FAIL stands: it held
    despite that."""
    rules = tuple(rule.model_copy(update={"status": "INCONCLUSIVE", "detail": f"{rule.detail}; not a PASS: {bound} "
                                          "pairs untimed, held up by a slow client (client_bound)"})
                  if rule.metric in TIMED and rule.status == "PASS" else rule for rule in judgement.rules)
    verdict, needed = overall(rules)
    return judgement.model_copy(update={"rules": rules, "verdict": verdict, "tasks_needed": needed})


def compare_shadow(path: Path, candidate: str | None, gate: Path | None, force: bool, out: Path | None) -> ShadowJudged:
    """Judge a shadow folder's candidate arm against its primary (and its secondary, as the noise floor); write the
    verdict into a new folder under `out` (default: beside the folder)."""
    config = read_model(path / "config.json", ShadowRunConfig, f"{path}: not a shadow record folder")
    rules = read_gate(gate, config.sequential.gate if config.sequential is not None else DEFAULT_GATE)
    check_rules(rules, METRICS, gate)
    records = list(read_records(path / "requests.jsonl"))
    missing = incomplete(path, config, records)
    if missing and not force:
        raise Untrusted("not the whole record: " + "; ".join(missing))
    cand = pick_candidate(config, records, candidate)
    differ = arms.mismatches(config, config.primary, cand)
    if differ and not force:
        raise Untrusted("arms are not comparable (" + "; ".join(differ) + ")")
    no_floor = arms.floor_mismatches(config, config.primary, config.secondary) if config.secondary else []
    if no_floor and not force:
        raise Untrusted("the secondary arm is no noise floor (" + "; ".join(no_floor) + ")")
    differ += no_floor
    if config.sequential is None and (path / DECISION).exists():
        undesigned = f"{DECISION} is there, but config.json records no sequential design it was decided on (edited?)"
        if not force:
            raise Untrusted(f"not the gateway's decision ({undesigned})")
        differ.append(undesigned)
    pairs, notes = request_pairs(records, config.primary, cand)
    if config.sequential is not None and (why := _given_up(path, config)) is not None:
        notes.append(f"the gateway gave its live decision up: {why}; judged after the fact")
    notes += read_together(records, (config.primary, cand, *filter(None, (config.secondary,))))
    if copied(pairs.base, pairs.cand):
        missing.append(f"the records of {cand} are those of {config.primary}, to the microsecond: a drafter judged "
                       "against itself")
        if not force:
            raise Untrusted(missing[-1])
    outcome = (judge_live(pairs, config.sequential, rules)
               if config.sequential is not None and cand == config.decides else FixedN().judge(pairs, METRICS, rules))
    if outcome.sequential is not None:
        tampered = replayed(path, config, outcome.sequential, pairs.index)
        if tampered and not force:
            raise Untrusted("not the gateway's decision (" + "; ".join(tampered) + ")")
        differ += tampered
        if config.sequential is not None and (why := another_gate(config.sequential, rules)) is not None:
            differ.append(why)
            if not force:
                raise Untrusted(why)
    judgement = outcome.judgement
    bound = sum(1 for b, c in zip(pairs.base, pairs.cand, strict=True) if b.client_bound or c.client_bound)
    if bound:
        judgement = untimed(judgement, bound)
        notes.append(f"{bound} of {len(pairs)} pairs were read at a slow client's pace (client_bound) and are not "
                     "timed; which pairs a slow client holds up depends on the baseline's own speed, so no latency "
                     "rule passes on the rest (judge latency on a replay of a capture)")
    floor = None
    if config.secondary is not None:
        floor_pairs, floor_notes = request_pairs(records, config.primary, config.secondary)
        floor = NoiseFloor(secondary=config.secondary, judgement=FixedN().judge(floor_pairs, METRICS, rules).judgement)
        notes += [n for n in floor_notes if n not in notes]
    verdict = Verdict(source="loadtest", verdict=judgement.verdict, baseline=_side(config, path, config.primary),
                      candidate=_side(config, path, cand), forced=bool(differ or missing), mismatches=differ,
                      incomplete=missing,
                      judgement=judgement, gate=rules, provenance=Provenance.here(), sequential=outcome.sequential)
    file = write_verdict(verdict, out or path.parent)
    said = list(notes)
    if floor is not None:
        write_model(file.parent / NOISE_FLOOR, floor)
        said.insert(0, f"Noise floor: {floor.judgement.candidate} against {floor.judgement.baseline}, the same drafter, "
                       f"under the same gate: {floor.judgement.verdict} ({NOISE_FLOOR}).")
    write_verdict_report(verdict, file.parent, said, f"live traffic mirrored by the gateway ({path.name})")
    return ShadowJudged(verdict, file, floor, notes)
