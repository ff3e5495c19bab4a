"""The live decision without a gateway: which mirrored pairs a look sees (the complete prefix of request ids, whatever
order the exchanges finish in), the stop, and `dfserve compare` replaying it from the folder."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from dfserve.deploy.hashes import file_sha256
from dfserve.errors import FieldError, Untrusted, UserError
from dfserve.gateway.app import Gateway
from dfserve.gateway.config import load_config
from dfserve.gateway.observers import Exchanged, Observers
from dfserve.loadtest.records import read_records
from dfserve.loadtest.report import Summary
from dfserve.metrics import GATEWAY_OVERLOADED, SHADOW_DECISION_STATES, ObserverMetrics, ShadowDecisionMetrics
from dfserve.shadow.monitor import DECISION, GIVEN_UP, Decided, DecidingRecorder, LiveDecision
from dfserve.shadow.policy import ShadowPolicy
from dfserve.shadow.recorder import ShadowRecorder
from dfserve.shadow.verdict import compare_shadow, live_design
from dfserve.verdict.gate import Gate, Rule
from tests.unit import test_shadow
from tests.unit.test_shadow import ENGINES, exchanged

engines = test_shadow.engines  # every arm's /server_info, without a server
ARMS = ("zlab", "inhouse")


def request(rid: int, cand_verify: int = 8, mirrored: bool = True, cand_error: str | None = None,
            temperature: float = 0, cand_text: str = "out") -> tuple[Exchanged, Exchanged]:
    """A client's exchange on the primary and its mirror's on the candidate; every request a task of its own."""
    body = json.dumps({"text": f"task {rid}", "sampling_params": {"temperature": temperature}}).encode()
    primary = replace(exchanged(rid, "zlab", False, verify=4 + rid % 3, temperature=temperature), body=body,
                      mirrors=("inhouse",) if mirrored else ())
    mirror = replace(exchanged(rid, "inhouse", True, verify=cand_verify + rid % 5, error=cand_error,
                               temperature=temperature, text=cand_text), body=body)
    return primary, mirror


class Stops:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def deciding(tmp_path: Path, look_every: int = 4, max_pending: int = 10_000, records_per_folder: int = 10_000,
             gate: Gate | None = None) -> tuple[DecidingRecorder, ShadowDecisionMetrics, Stops]:
    policy = ShadowPolicy(dir=tmp_path / "shadow", until_decided=True, look_every=look_every,
                          max_pending=max_pending, records_per_folder=records_per_folder)
    live = live_design(policy, ARMS, "zlab")
    assert live is not None
    design = live[0] if gate is None else live[0].model_copy(update={"gate": gate})
    metrics = ShadowDecisionMetrics.build(CollectorRegistry())
    stops = Stops()
    recorder = ShadowRecorder(policy, "zlab", ENGINES, (design, "inhouse"))
    return DecidingRecorder(recorder, LiveDecision(design, "inhouse", 2 * max_pending), metrics, stops), metrics, stops


def state(metrics: ShadowDecisionMetrics) -> str:
    [on] = [s for s in SHADOW_DECISION_STATES if metrics.state.labels(s)._value.get() == 1]
    return on


ACCEPTANCE = Gate(rules=(Rule(metric="accept_length", max_worse=0.02),))


def test_a_look_sees_only_the_complete_prefix_of_request_ids(tmp_path: Path) -> None:
    decider, metrics, _ = deciding(tmp_path, look_every=1)
    first, first_mirror = request(0)
    decider.observe(first)
    for rid in range(1, 6):                      # later requests finish on both arms before request 0's mirror
        for e in request(rid):
            decider.observe(e)
    assert decider.decision.pairs == 0 and metrics.pairs._value.get() == 0
    decider.observe(first_mirror)                # the prefix closes: six pairs, taken in id order
    assert decider.decision.pairs == 6 and decider.decision.last_request_id == 5
    assert state(metrics) == "deciding"
    decider.close()


def test_a_pair_waits_for_its_requests_secondary_and_is_taken_once_its_records_are_written(tmp_path: Path) -> None:
    """With a noise-floor arm, a request's records are written when its secondary's exchange has come too: the
    candidate's pair is taken then, not lost."""
    decider, _, _ = deciding(tmp_path, look_every=1)
    for rid in range(3):
        primary, mirror = request(rid)
        decider.observe(replace(primary, mirrors=("inhouse", "zlab2")))
        decider.observe(mirror)
    assert decider.decision.pairs == 0
    for rid in range(3):
        decider.observe(exchanged(rid, "zlab2", True))
    assert (decider.decision.pairs, decider.decision.last_request_id) == (3, 2)
    decider.close()


