"""Shadow records without a gateway: an exchange as a record, the recorder's pairing, rotation and bound, and the
verdict's refusals and losslessness on live traffic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from dfserve.errors import FieldError, Untrusted, UserError
from dfserve.gateway.config import load_config
from dfserve.gateway.observers import Exchanged, Observers
from dfserve.loadtest.records import read_records
from dfserve.metrics import ObserverMetrics, Outcome
from dfserve.shadow import recorder as recorder_module
from dfserve.shadow.policy import ShadowPolicy
from dfserve.shadow.recorder import ShadowRecorder
from dfserve.shadow.records import error_kind, output_text, request_temperature, shadow_record
from dfserve.shadow.verdict import NO_HASH, compare_shadow


def _native(text: str, tokens: int, verify: int) -> bytes:
    return json.dumps({"text": text, "meta_info": {"completion_tokens": tokens, "spec_verify_ct": verify,
                                                   "prompt_tokens": 3, "finish_reason": {"type": "length"}}}).encode()


def exchanged(rid: int, arm: str, mirror: bool, *, text: str = "out", verify: int = 4, temperature: float = 0,
              error: str | None = None, streamed: bool = False, answer: bytes | None = None) -> Exchanged:
    body = json.dumps({"text": f"prompt {rid % 3}", "sampling_params": {"temperature": temperature}}).encode()
    outcome = Outcome(arm=arm, route="native", replica="r", status=200, error=error, ttft_s=0.01, e2e_s=0.1,
                      output_tokens=16, verify_rounds=verify, accept_length=16 / verify, measure="exact")
    return Exchanged(rid, mirror, "POST", "/generate", b"", body, 100.0 + rid, outcome,
                     answer=_native(text, 16, verify) if answer is None else answer, streamed=streamed)


def test_an_exchange_becomes_the_load_testers_record() -> None:
    record = shadow_record(exchanged(7, "zlab", False, text="hello"), t0_perf_s=100.0)
    assert (record.arm, record.index, record.sent_s, record.first_token_s, record.end_s) == ("zlab", 7, 7.0,
                                                                                           7.01, 7.1)
    assert (record.acceptance, record.spec_verify_ct, record.temperature) == ("exact", 4, 0.0)
    assert record.output_sha256 == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    assert record.task_id == shadow_record(exchanged(10, "x", True), 0).task_id  # the same body: one cluster
    failed = shadow_record(exchanged(1, "zlab", False, error="stream_cut"), 100.0)
    assert failed.error_kind == "disconnect" and failed.output_sha256 is None


def test_outputs_the_gateway_holds() -> None:
    event = b'data: ' + _native("whole so far", 3, 1) + b'\n\ndata: [DONE]\n\n'
    assert output_text("native", event, streamed=True) == "whole so far"
    assert output_text("chat", b'data: {"choices": []}\n\ndata: [DONE]\n\n', streamed=True) is None
    chat = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}
    assert output_text("chat", json.dumps(chat).encode(), streamed=False) == "hi"
    assert output_text("native", b"not json", streamed=False) is None


@pytest.mark.parametrize(("route", "body", "temperature"), [
    ("native", {"sampling_params": {"temperature": 0}}, 0.0), ("native", {"temperature": 0}, 1.0),
    ("chat", {"temperature": 0.7}, 0.7), ("chat", {}, 1.0), ("chat", {"temperature": True}, 1.0)])
def test_a_request_without_a_temperature_is_not_greedy(route: str, body: dict[str, object], temperature: float) -> None:
    assert request_temperature(route, json.dumps(body).encode()) == temperature


def test_error_kinds() -> None:
    assert [error_kind(e, s) for e, s in [(None, 200), (None, 503), ("client_disconnect", 200), ("connect", 502),
                                          ("timeout", 504), ("http_500", 500), ("stream_error", 200)]] == [
        None, "http_status", "cancelled", "connect", "timeout", "http_status", "stream_error"]


def _folders(root: Path) -> list[Path]:
    return sorted(root.iterdir())


def test_recorder_keeps_only_mirrored_requests_and_rotates(tmp_path: Path) -> None:
    recorder = ShadowRecorder(ShadowPolicy(dir=tmp_path, records_per_folder=4, max_folders=2), "zlab")
    recorder.observe(exchanged(0, "zlab", False))          # never mirrored: not recorded
    recorder.observe(exchanged(1, "inhouse", True))         # mirror first, then its primary
    recorder.observe(exchanged(1, "zlab", False))
    recorder.observe(exchanged(2, "zlab", False))
    recorder.observe(exchanged(2, "inhouse", True))         # the fourth record: the folder is closed
    first = _folders(tmp_path)
    assert len(first) == 2 and (first[0] / "summary.json").exists() and not (first[1] / "summary.json").exists()
    assert [(r.index, r.arm) for r in read_records(first[0] / "requests.jsonl")] == [
        (1, "inhouse"), (1, "zlab"), (2, "zlab"), (2, "inhouse")]
    for rid in (3, 4):
        recorder.observe(exchanged(rid, "inhouse", True))
        recorder.observe(exchanged(rid, "zlab", False))
    recorder.observe(exchanged(5, "inhouse", True))         # max_folders reached: recording has stopped
    recorder.close()
    assert len(_folders(tmp_path)) == 2
    assert len(list(read_records(_folders(tmp_path)[1] / "requests.jsonl"))) == 4


def test_records_written_in_batches_are_each_on_disk_once_in_order_and_rotation_flushes(tmp_path: Path) -> None:
    recorder = ShadowRecorder(ShadowPolicy(dir=tmp_path, records_per_folder=6), "zlab")
    seam = Observers(ObserverMetrics.build(CollectorRegistry()))
    seam.add("shadow", recorder)
    for rid in range(10):
        seam.finished(exchanged(rid, "zlab", False))
        seam.finished(exchanged(rid, "inhouse", True))
    seam.close()  # the gateway's stop: every batch flushed, the last folder closed
    folders = _folders(tmp_path)
    written = [(r.index, r.arm) for folder in folders for r in read_records(folder / "requests.jsonl")]
    assert written == [(rid, arm) for rid in range(10) for arm in ("zlab", "inhouse")]
    assert [len((f / "requests.jsonl").read_text().splitlines()) for f in folders] == [6, 6, 6, 2]
    assert all((f / "summary.json").exists() for f in folders)


ENGINES = {"zlab": "http://engine-a", "inhouse": "http://engine-b", "zlab2": "http://engine-c"}
DRAFTERS = {"http://engine-a": "z-lab/dflash", "http://engine-b": "inhouse-0001", "http://engine-c": "z-lab/dflash"}


@pytest.fixture(autouse=True)
def engines(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, object]]:
    """What each arm's engine says of itself (`/server_info`), without a server."""
    infos: dict[str, dict[str, object]] = {url: {"model_path": "Qwen/Qwen3-8B", "max_running_requests": 64,
                                                 "speculative_draft_model_path": drafter}
                                           for url, drafter in DRAFTERS.items()}
    monkeypatch.setattr(recorder_module, "server_info", lambda url: infos.get(url))
    return infos


