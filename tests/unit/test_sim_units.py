"""The simulator's pure parts without sockets: profiles, acceptance math, latency, output text, faults, scheduler."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from dfserve import sglang as proto
from dfserve.cli import main
from dfserve.deploy.sim.acceptance import (
    RoundModel,
    confidence_interval,
    difficulty_exponent,
    prompt_difficulty,
    request_accept_length_moments,
)
from dfserve.deploy.sim.app import build_app
from dfserve.deploy.sim.config import SimConfig
from dfserve.deploy.sim.engine import Engine, EngineSettings, SimRequest
from dfserve.deploy.sim.faults import FaultConfig, FaultPlan
from dfserve.deploy.sim.latency import LatencyModel, LatencyParams
from dfserve.deploy.sim.profiles import DrafterProfile, load_profile
from dfserve.deploy.sim.stamps import StampedStreamEncoder
from dfserve.deploy.sim.telemetry import DECODE_LOG_INTERVAL, RoundRecord, Telemetry
from dfserve.deploy.sim.text import Limits, TextModel, Vocabulary, render_chat
from dfserve.errors import FieldError, UserError
from dfserve.sglang import FinishReason
from dfserve.sglang import server as engine


@pytest.fixture(scope="module")
def vocabulary() -> Vocabulary:
    return Vocabulary.load()


def zlab() -> DrafterProfile:
    profile = load_profile("zlab")
    assert profile is not None
    return profile


# --- profiles ------------------------------------------------------------------------------------------------


def test_builtin_profiles_have_the_documented_mean_acceptance() -> None:
    grid = np.linspace(0, 1, 401)
    means = {}
    for name in ("zlab", "inhouse"):
        profile = load_profile(name)
        assert profile is not None and profile.block_size == 16
        means[name] = float(np.mean([RoundModel.build(profile, d).expected_tokens for d in grid]))
    assert 8.5 < means["zlab"] < 9.5 and 5.5 < means["inhouse"] < 6.5
    assert load_profile("none") is None


def test_profiles_load_from_json_and_bad_files_name_the_problem(tmp_path: Path) -> None:
    good = tmp_path / "mine.json"
    good.write_text(json.dumps({"name": "mine", "block_size": 4, "conditional_accept": [0.9, 0.8, 0.7]}))
    assert load_profile(str(good)) == DrafterProfile(name="mine", block_size=4, conditional_accept=(0.9, 0.8, 0.7))
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"name": "s", "block_size": 4, "conditional_accept": [0.9]}))
    with pytest.raises(UserError, match=r"short.json: .*needs 3"):
        load_profile(str(short))
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"name": "w", "block_size": 3, "conditional_accept": [0.9, 1.5]}))
    with pytest.raises(UserError, match="conditional_accept"):
        load_profile(str(wrong))
    with pytest.raises(UserError, match="no such file"):
        load_profile(str(tmp_path / "missing.json"))
    with pytest.raises(UserError, match="neither"):
        load_profile("eagle")
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(b'{"name": "caf\xe9"}')
    with pytest.raises(UserError, match=r"latin1.json: not UTF-8 text \(byte 13\)"):
        load_profile(str(latin1))
    (tmp_path / "folder.json").mkdir()
    with pytest.raises(UserError, match=r"folder.json: cannot read \(Is a directory\)"):
        load_profile(str(tmp_path / "folder.json"))


def test_a_shorter_block_keeps_the_leading_positions() -> None:
    short = zlab().with_block_size(8)
    assert short.block_size == 8 and short.conditional_accept == zlab().conditional_accept[:7]
    with pytest.raises(FieldError, match=r"^block_size: 32 is outside 2\.\.16"):
        zlab().with_block_size(32)


# --- acceptance ----------------------------------------------------------------------------------------------


def test_difficulty_is_stable_and_shared_by_every_drafter() -> None:
    assert prompt_difficulty("def f():") == prompt_difficulty("def f():")
    assert prompt_difficulty("def f():") != prompt_difficulty("def g():")
    assert difficulty_exponent(0.0) == 0.5 and difficulty_exponent(1.0) == 2.0
    easy, hard = RoundModel.build(zlab(), 0.0), RoundModel.build(zlab(), 0.99)
    assert easy.expected_tokens > hard.expected_tokens


def test_sampled_rounds_match_the_exact_distribution() -> None:
    model = RoundModel.build(zlab(), 0.4)
    rng = random.Random(1)
    draws = np.array([model.sample_accepted(rng) + 1 for _ in range(40_000)])
    dist = model.token_distribution()
    assert dist.sum() == pytest.approx(1.0)
    assert abs(draws.mean() - model.expected_tokens) < 4 * draws.std() / np.sqrt(len(draws))
    counts = np.bincount(draws, minlength=17)[1:]
    assert np.all(np.abs(counts / len(draws) - dist) < 0.01)


def test_request_moments_match_a_monte_carlo_of_the_same_process() -> None:
    model = RoundModel.build(zlab(), 0.7)
    tokens = 40
    mean, var = request_accept_length_moments(model, tokens)
    rng = random.Random(2)
    ratios = []
    for _ in range(20_000):
        produced, rounds = 1, 0
        while produced < tokens:
            produced += model.sample_accepted(rng) + 1
            rounds += 1
        ratios.append(tokens / rounds)
    assert mean == pytest.approx(float(np.mean(ratios)), abs=0.03)
    assert var == pytest.approx(float(np.var(ratios)), rel=0.05)
    low, high = confidence_interval([mean] * 4, [var] * 4)
    assert low < mean < high and high - low == pytest.approx(2 * 1.96 * np.sqrt(4 * var) / 4)


# --- latency -------------------------------------------------------------------------------------------------


def test_latency_defaults_scale_and_seeded_jitter() -> None:
    flat = LatencyModel(LatencyParams(jitter=0), time_scale=1, rng=random.Random(0))
    assert flat.round_s(1, 16) == pytest.approx(0.02988)
    assert flat.round_s(48, 16) == pytest.approx(0.027 + 0.00018 * 48 * 16)
    assert flat.prefill_s(1000) > flat.prefill_s(10)
    fast = LatencyModel(LatencyParams(jitter=0), time_scale=0.01, rng=random.Random(0))
    assert fast.round_s(1, 16) == pytest.approx(0.0002988)
    a = [LatencyModel(LatencyParams(), 1, random.Random(5)).round_s(8, 16) for _ in range(2)]
    b = LatencyModel(LatencyParams(), 1, random.Random(6)).round_s(8, 16)
    assert a[0] == a[1] != b and abs(b / flat.round_s(8, 16) - 1) < 0.2
    with pytest.raises(ValueError):
        LatencyModel(LatencyParams(), 0, random.Random(0))


# --- text ----------------------------------------------------------------------------------------------------


def test_output_depends_on_prompt_and_sampling_only(vocabulary: Vocabulary) -> None:
    model = TextModel(vocabulary)

    def run(prompt: str, key: str, chunks: list[int]) -> tuple[str, list[int]]:
        stream = model.start(prompt, key, Limits(max_new_tokens=60, ignore_eos=True))
        stream.first_token()
        for n in chunks:
            stream.take(n)
        return stream.text, stream.ids

    assert run("p", "", [16] * 4) == run("p", "", [1, 15, 5, 30, 9])  # round sizes (the drafter) never matter
    assert run("p", "", [60]) != run("q", "", [60])
    assert run("p", '{"temperature": 0.7}', [60]) != run("p", "", [60])


def test_max_new_tokens_stop_strings_stop_ids_and_eos(vocabulary: Vocabulary) -> None:
    model = TextModel(vocabulary)
    stream = model.start("p", "", Limits(max_new_tokens=10, ignore_eos=True))
    assert stream.take(50) == 10 and stream.finish == FinishReason(kind="length", length=10)
    full = model.start("p", "", Limits(max_new_tokens=300, ignore_eos=True))
    full.take(300)
    stop = full.text[30:33]
    cut = model.start("p", "", Limits(max_new_tokens=300, stop=(stop,), ignore_eos=True))
    seen = []
    while cut.finish is None:
        cut.take(3)
        seen.append(cut.text)
    assert cut.finish == FinishReason(kind="stop", matched=stop) and cut.text == full.text[: full.text.index(stop)]
    assert all(cut.text.startswith(s) for s in seen)  # held-back text never has to be taken back
    kept = model.start("p", "", Limits(max_new_tokens=300, stop=(stop,), ignore_eos=True, no_stop_trim=True))
    kept.take(300)
    assert kept.text.startswith(cut.text + stop)
    natural = model.start("p", "", Limits(max_new_tokens=100_000))
    natural.take(100_000)
    assert natural.finish == FinishReason(kind="stop", matched=vocabulary.eos_id) and natural.ids[-1] == vocabulary.eos_id
    token = full.ids[5]
    by_id = model.start("p", "", Limits(max_new_tokens=300, stop_token_ids=(token,), ignore_eos=True))
    by_id.take(300)
    assert by_id.finish == FinishReason(kind="stop", matched=token) and len(by_id.ids) <= 6
    zero = model.start("p", "", Limits(max_new_tokens=0))
    zero.first_token()
    assert zero.finish == FinishReason(kind="length", length=0) and zero.ids == []


def test_lossy_outputs_differ_at_about_the_configured_rate(vocabulary: Vocabulary) -> None:
    clean, lossy = TextModel(vocabulary), TextModel(vocabulary, lossy_fraction=0.25)
    prompts = [f"prompt {i}" for i in range(400)]

    def text(model: TextModel, prompt: str) -> str:
        stream = model.start(prompt, "", Limits(max_new_tokens=16, ignore_eos=True))
        stream.take(16)
        return stream.text

    differs = sum(text(clean, p) != text(lossy, p) for p in prompts)
    assert 70 <= differs <= 130  # Binomial(400, 0.25): mean 100, sd 8.7
    assert differs == sum(lossy.is_lossy(p, "") for p in prompts)
    with pytest.raises(FieldError, match=r"^lossy_fraction: 1\.5 is outside \[0, 1\]$"):
        TextModel(vocabulary, lossy_fraction=1.5)


def test_prompt_tokens_come_from_the_qwen_tokenizer(vocabulary: Vocabulary) -> None:
    assert vocabulary.count("def add(a, b):") == 6
    chat = render_chat([("user", "hi")])
    assert chat.endswith("<|im_start|>assistant\n") and vocabulary.count(chat) == 9  # im_start user NL hi im_end NL im_start assistant NL


# --- faults --------------------------------------------------------------------------------------------------


def test_fault_plan_rates_and_replay() -> None:
    config = FaultConfig(error_rate=0.1, stall_fraction=0.2, disconnect_fraction=0.3)
    first = FaultPlan(config, random.Random(9)).draw()
    plan = FaultPlan(config, random.Random(9))
    many = [plan.draw() for _ in range(5000)]
    assert many[0] == first  # the same seed replays the same faults
    assert 0.08 < sum(d.error for d in many) / 5000 < 0.12
    assert 0.17 < sum(d.stall_after_chunk is not None for d in many) / 5000 < 0.23
    assert {d.disconnect_after_chunk for d in many} == {None, 1, 2, 3}
    assert FaultPlan(FaultConfig(), random.Random(0)).draw().error is False


def test_telemetry_refreshes_acceptance_on_sglangs_decode_log_interval() -> None:
    """Like SGLang's scheduler: decode rounds only, and the gauge and /server_info's running figure move once every
    DECODE_LOG_INTERVAL rounds, not per round."""
    registry = CollectorRegistry()
    telemetry = Telemetry(registry, "m", 400_000)
    gauge = {"model_name": "m", "engine_type": "unified", "tp_rank": "0"}
    for _ in range(DECODE_LOG_INTERVAL - 1):
        telemetry.round(RoundRecord(tokens=36, verify_calls=4, correct_drafts=32, proposed_drafts=60, duration_s=0.03),
                        [])
    assert telemetry.avg_spec_accept_length is None
    assert registry.get_sample_value("sglang:spec_accept_length", gauge) == 0
    telemetry.round(RoundRecord(tokens=4, verify_calls=4, correct_drafts=0, proposed_drafts=60, duration_s=0.03), [])
    expected = (36 * 39 + 4) / (4 * 40)
    assert telemetry.avg_spec_accept_length == pytest.approx(expected)
    assert registry.get_sample_value("sglang:spec_accept_length", gauge) == pytest.approx(expected)
    telemetry.round(RoundRecord(tokens=64, verify_calls=4, correct_drafts=60, proposed_drafts=60, duration_s=0.03), [])
    assert telemetry.avg_spec_accept_length == pytest.approx(expected)  # the next interval has not ended


def test_a_request_without_a_verify_round_has_no_spec_fields_and_the_histogram_grows_as_sglangs() -> None:
    request = SimRequest(rid="r", prompt_tokens=1, output=None, round_model=RoundModel.build(zlab(), 0.5),  # type: ignore[arg-type]
                         rng=random.Random(0), arrived_s=0.0)
    assert request.spec_stats() is None
    request.verify_ct, request.correct_drafts, request.histogram = 2, 5, [0, 0, 1, 1]
    stats = request.spec_stats()
    assert stats is not None and stats.correct_drafts_histogram == (0, 0, 1, 1) and stats.num_proposed_drafts == 30


# --- scheduler -----------------------------------------------------------------------------------------------


def test_scheduler_caps_running_requests_and_queue_time_shows_in_ttft(vocabulary: Vocabulary) -> None:
    async def scenario() -> tuple[int, list[float]]:
        telemetry = Telemetry(CollectorRegistry(), "m", 400_000)
        latency = LatencyModel(LatencyParams(jitter=0), 0.1, random.Random(0))
        engine = Engine(EngineSettings(max_running_requests=4), zlab(), latency, telemetry, seed=0)
        runner = asyncio.create_task(engine.run())
        text = TextModel(vocabulary)
        requests = [
            engine.submit(prompt=f"p{i}", sampling_key="", prompt_tokens=10,
                          output=text.start(f"p{i}", "", Limits(max_new_tokens=40, ignore_eos=True)))
            for i in range(10)
        ]
        peak = 0
        while any(r.finished_s is None for r in requests):
            peak = max(peak, engine.running)
            await asyncio.sleep(0.0005)
        runner.cancel()
        return peak, [r.queue_time_s for r in requests]

    peak, queued = asyncio.run(scenario())
    assert peak == 4
    assert max(queued[:4]) * 3 < min(queued[4:])  # the rest wait for a prefill and the first four's rounds


def test_abort_request_finishes_a_running_request_at_its_next_step_and_counts_as_sglang_does(
        vocabulary: Vocabulary) -> None:
    """SGLang's `/abort_request`: a running request runs one more step and finishes with `FINISH_ABORT()`, one still
    waiting leaves the queue with no output; the counter rises once per call that aborts something (once for
    `abort_all`, even with nothing to abort), never for a rid it does not hold, never twice for one request."""
    async def scenario() -> tuple[list[float | None], list[FinishReason | None]]:
        registry = CollectorRegistry()
        telemetry = Telemetry(registry, "m", 400_000)
        engine_ = Engine(EngineSettings(max_running_requests=1), zlab(), LatencyModel(
            LatencyParams(jitter=0), 0.05, random.Random(0)), telemetry, seed=0)
        runner = asyncio.create_task(engine_.run())
        text = TextModel(vocabulary)
        limits = Limits(max_new_tokens=100_000, ignore_eos=True)
        running, waiting = (engine_.submit(prompt=p, sampling_key="", prompt_tokens=3, output=text.start(p, "", limits),
                                           rid=p) for p in ("running", "waiting"))
        while (await running.updates.get()) is None or running.verify_ct < 2:
            pass
        counts = []
        produced = len(running.output.ids)
        for rid, abort_all in (("unknown", False), ("waiting", False), ("running", False), ("running", False),
                               ("", True)):
            engine_.abort(rid, abort_all)
            counts.append(registry.get_sample_value("sglang:num_aborted_requests_total",
                                                    {"model_name": "m", "engine_type": "unified", "tp_rank": "0"}))
        updates = []
        while not updates or not updates[-1].finished:
            updates.append(await running.updates.get())
        waited = waiting.updates.get_nowait()
        runner.cancel()
        assert waited.finished and waited.completion_tokens == 0
        assert updates[-1].completion_tokens > produced  # one more step, its tokens kept
        return counts, [running.finish, waiting.finish]

    counts, finishes = asyncio.run(scenario())
    assert counts == [0, 1, 2, 2, 3]
    assert finishes == [engine.ABORTED, engine.ABORTED_WAITING]
    assert engine.finish_reason_body(engine.ABORTED) == {"type": "abort", "message": "Aborted", "status_code": None,
                                                         "err_type": None}  # FINISH_ABORT().to_json()


def test_a_final_chunk_stamped_at_send_time_matches_the_builder_byte_for_byte() -> None:
    meta = engine.meta_info_body(rid="r", finish=FinishReason(kind="length", length=2), prompt_tokens=1,
                                completion_tokens=2)
    meta[proto.SIM_CHUNK_DUE_KEY] = [1.5, 2.25]
    event = engine.sse_event(engine.generate_response_body(' "é"', [1, 2], meta))
    sent = [1764505000.123456, 1764505000.2]
    expected = engine.sse_event(engine.generate_response_body(' "é"', [1, 2], {**meta, proto.SIM_CHUNK_SENT_KEY: sent}))
    encoder = StampedStreamEncoder(incremental=False)
    encoder.encode_sent_times(sent[:1])  # ahead of time, as the sim does while it computes a step
    assert encoder.with_sent_times(event, sent) == expected
    assert StampedStreamEncoder(incremental=False).with_sent_times(event, sent) == expected
    with pytest.raises(ValueError, match="meta_info"):
        encoder.with_sent_times(event + proto.SSE_DONE, sent)


def test_sim_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError):
        SimConfig(time_scale=0)
    with pytest.raises(ValueError, match="less than or equal to 1000"):
        SimConfig(time_scale=1e308)  # accepted, every request then seemed to hang
    with pytest.raises(ValueError):
        SimConfig(lossy_fraction=2)
    with pytest.raises(ValueError, match="at least 1 character"):
        SimConfig(served_model_name="")  # served as the model path's name instead
    assert SimConfig(profile="none").resolved_draft_model_path() is None
    assert SimConfig().resolved_draft_model_path() == "z-lab/Qwen3.6-27B-DFlash"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--profile", "bogus"], "--profile: 'bogus' is neither"),
        (["--lossy-fraction", "2"], "--lossy-fraction:"),
        (["--time-scale", "0"], "--time-scale:"),
        (["--block-size", "40"], "--block-size: 40 is outside"),
        (["--stall-s", "-1"], "--stall-s:"),
    ],
)
def test_sim_command_turns_bad_flags_into_one_line(argv: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["sim", "--port", "0", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("dfserve: error: ") and message in err and len(err.strip().splitlines()) == 1


def test_a_huge_prompt_is_counted_off_the_event_loop_while_health_checks_answer(vocabulary: Vocabulary) -> None:
    rng = random.Random(29)
    letters = "abcdefghijklmnopqrstuvwxyz"
    prompt = " ".join("".join(rng.choices(letters, k=rng.randint(3, 9))) for _ in range(60_000))
    app = build_app(SimConfig(port=0, profile="zlab", context_length=4096), load_profile("zlab"), vocabulary)

    async def scenario() -> tuple[int, bool, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim") as client:
            huge = asyncio.create_task(client.post("/generate", json={"text": prompt}))
            for _ in range(5):
                await asyncio.sleep(0)
            health = await client.get("/health")
            return health.status_code, huge.done(), await huge

    health, huge_done_first, answer = asyncio.run(scenario())
    assert (health, huge_done_first) == (200, False)
    assert answer.status_code == 400 and "longer than the model's context length (4096 tokens)" in answer.text