def test_a_mirror_skipped_for_its_down_arm_is_a_pair_whose_candidate_failed_with_a_secondary_too(
        tmp_path: Path) -> None:
    """Its failure record is written once the secondary's exchange comes: the request waits for it, as any, rather
    than being known at once as no pair (the live decision then PASSed on errors its folder FAILs)."""
    decider, _, _ = deciding(tmp_path, look_every=1)
    for rid in range(3):
        decider.observe(replace(request(rid)[0], mirrors=("zlab2",), skipped=("inhouse",)))
    assert decider.decision.pairs == 0
    for rid in range(3):
        decider.observe(exchanged(rid, "zlab2", True))
    assert decider.decision.pairs == 3 and decider.decision.monitor is not None
    decider.close()


def test_a_pair_held_up_by_a_slow_client_gives_a_gate_of_latency_up_live(tmp_path: Path) -> None:
    """Which pairs a slow client holds up depends on the baseline's speed: a latency rule cannot be decided on the
    rest, live or after."""
    decider, metrics, _ = deciding(tmp_path, look_every=1)
    primary, mirror = request(0)
    decider.observe(replace(primary, paused_s=0.05))
    decider.observe(mirror)
    assert state(metrics) == "abandoned" and "slow client" in (decider.decision.gave_up or "")
    decider.close()
    acceptance, metrics, _ = deciding(tmp_path / "acceptance", look_every=1, gate=ACCEPTANCE)
    for e in (replace(primary, paused_s=0.05), mirror):
        acceptance.observe(e)
    assert state(metrics) == "deciding"
    acceptance.close()


def test_requests_never_mirrored_or_left_by_their_client_are_no_pairs_and_a_failed_mirror_is_one(
        tmp_path: Path) -> None:
    decider, _, _ = deciding(tmp_path, look_every=1)
    decider.observe(request(0, mirrored=False)[0])           # never mirrored: known at once, holds nothing
    for e in request(1, cand_error="connect"):                # the candidate failed: a pair, an error
        decider.observe(e)
    primary, mirror = request(2)
    decider.observe(replace(primary, outcome=replace(primary.outcome, error="client_disconnect")))
    decider.observe(mirror)                                   # the client left: cancelled, no pair
    for e in request(3):
        decider.observe(e)
    assert (decider.decision.pairs, decider.decision.last_request_id) == (2, 3)
    decider.close()


def _traffic(n: int, cand_verify: int = 8) -> list[Exchanged]:
    return [e for rid in range(n) for e in request(rid, cand_verify)]


def _decide(tmp_path: Path, exchanges: list[Exchanged]) -> tuple[DecidingRecorder, ShadowDecisionMetrics, Stops]:
    decider, metrics, stops = deciding(tmp_path, gate=ACCEPTANCE)
    for e in exchanges:
        decider.observe(e)
    decider.close()
    return decider, metrics, stops


def test_a_worse_candidate_is_decided_whatever_order_exchanges_finish_in(tmp_path: Path) -> None:
    in_order = _traffic(80)
    shuffled = in_order[:]
    random.Random(7).shuffle(shuffled)       # out-of-order completions, mirrors before their primaries included
    decisions = []
    for name, exchanges in (("ordered", in_order), ("shuffled", shuffled)):
        decider, metrics, stops = _decide(tmp_path / name, exchanges)
        decided = decider.decision.decision
        assert decided is not None and decided.verdict == "FAIL" and state(metrics) == "fail"
        assert stops.calls == 1
        decisions.append((decided.look, decided.pairs, decided.last_request_id))
    assert decisions[0] == decisions[1]
    assert decisions[0][1] < 80                   # decided before the traffic ran out


def test_once_decided_the_folder_is_complete_nothing_more_is_recorded_and_compare_agrees(tmp_path: Path) -> None:
    _, _, stops = _decide(tmp_path, _traffic(80))
    [folder] = sorted((tmp_path / "shadow").iterdir())
    decided = Decided.model_validate_json((folder / DECISION).read_text())
    assert (folder / "summary.json").exists() and stops.calls == 1
    recorded = {r.index for r in read_records(folder / "requests.jsonl")}
    assert max(recorded) == decided.last_request_id        # exchanges after the decision went nowhere
    judged = compare_shadow(folder, None, None, False, tmp_path / "v")
    verdict = judged.verdict
    assert verdict.verdict == "FAIL" and not verdict.forced
    assert verdict.sequential is not None and verdict.sequential.live
    assert (verdict.sequential.looks, verdict.sequential.stopped_after_pairs) == (decided.look, decided.pairs)
    assert verdict.sequential.design.gate == ACCEPTANCE