def _recording(tmp_path: Path, exchanges: list[Exchanged], secondary: str | None = None) -> ShadowRecorder:
    recorder = ShadowRecorder(ShadowPolicy(dir=tmp_path / "shadow", secondary=secondary), "zlab", ENGINES)
    for e in exchanges:
        recorder.observe(e)
    recorder.flush()  # as the gateway's observer thread does after each batch
    return recorder


def _record(tmp_path: Path, exchanges: list[Exchanged], secondary: str | None = None) -> Path:
    _recording(tmp_path, exchanges, secondary).close()
    return _folders(tmp_path / "shadow")[0]


def _traffic(n: int, cand_verify: int, temperature: float = 0, cand_text: str = "out") -> list[Exchanged]:
    return [e for rid in range(n) for e in (exchanged(rid, "zlab", False, temperature=temperature),
                                            exchanged(rid, "inhouse", True, verify=cand_verify, text=cand_text,
                                                      temperature=temperature))]


def test_compare_fails_a_worse_candidate_and_reports_the_noise_floor(tmp_path: Path) -> None:
    traffic = _traffic(30, cand_verify=8) + [exchanged(rid, "zlab2", True) for rid in range(30)]
    judged = compare_shadow(_record(tmp_path, traffic, secondary="zlab2"), None, None, False, tmp_path / "v")
    assert judged.verdict.verdict == "FAIL" and judged.verdict.judgement.pairs == 30
    assert judged.verdict.candidate.name == "inhouse" and judged.verdict.baseline.name == "zlab"
    assert (judged.verdict.baseline.drafter, judged.verdict.candidate.drafter) == ("z-lab/dflash", "inhouse-0001")
    assert judged.verdict.candidate.target == "Qwen/Qwen3-8B" and not judged.verdict.forced
    assert judged.noise_floor is not None and judged.noise_floor.judgement.candidate == "zlab2"
    assert judged.noise_floor.judgement.verdict != "FAIL"
    assert (judged.path.parent / "noise-floor.json").exists()