LOSSLESS = Gate(rules=(Rule(metric="lossless_fraction", at_least=0.99),))


def test_losslessness_is_judged_on_the_greedy_pairs_of_mixed_traffic(tmp_path: Path) -> None:
    """A candidate that changes greedy outputs fails however much sampled traffic is mixed in; only traffic with
    no greedy pair leaves losslessness unjudged (and nothing decided, the gate's only rule)."""
    differing = [e for rid in range(80) for e in request(rid, 4, cand_text="other")]
    decider, _, _ = deciding(tmp_path / "greedy", gate=LOSSLESS)
    for e in differing:
        decider.observe(e)
    decider.close()
    assert decider.decision.decision is not None and decider.decision.decision.verdict == "FAIL"
    mixed = [e for rid in range(80) for e in request(rid, 4, cand_text="other", temperature=0.7 if rid % 2 else 0)]
    decider, _, _ = deciding(tmp_path / "mixed", gate=LOSSLESS)
    for e in mixed:
        decider.observe(e)
    decider.close()
    assert decider.decision.decision is not None and decider.decision.decision.verdict == "FAIL"
    [folder] = sorted((tmp_path / "mixed" / "shadow").iterdir())
    verdict = compare_shadow(folder, None, None, False, tmp_path / "v").verdict
    assert verdict.judgement.verdict == "FAIL" and not verdict.forced  # the replayed looks reach the same decision
    lossless = verdict.judgement.lossless  # the fixed-n table beside it: of the greedy pairs too
    assert lossless is not None and lossless.applicable and lossless.greedy_of == verdict.judgement.pairs
    assert lossless.pairs and lossless.identical == 0 and lossless.differing_tasks
    detail = next(r.detail for r in verdict.judgement.rules)
    assert f"identical over {len(lossless.differing_tasks)} tasks (the greedy pairs of {verdict.judgement.pairs})" in detail
    sampled = [e for rid in range(80) for e in request(rid, 4, cand_text="other", temperature=0.7)]
    decider, metrics, _ = deciding(tmp_path / "sampled", gate=LOSSLESS)
    for e in sampled:
        decider.observe(e)
    decider.close()
    assert decider.decision.decision is None and state(metrics) == "abandoned"  # by the stop, still undecided
    [folder] = sorted((tmp_path / "sampled" / "shadow").iterdir())
    verdict = compare_shadow(folder, None, None, False, tmp_path / "v").verdict
    assert [r.status for r in verdict.judgement.rules] == ["NOT_APPLICABLE"] and not verdict.forced
    assert verdict.judgement.verdict == "INCONCLUSIVE"


def test_a_live_decision_awaits_greedy_requests_before_it_passes(tmp_path: Path) -> None:
    """Sampled requests first, on which the candidate's acceptance is better: greedy ones may still come, so the
    gate is not passed on acceptance alone; the greedy requests that came, whose outputs differ, fail it."""
    gate = Gate(rules=(*ACCEPTANCE.rules, *LOSSLESS.rules))
    decider, metrics, stops = deciding(tmp_path, gate=gate)
    for rid in range(80):
        for e in request(rid, 1, temperature=0.7):
            decider.observe(e)
    latest = decider.decision.monitor.latest
    assert decider.decision.decision is None and state(metrics) == "deciding" and not stops.calls
    assert latest is not None and [r.status for r in latest.rules] == ["PASS", "INCONCLUSIVE"]
    assert "no greedy pair yet in 80 pairs" in latest.rules[1].detail
    for rid in range(80, 200):
        for e in request(rid, 1, cand_text="other"):
            decider.observe(e)
    decider.close()
    decided = decider.decision.decision
    assert decided is not None and decided.verdict == "FAIL" and decided.pairs > 80 and stops.calls == 1
    [folder] = sorted((tmp_path / "shadow").iterdir())
    verdict = compare_shadow(folder, None, None, False, tmp_path / "v").verdict
    assert verdict.judgement.verdict == "FAIL" and not verdict.forced and verdict.sequential is not None
    assert verdict.sequential.stopped_after_pairs == decided.pairs


def _edit_config(folder: Path, change: Callable[[dict[str, Any]], object]) -> None:
    """config.json edited, and summary.json's seal of it with it: what the checks past the seal must still catch."""
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    summary = Summary.model_validate_json((folder / "summary.json").read_text())
    resealed = summary.model_copy(update={"config_sha256": file_sha256(folder / "config.json")}).sealed()
    (folder / "summary.json").write_text(resealed.model_dump_json())


def test_compare_refuses_a_decided_folder_whose_design_was_edited(tmp_path: Path) -> None:
    _decide(tmp_path, _traffic(80))
    [folder] = sorted((tmp_path / "shadow").iterdir())
    _edit_config(folder, lambda config: config["sequential"].update(look_every=3))
    with pytest.raises(Untrusted, match=r"decision\.json: the gateway decided FAIL at look"):
        compare_shadow(folder, None, None, False, tmp_path / "v")
    assert compare_shadow(folder, None, None, True, tmp_path / "v").verdict.forced


def test_a_decided_folder_is_judged_on_its_designs_gate_and_its_decision_must_be_there(tmp_path: Path) -> None:
    """Where the gateway stopped was its gate's decision: another gate (given, or written into config.json with
    decision.json deleted) would judge a sample sized for a different question."""
    _decide(tmp_path, _traffic(80))
    [folder] = sorted((tmp_path / "shadow").iterdir())
    loose = tmp_path / "loose.yaml"
    loose.write_text("rules:\n  - {metric: error_rate, max_worse: 0.5}\n")
    with pytest.raises(Untrusted, match="stopped on their sequential design's gate"):
        compare_shadow(folder, None, loose, False, tmp_path / "v")
    forced = compare_shadow(folder, None, loose, True, tmp_path / "v").verdict
    assert forced.forced and any("sequential design's gate" in line for line in forced.mismatches)
    _edit_config(folder, lambda config: config["sequential"].update(
        gate={"rules": [{"metric": "error_rate", "max_worse": 0.5}]}))
    (folder / DECISION).unlink()
    with pytest.raises(Untrusted, match=r"decision\.json is missing, and the records replay to a decision"):
        compare_shadow(folder, None, None, False, tmp_path / "v")


def test_compare_refuses_a_folder_whose_primary_was_edited(tmp_path: Path) -> None:
    _decide(tmp_path, _traffic(80))
    [folder] = sorted((tmp_path / "shadow").iterdir())
    config = json.loads((folder / "config.json").read_text())
    config["primary"] = "inhouse"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(Untrusted, match=r"requests' records do not start with the primary's \(inhouse"):
        compare_shadow(folder, "zlab", None, False, tmp_path / "v")


def test_compare_refuses_a_decision_that_names_another_last_pair(tmp_path: Path) -> None:
    _decide(tmp_path, _traffic(80))
    [folder] = sorted((tmp_path / "shadow").iterdir())
    decided = Decided.model_validate_json((folder / DECISION).read_text())
    edited = decided.model_copy(update={"last_request_id": decided.last_request_id + 1})
    (folder / DECISION).write_text(edited.model_dump_json())
    with pytest.raises(Untrusted, match=rf"last pair was request {decided.last_request_id + 1}"):
        compare_shadow(folder, None, None, False, tmp_path / "v")


def test_a_folder_closed_undecided_gives_the_decision_up(tmp_path: Path) -> None:
    """Deciding afresh on each folder would give a candidate no better than the baseline another chance at a PASS
    with each: the decision is the first folder's, and the next carries no design (judged as a fixed sample)."""
    decider, metrics, stops = deciding(tmp_path, look_every=1, records_per_folder=8)
    for rid in range(3):                          # six records in the first folder
        for e in request(rid):
            decider.observe(e)
    (primary3, mirror3), (primary4, mirror4) = request(3), request(4)
    decider.observe(mirror3)                      # mirrors first: their records wait for their primaries'
    decider.observe(mirror4)
    decider.observe(primary4)                     # request 4, the seventh and eighth records: the folder rotates
    decider.observe(primary3)                     # request 3 pairs in the next folder
    for rid in range(5, 7):
        for e in request(rid):
            decider.observe(e)
    decider.flush()
    folders = sorted((tmp_path / "shadow").iterdir())
    held = [[(r.index, r.arm) for r in read_records(folder / "requests.jsonl")] for folder in folders]
    assert held == [[(rid, arm) for rid in (0, 1, 2, 4) for arm in ARMS], [(rid, arm) for rid in (3, 5, 6)
                                                                           for arm in ARMS]]
    assert len(folders) == 2 and decider.decision.folder == folders[0]
    assert stops.calls == 0 and state(metrics) == "abandoned" and decider.decision.decision is None
    designs = [json.loads((folder / "config.json").read_text())["sequential"] for folder in folders]
    assert designs[0] is not None and designs[1] is None
    decider.close()