def test_losslessness_on_live_traffic(tmp_path: Path) -> None:
    differing = compare_shadow(_record(tmp_path / "a", _traffic(30, 4, cand_text="other")), None, None, False,
                               tmp_path / "v")
    lossless = next(r for r in differing.verdict.judgement.rules if r.metric == "lossless_fraction")
    assert lossless.status == "FAIL"
    sampled = compare_shadow(_record(tmp_path / "b", _traffic(30, 4, temperature=0.7, cand_text="other")), None,
                             None, False, tmp_path / "v")
    lossless = next(r for r in sampled.verdict.judgement.rules if r.metric == "lossless_fraction")
    assert lossless.status == "NOT_APPLICABLE" and sampled.verdict.verdict == "PASS"


def test_greedy_openai_streams_make_losslessness_not_applicable_and_say_why(tmp_path: Path) -> None:
    stream_end = b'data: {"choices": []}\n\ndata: [DONE]\n\n'
    traffic = [e for rid in range(30) for e in (exchanged(rid, "zlab", False),
                                                exchanged(rid, "inhouse", True, streamed=True, answer=stream_end))]
    judged = compare_shadow(_record(tmp_path, traffic), None, None, False, tmp_path / "v")
    assert judged.notes == [NO_HASH]
    assert next(r for r in judged.verdict.judgement.rules if r.metric == "lossless_fraction").status == "NOT_APPLICABLE"


def test_refusals(tmp_path: Path) -> None:
    recording = _recording(tmp_path / "a", _traffic(10, 4))
    open_folder = _folders(tmp_path / "a" / "shadow")[0]
    with pytest.raises(Untrusted, match=r"no summary\.json"):
        compare_shadow(open_folder, None, None, False, tmp_path / "v")
    assert compare_shadow(open_folder, None, None, True, tmp_path / "v").verdict.forced
    recording.close()
    folder = _record(tmp_path / "b", _traffic(10, 4))
    with pytest.raises(FieldError, match="never judged against itself"):
        compare_shadow(folder, "zlab", None, False, tmp_path / "v")
    requests = folder / "requests.jsonl"
    lines = requests.read_text().splitlines()
    requests.write_text("\n".join([*lines, lines[0]]) + "\n")
    with pytest.raises(Untrusted, match=r"requests\.jsonl holds 11 records, summary\.json counts 10"):
        compare_shadow(folder, None, None, False, tmp_path / "v")
    with pytest.raises(UserError, match="recorded 2 times"):
        compare_shadow(folder, None, None, True, tmp_path / "v")


def test_arms_whose_engines_differ_or_are_unknown_are_refused_unless_forced(
        tmp_path: Path, engines: dict[str, dict[str, object]]) -> None:
    engines["http://engine-b"]["model_path"] = "Qwen/Qwen3-4B"
    folder = _record(tmp_path / "a", _traffic(10, 4))
    with pytest.raises(Untrusted, match="server model_path: Qwen/Qwen3-8B vs Qwen/Qwen3-4B"):
        compare_shadow(folder, None, None, False, tmp_path / "v")
    forced = compare_shadow(folder, None, None, True, tmp_path / "v").verdict
    assert forced.forced and forced.mismatches == ["server model_path: Qwen/Qwen3-8B vs Qwen/Qwen3-4B"]
    del engines["http://engine-b"]
    with pytest.raises(Untrusted, match="arm inhouse: its /server_info was not recorded"):
        compare_shadow(_record(tmp_path / "b", _traffic(10, 4)), None, None, False, tmp_path / "v")


def test_shadow_config_needs_shadow_mode_and_a_mirrored_secondary() -> None:
    arms = {"a": {"weight": 1, "replicas": ["http://127.0.0.1:1"]}, "b": {"weight": 1, "replicas": ["http://127.0.0.1:2"]}}
    with pytest.raises(UserError, match="need mode: shadow"):
        load_config(None, {"routing.arms": arms, "shadow.dir": "/tmp/x"})
    with pytest.raises(UserError, match=r"shadow\.secondary"):
        load_config(None, {"routing.arms": arms, "routing.mode": "shadow", "routing.primary": "a",
                           "shadow.dir": "/tmp/x", "shadow.secondary": "a"})
    config = load_config(None, {"routing.arms": arms, "routing.mode": "shadow", "routing.primary": "a",
                                "shadow.dir": "/tmp/x", "shadow.secondary": "b", "capture.dir": "/tmp/c"})
    assert config.shadow is not None and config.shadow.secondary == "b" and config.capture is not None