def test_a_lost_mirror_is_written_unpaired_later_and_the_decision_is_given_up(tmp_path: Path) -> None:
    """Request 0's mirror is lost: four requests later the recorder writes it without it, and its folder is then
    incomplete (compare refuses it unforced): the live decision, which would have decided on it, is given up."""
    decider, metrics, stops = deciding(tmp_path, look_every=1, max_pending=4)
    decider.observe(request(0)[0])
    for rid in range(1, 7):
        for e in request(rid):
            decider.observe(e)
    assert state(metrics) == "abandoned" and stops.calls == 0 and decider.decision.decision is None
    decider.close()
    [folder] = sorted((tmp_path / "shadow").iterdir())
    assert json.loads((folder / "summary.json").read_text())["interrupted"] is True
    with pytest.raises(Untrusted, match="never all came"):
        compare_shadow(folder, None, None, False, tmp_path / "v")


def test_a_request_never_recorded_gives_the_decision_up(tmp_path: Path) -> None:
    """Request 0's exchanges are all lost: nothing of it is ever written, and the decision gives up once twice
    max_pending requests wait behind it."""
    decider, metrics, stops = deciding(tmp_path, max_pending=4)
    for rid in range(1, 11):
        for e in request(rid):
            decider.observe(e)
    assert decider.decision.state == "abandoned" and state(metrics) == "abandoned" and stops.calls == 0
    assert decider.decision.gave_up is not None and decider.decision.gave_up.startswith("request 0 was never")
    decider.close()


def test_recording_stopped_at_max_folders_gives_the_decision_up(tmp_path: Path) -> None:
    policy = ShadowPolicy(dir=tmp_path / "shadow", until_decided=True, look_every=16, records_per_folder=2,
                          max_folders=1)
    live = live_design(policy, ARMS, "zlab")
    assert live is not None
    metrics = ShadowDecisionMetrics.build(CollectorRegistry())
    recorder = ShadowRecorder(policy, "zlab", ENGINES, live)
    decider = DecidingRecorder(recorder, LiveDecision(live[0], "inhouse", 8), metrics, Stops())
    for rid in range(3):
        for e in request(rid):
            decider.observe(e)
    assert recorder.stopped and decider.decision.state == "abandoned" and state(metrics) == "abandoned"
    decider.close()


def test_gates_and_arms_the_live_decision_refuses(tmp_path: Path) -> None:
    itl = tmp_path / "gate.yaml"
    itl.write_text("rules: [{metric: itl_per_token_p95, max_worse: 0.05}]\n")
    with pytest.raises(FieldError, match=r"^shadow\.gate: rule itl_per_token_p95: .*many dependent samples"):
        live_design(ShadowPolicy(dir=tmp_path, until_decided=True, gate=itl), ARMS, "zlab")
    with pytest.raises(FieldError, match=r"^shadow\.until_decided: .*shadow\.secondary"):
        live_design(ShadowPolicy(dir=tmp_path, until_decided=True), ("zlab", "inhouse", "zlab2"), "zlab")
    assert live_design(ShadowPolicy(dir=tmp_path, until_decided=True, secondary="zlab2"),
                       ("zlab", "inhouse", "zlab2"), "zlab") is not None
    arms = {"a": {"weight": 1, "replicas": ["http://x"]}, "b": {"weight": 1, "replicas": ["http://y"]}}
    with pytest.raises(Exception, match=r"shadow\.gate, shadow\.look_every: only with shadow\.until_decided"):
        load_config(None, {"routing.arms": arms, "routing.mode": "shadow", "routing.primary": "a",
                           "shadow.dir": "/tmp/x", "shadow.look_every": 4})


def test_a_routing_change_does_not_mirror_again() -> None:
    arms = {"a": {"weight": 1, "replicas": ["http://x"]}, "b": {"weight": 1, "replicas": ["http://y"]}}
    config = load_config(None, {"routing.arms": arms, "routing.mode": "shadow", "routing.primary": "a"})
    gateway = Gateway(config)
    assert gateway.mirroring
    gateway.stop_mirroring()                     # not started: no loop to hand it to, so at once
    gateway.apply(config.routing.model_copy(update={"shadow_fraction": 0.5}))
    assert not gateway.mirroring


def test_a_running_gateway_refuses_routing_that_makes_the_noise_floor_the_primary(tmp_path: Path) -> None:
    """As its config file refuses it at start: the floor would be judged against itself (a floor of zero width). Nor
    may an arm move to other engines while the folders describe the old ones."""
    arms = {name: {"weight": 1, "replicas": [f"http://{name}"]} for name in ("a", "b", "a2")}
    config = load_config(None, {"routing.arms": arms, "routing.mode": "shadow", "routing.primary": "a",
                                "shadow.dir": str(tmp_path), "shadow.secondary": "a2"})
    gateway = Gateway(config)
    with pytest.raises(UserError, match=r"^shadow\.secondary: 'a2' is the noise floor, and cannot be the primary"):
        gateway.apply(config.routing.model_copy(update={"primary": "a2"}))
    shared = {**config.routing.arms, "a2": config.routing.arms["a2"].model_copy(
        update={"replicas": ("http://b", "HTTP://A:80/")})}
    with pytest.raises(UserError, match=r"^shadow\.secondary: arm 'a2' is served by the primary's replica a:80"):
        gateway.apply(config.routing.model_copy(update={"arms": shared}))
    assert gateway.routing.primary == "a" and gateway.routing.arms["a2"].replicas == ("http://a2",)
    moved = {**config.routing.arms, "b": config.routing.arms["b"].model_copy(update={"replicas": ("http://a",)})}
    with pytest.raises(UserError, match=r"^routing\.arms\.b\.replicas: shadow records describe each arm's engines"):
        gateway.apply(config.routing.model_copy(update={"arms": moved}))  # the candidate on the primary's engine
    gateway.apply(config.routing.model_copy(update={"arms": {n: a for n, a in config.routing.arms.items() if n != "b"}}))
    with pytest.raises(UserError, match=r"^routing\.arms\.b\.replicas"):  # dropped, then back on another engine
        gateway.apply(config.routing.model_copy(update={"arms": moved}))
    respelled = {**config.routing.arms, "b": config.routing.arms["b"].model_copy(update={"replicas": ("HTTP://B:80/",)})}
    gateway.apply(config.routing.model_copy(update={"arms": respelled}))
    gateway.apply(config.routing.model_copy(update={"mode": "split", "primary": None}))  # mirroring stopped: allowed
    with pytest.raises(UserError, match=r"is served by the primary's replica"):
        load_config(None, {"routing.arms": shared, "routing.mode": "shadow", "routing.primary": "a",
                           "shadow.dir": str(tmp_path), "shadow.secondary": "a2"})


def test_a_deciding_recorder_writes_each_batch_its_lane_hands_it(tmp_path: Path) -> None:
    """Through the observers' seam, as the gateway runs it: each batch's records reach the disk when the lane
    flushes, not only when the folder closes."""
    decider, _, _ = deciding(tmp_path)
    seam = Observers(ObserverMetrics.build(CollectorRegistry()))
    seam.add("shadow", decider)
    for rid in range(3):
        for exchange in request(rid):
            seam.finished(exchange)
    [folder] = sorted((tmp_path / "shadow").iterdir())
    deadline = time.monotonic() + 10
    while len((folder / "requests.jsonl").read_bytes().splitlines()) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len((folder / "requests.jsonl").read_bytes().splitlines()) == 6
    assert not (folder / "summary.json").exists()  # written, and the folder still open
    seam.close()
    assert (folder / "summary.json").exists()


@pytest.mark.parametrize("damage", ["garbage", "folder", "design dropped"])
def test_a_damaged_decision_or_one_without_its_design_is_judged_only_forced(tmp_path: Path, damage: str) -> None:
    """A decision.json that cannot be read, or a config.json whose design was removed (so the stopped-early
    sample would be judged as a fixed-size one): refused, and --force judges it stamped."""
    _decide(tmp_path, _traffic(80))
    [folder] = sorted((tmp_path / "shadow").iterdir())
    if damage == "garbage":
        (folder / DECISION).write_text("{not json")
    elif damage == "folder":
        (folder / DECISION).unlink()
        (folder / DECISION).mkdir()
    else:
        _edit_config(folder, lambda config: config.update(sequential=None, decides=None))
    said = "decision.json is not the gateway's" if damage != "design dropped" else "records no sequential design"
    with pytest.raises(Untrusted, match=said):
        compare_shadow(folder, None, None, False, tmp_path / "v")
    forced = compare_shadow(folder, None, None, True, tmp_path / "v").verdict
    assert forced.forced and any(said in line for line in forced.mismatches)


def test_a_mirror_refused_by_the_gateways_own_limit_gives_the_decision_up(tmp_path: Path) -> None:
    """A slow candidate's mirrors are refused when it is busiest (max_concurrent_per_arm): the pairs left would favour
    it, and compare refuses the folder unforced; the gateway never decides PASS on it."""
    decider, metrics, stops = deciding(tmp_path, look_every=1)
    for rid in range(40):
        primary, mirror = request(rid, cand_verify=4, cand_error=GATEWAY_OVERLOADED if rid == 2 else None)
        decider.observe(primary)
        decider.observe(mirror)
    assert state(metrics) == "abandoned" and stops.calls == 0 and decider.decision.decision is None
    decider.close()


@pytest.mark.parametrize(("drafters", "secondary", "refused"), [
    ({"http://engine-b": "z-lab/dflash"}, None, "both sides serve drafter 'z-lab/dflash'"),
    ({"http://engine-c": "inhouse-0001"}, "zlab2", "noise floor zlab2 serves drafter 'inhouse-0001'"),
    ({}, "zlab", "noise floor zlab2 is the primary's own engine"),
    ({}, "zlab2", None),
])
def test_the_live_decision_refuses_arms_compare_would_refuse(
        tmp_path: Path, engines: dict[str, dict[str, object]], drafters: dict[str, str], secondary: str | None,
        refused: str | None) -> None:
    """The candidate on the primary's drafter, or a secondary arm on another drafter than the primary's or on the
    primary's own engine (`secondary` "zlab": arm zlab2 is given zlab's replica): compare refuses the folder
    unforced, so the gateway gives its decision up rather than stop mirroring on a PASS."""
    replicas = dict(ENGINES)
    if secondary == "zlab":  # the primary's engine, spelled otherwise
        secondary, replicas["zlab2"] = "zlab2", "HTTP://ENGINE-A:80"
        engines[replicas["zlab2"]] = engines[ENGINES["zlab"]]
    for url, drafter in drafters.items():
        engines[url]["speculative_draft_model_path"] = drafter
    policy = ShadowPolicy(dir=tmp_path / "shadow", until_decided=True, look_every=1, secondary=secondary)
    arms = ("zlab", "inhouse", *((secondary,) if secondary else ()))
    live = live_design(policy, arms, "zlab")
    assert live is not None
    metrics = ShadowDecisionMetrics.build(CollectorRegistry())
    recorder = ShadowRecorder(policy, "zlab", {arm: replicas[arm] for arm in arms}, live)
    decider = DecidingRecorder(recorder, LiveDecision(live[0], "inhouse", 100), metrics, Stops())
    for rid in range(40):
        primary, mirror = request(rid, cand_verify=12)
        decider.observe(replace(primary, mirrors=arms[1:]))
        decider.observe(mirror)
        if secondary:
            decider.observe(replace(exchanged(rid, secondary, True, verify=4 + rid % 3), body=primary.body))
    decider.close()
    assert state(metrics) == ("abandoned" if refused else "fail")
    if refused:
        [folder] = sorted((tmp_path / "shadow").iterdir())
        with pytest.raises(Untrusted, match=refused):
            compare_shadow(folder, "inhouse", None, False, tmp_path / "v")


def test_a_folder_made_incomplete_by_the_write_that_fills_it_is_not_decided_on(tmp_path: Path) -> None:
    """Request 71's mirror is lost: four requests later it is written unpaired into the folder, which that write
    fills; the prefix then runs through requests already in that closed folder, and deciding on them would write a
    decision beside a summary that says `interrupted` (compare refuses it): the decision is given up."""
    lost = 71
    decider, metrics, stops = deciding(tmp_path, look_every=1, max_pending=4, records_per_folder=2 * lost + 9)
    for rid in range(120):
        primary, mirror = request(rid, cand_verify=4)
        decider.observe(primary)
        if rid != lost:
            decider.observe(mirror)
    decider.close()
    assert state(metrics) == "abandoned" and stops.calls == 0 and decider.decision.decision is None
    first = sorted((tmp_path / "shadow").iterdir())[0]
    assert json.loads((first / "summary.json").read_text())["interrupted"] and not (first / DECISION).exists()


def test_a_folder_whose_decision_was_given_up_says_why_and_is_judged_only_forced(tmp_path: Path) -> None:
    """Request 0's mirror comes only after the first folder filled: the live looks never got past it, while the
    folder's own pairs, without request 0 (the slowest), replay to a FAIL the gateway never took. Compare says the
    gateway gave up and why (decision-given-up.json), and judges the folder only forced; without that file the folder
    reads as a decision removed."""
    decider, metrics, stops = deciding(tmp_path, look_every=1, records_per_folder=200, gate=ACCEPTANCE)
    primary0, mirror0 = request(0)
    decider.observe(primary0)
    for rid in range(1, 101):
        for e in request(rid):
            decider.observe(e)
    decider.observe(mirror0)
    decider.close()
    assert state(metrics) == "abandoned" and stops.calls == 0
    first = sorted((tmp_path / "shadow").iterdir())[0]
    given_up = json.loads((first / GIVEN_UP).read_text())
    assert given_up["why"].startswith(f"record folder {first.name} was closed before the gate was decided")
    with pytest.raises(Untrusted, match=r"the gateway gave its live decision up \(record folder .* was closed .*\), "
                                        r"and the records replay to FAIL at look \d+, a decision it did not take"):
        compare_shadow(first, None, None, False, tmp_path / "v")
    judged = compare_shadow(first, None, None, True, tmp_path / "v")
    assert judged.verdict.verdict == "FAIL" and judged.verdict.forced
    (first / GIVEN_UP).unlink()
    with pytest.raises(Untrusted, match=r"decision\.json is missing, and the records replay to a decision"):
        compare_shadow(first, None, None, False, tmp_path / "v2")


def test_a_gateway_stopped_before_the_decision_says_it_gave_up(tmp_path: Path) -> None:
    """Request 0's mirror is still in flight at the stop: the live looks never got past it, while the pairs written
    replay to a FAIL. The decision is given up as any other (state, log line, decision-given-up.json), and compare
    says so, judging the folder only forced."""
    decider, metrics, _ = deciding(tmp_path, look_every=1, gate=ACCEPTANCE)
    decider.observe(request(0)[0])
    for rid in range(1, 101):
        for e in request(rid):
            decider.observe(e)
    decider.close()
    [folder] = sorted((tmp_path / "shadow").iterdir())
    assert json.loads((folder / GIVEN_UP).read_text())["why"] == "the gateway stopped before the gate was decided"
    assert state(metrics) == "abandoned"
    with pytest.raises(Untrusted, match=r"gave its live decision up \(the gateway stopped before the gate was decided\)"):
        compare_shadow(folder, None, None, False, tmp_path / "v")


def test_a_new_primary_before_the_first_record_gives_the_decision_up(tmp_path: Path) -> None:
    """The first folder, which alone carries the design, closes empty (and is removed) when the primary changes
    before any request finished: the decision is given up, never taken in a folder without its design."""
    decider, metrics, stops = deciding(tmp_path, look_every=1, gate=ACCEPTANCE)
    for rid in range(100):
        primary, mirror = request(rid)
        decider.observe(replace(primary, outcome=replace(primary.outcome, arm="zlab2")))
        decider.observe(mirror)
    decider.close()
    assert state(metrics) == "abandoned" and stops.calls == 0 and decider.decision.decision is None
    assert not any((folder / DECISION).exists() for folder in (tmp_path / "shadow").iterdir())


def test_a_given_up_folder_whose_records_decide_nothing_says_why_beside_its_verdict(tmp_path: Path) -> None:
    decider, _, _ = deciding(tmp_path, look_every=1, gate=ACCEPTANCE)
    for rid in range(3):
        for e in request(rid):
            decider.observe(e)
    decider.close()
    [folder] = sorted((tmp_path / "shadow").iterdir())
    judged = compare_shadow(folder, None, None, False, tmp_path / "v")
    assert judged.verdict.verdict == "INCONCLUSIVE" and not judged.verdict.forced
    assert ("the gateway gave its live decision up: the gateway stopped before the gate was decided; judged after "
            "the fact") in judged.notes
    assert "gave its live decision up" in (judged.path.parent / "report.html").read_text()
