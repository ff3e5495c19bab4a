"""The simulated engine over real HTTP on loopback: every route, SGLang's shapes, acceptance, batching, faults."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from dfserve import metrics as names
from dfserve import sglang as proto
from dfserve.deploy.sim.acceptance import (
    RoundModel,
    confidence_interval,
    prompt_difficulty,
    request_accept_length_moments,
)
from dfserve.deploy.sim.config import SimConfig
from dfserve.deploy.sim.profiles import load_profile
from dfserve.deploy.sim.server import uvicorn_config
from dfserve.errors import ProtocolError
from dfserve.listen import bind
from tests.integration.servers import LOOPBACK, sim_server, url_of

SCALE = 0.02


@pytest.fixture(scope="module")
def zlab() -> Iterator[str]:
    with sim_server("zlab", SCALE, 0, "--record-chunk-times") as base:
        yield base


def native_stream(base: str, body: dict) -> list[proto.NativeChunk]:
    decoder = proto.SSEDecoder()
    events: list[str] = []
    with httpx.stream("POST", f"{base}/generate", json={**body, "stream": True}, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for raw in response.iter_raw():
            events.extend(decoder.feed(raw))
    assert events[-1] == proto.DONE and not decoder.pending
    chunks = [proto.parse_native_event(e) for e in events[:-1]]
    assert all(isinstance(c, proto.NativeChunk) for c in chunks)
    return chunks  # type: ignore[return-value]


def metric_samples(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_native_stream_deltas_sum_to_completion_tokens_and_final_chunk_has_spec(zlab: str) -> None:
    chunks = native_stream(zlab, {"text": "def fib(n):", "sampling_params": {"max_new_tokens": 80, "temperature": 0}})
    final = chunks[-1].meta
    counts = [c.meta.completion_tokens for c in chunks]
    assert counts == sorted(set(counts)) and counts[-1] == final.completion_tokens
    assert final.spec is not None
    assert len(chunks) == final.spec.verify_ct + 1  # the prefill chunk, then one chunk per verify round
    assert all(c.meta.spec is None and c.meta.e2e_latency_s is None for c in chunks[:-1])
    assert final.spec is not None and final.e2e_latency_s is not None and final.e2e_latency_s > 0
    assert final.accept_length == pytest.approx(final.completion_tokens / final.spec.verify_ct)
    assert max(b - a for a, b in itertools.pairwise(counts)) <= 16 and final.simulated and all(c.meta.simulated for c in chunks)
    assert chunks[-1].text.startswith(chunks[-2].text)  # cumulative text by default
    sent, due = final.sim_chunk_sent_unix_s or (), final.sim_chunk_due_unix_s or ()
    assert len(sent) == len(chunks) == len(due) and list(sent) == sorted(sent)
    assert all(s >= d for s, d in zip(sent, due, strict=True))  # a chunk leaves once its step has ended


def test_native_whole_response_matches_the_stream(zlab: str) -> None:
    body = {"text": "def is_prime(n):", "sampling_params": {"max_new_tokens": 50, "temperature": 0}}
    streamed = native_stream(zlab, body)[-1]
    whole = proto.parse_generate_response(httpx.post(f"{zlab}/generate", json=body, timeout=30).content)[0]
    assert whole.text == streamed.text and whole.meta.completion_tokens == streamed.meta.completion_tokens
    assert whole.output_ids is not None and len(whole.output_ids) == whole.meta.completion_tokens
    assert whole.meta.spec is not None and whole.meta.finish_reason is not None
    assert whole.meta.accept_length == whole.meta.completion_tokens / whole.meta.spec.verify_ct
    sent, due = whole.meta.sim_chunk_sent_unix_s, whole.meta.sim_chunk_due_unix_s
    assert sent is not None and due is not None and len(sent) == len(due) == 1 and sent[0] >= due[0]


def test_max_new_tokens_and_stop_strings_finish_like_sglang(zlab: str) -> None:
    long = {"text": "a", "sampling_params": {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}}
    result = proto.parse_generate_response(httpx.post(f"{zlab}/generate", json=long, timeout=30).content)[0]
    assert result.meta.finish_reason == proto.FinishReason(kind="length", length=30)
    assert result.meta.completion_tokens == 30
    full = proto.parse_generate_response(httpx.post(
        f"{zlab}/generate", json={"text": "b", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True,
                                                                   "temperature": 0}}, timeout=30).content)[0].text
    stop = full[20:23]
    cut = {"text": "b", "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True,
                                            "stop": [stop]}}
    stopped = proto.parse_generate_response(httpx.post(f"{zlab}/generate", json=cut, timeout=30).content)[0]
    assert stopped.meta.finish_reason == proto.FinishReason(kind="stop", matched=stop)
    assert stopped.text == full[: full.index(stop)]


def test_chat_return_meta_info_and_streamed_chat_with_usage(zlab: str) -> None:
    messages = [{"role": "user", "content": "Write a function that reverses a list."}]
    body = proto.chat_body("m", messages, proto.SamplingParams(max_new_tokens=40), stream=False,
                           return_meta_info=True)
    whole = proto.parse_openai_response(httpx.post(f"{zlab}/v1/chat/completions", json=body, timeout=30).content)
    assert whole.meta is not None and whole.meta.spec is not None and whole.usage is not None
    assert whole.meta.completion_tokens == whole.usage.completion_tokens
    assert whole.finish_reason is not None and whole.finish_reason.kind in ("stop", "length")

    body = proto.chat_body("m", messages, proto.SamplingParams(max_new_tokens=40), stream=True, include_usage=True)
    decoder, text, usage, finish = proto.SSEDecoder(), "", None, None
    with httpx.stream("POST", f"{zlab}/v1/chat/completions", json=body, timeout=30) as response:
        events = [e for raw in response.iter_raw() for e in decoder.feed(raw)]
    assert events[-1] == proto.DONE
    for event in events[:-1]:
        chunk = proto.parse_openai_event(event)
        assert isinstance(chunk, proto.OpenAIChunk)
        text += chunk.text
        usage = chunk.usage or usage
        finish = chunk.finish_reason or finish
    assert text == whole.text and usage == whole.usage and finish == whole.finish_reason
    assert '"spec_verify_ct"' not in "".join(events)  # streamed chat exposes no spec fields, like SGLang


def test_streamed_chat_ends_with_its_chunk_times_in_a_comment_sse_clients_skip(zlab: str) -> None:
    body = proto.chat_body("m", [{"role": "user", "content": "Sort a list."}], proto.SamplingParams(max_new_tokens=40),
                           stream=True)
    with httpx.stream("POST", f"{zlab}/v1/chat/completions", json=body, timeout=30) as response:
        raw = b"".join(response.iter_raw())
    times = proto.parse_sim_times_comment(raw)
    assert times is not None and raw.endswith(proto.SSE_DONE)
    assert len(times.sent_unix_s) == len(times.due_unix_s) == proto.CONTENT_CHUNKS.read(raw) > 2
    assert list(times.sent_unix_s) == sorted(times.sent_unix_s) and times.queue_time_s >= 0
    assert all(sent >= due - 0.005 for sent, due in zip(times.sent_unix_s, times.due_unix_s, strict=True))
    events = proto.SSEDecoder().feed(raw)
    assert events[-1] == proto.DONE and not any("dfserve" in event for event in events)


def test_sim_times_comment_round_trips_and_rejects_a_broken_one() -> None:
    times = proto.SimStreamTimes((1.5, 2.25), (1.0, 2.0), 0.125)
    events = b'data: {"choices":[]}\n\n' + proto.sim_times_comment(times) + proto.SSE_DONE
    assert proto.parse_sim_times_comment(events) == times
    assert proto.parse_sim_times_comment(b'data: {"choices":[]}\n\n' + proto.SSE_DONE) is None
    with pytest.raises(ProtocolError, match="sim times"):
        proto.parse_sim_times_comment(proto.SIM_TIMES_COMMENT + b'{"queue_time": 1}\n\n')


def test_completions_whole_and_streamed(zlab: str) -> None:
    body = {"model": "m", "prompt": "def sort(xs):", "max_tokens": 30, "stream": False}
    whole = proto.parse_openai_response(httpx.post(f"{zlab}/v1/completions", json=body, timeout=30).content)
    assert whole.usage is not None and whole.meta is None
    body = {"model": "m", "prompt": "def sort(xs):", "max_tokens": 30, "stream": True}
    decoder = proto.SSEDecoder()
    with httpx.stream("POST", f"{zlab}/v1/completions", json=body, timeout=30) as response:
        events = [e for raw in response.iter_raw() for e in decoder.feed(raw)]
    streamed = "".join(c.text for c in map(proto.parse_openai_event, events[:-1]) if isinstance(c, proto.OpenAIChunk))
    assert streamed == whole.text and events[-1] == proto.DONE


def test_an_openai_answer_is_dated_when_its_request_came_in_every_chunk(zlab: str) -> None:
    """As SGLang stamps `created`: the request's time, not the engine's start (which /v1/models gives)."""
    time.sleep(1.1)
    asked = int(time.time())
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{zlab}/v1/chat/completions", json=body, timeout=30) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert chunks and {chunk["created"] for chunk in chunks} <= {asked, asked + 1}
    assert httpx.get(f"{zlab}/v1/models", timeout=10).json()["data"][0]["created"] < asked


def test_info_routes_describe_a_simulated_dflash_engine(zlab: str) -> None:
    assert httpx.get(f"{zlab}/health").status_code == 200
    assert httpx.get(f"{zlab}/health_generate", timeout=30).status_code == 200
    info = httpx.get(f"{zlab}/server_info").json()
    parsed = proto.parse_server_info(info)
    assert parsed.speculative_algorithm == "DFLASH" and parsed.simulated and parsed.max_running_requests == 48
    assert parsed.draft_model_path == "z-lab/Qwen3.6-27B-DFlash" and info["speculative_num_draft_tokens"] == 16
    assert info["internal_states"][0]["avg_spec_accept_length"] > 1
    assert httpx.get(f"{zlab}/get_server_info").json()["speculative_algorithm"] == "DFLASH"
    assert proto.first_model_id(httpx.get(f"{zlab}/v1/models").json()) == "Qwen/Qwen3.6-27B"
    model_info = httpx.get(f"{zlab}/model_info").json()
    assert model_info["model_path"] == "Qwen/Qwen3.6-27B" and model_info["is_generation"] is True
    assert httpx.post(f"{zlab}/flush_cache").status_code == 200


def test_metrics_carry_sglang_names_and_labels(zlab: str) -> None:
    native_stream(zlab, {"text": "metrics", "sampling_params": {"max_new_tokens": 20}})
    text = httpx.get(f"{zlab}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (names.SGLANG_GENERATION_TOKENS, names.SGLANG_PROMPT_TOKENS, names.SGLANG_SPEC_VERIFY_CALLS,
                 names.SGLANG_NUM_REQUESTS, names.SGLANG_TTFT, names.SGLANG_ITL, names.SGLANG_E2E,
                 names.SGLANG_QUEUE_TIME, names.SGLANG_NUM_RUNNING_REQS, names.SGLANG_NUM_QUEUE_REQS,
                 names.SGLANG_SPEC_ACCEPT_LENGTH):
        family = families[name.removesuffix("_total")]
        assert family.samples, name
        assert family.samples[0].labels.get("model_name") == "Qwen/Qwen3.6-27B"
        assert set(names.SGLANG_LABELS) <= set(family.samples[0].labels)
    samples = metric_samples(zlab)
    assert samples["sglang:generation_tokens_total"] / samples["sglang:spec_verify_calls_total"] > 1


@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        ("/generate", b"{not json", "JSON decode error"),
        ("/generate", b'{"text": "x", "sampling_params": {"max_tokens": 5}}', "unknown field `max_tokens`"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "max_tokens": 0}', "max_tokens must be positive"),
        ("/generate", b'{"sampling_params": {}}', "Either text, input_ids"),
        ("/generate", b'{"text": "x", "sampling_params": {"max_new_tokens": -1}}', "max_new_tokens must be"),
        ("/v1/chat/completions", b'{"model": "m"}', "messages"),
        ("/v1/chat/completions",
         b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": true, "return_meta_info": true}',
         "return_meta_info is not supported with streaming"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "temperature": -1}', "temperature"),
    ],
)
def test_bad_input_gets_a_400_with_a_message(zlab: str, route: str, body: bytes, message: str) -> None:
    response = httpx.post(f"{zlab}{route}", content=body, timeout=10)
    assert response.status_code == 400
    assert message in proto.parse_error_message(response.content)


def test_lone_surrogates_are_refused_with_400s_and_leave_the_engine_serving(zlab: str) -> None:
    for _ in range(3):
        response = httpx.post(f"{zlab}/generate", content=rb'{"text": "\ud800", "stream": true}', timeout=10)
        assert response.status_code == 400
        assert response.json()["type"] == "Bad Request"
        assert "no low surrogate in string" in proto.parse_error_message(response.content)
    assert httpx.get(f"{zlab}/health_generate", timeout=10).status_code == 200


@pytest.mark.parametrize("params", [{"max_new_tokens": -1}, {"max_new_tokens": 1_000_000}])
def test_a_streamed_native_request_the_engine_refuses_gets_the_error_in_band(zlab: str, params: dict[str, int]) -> None:
    """SGLang 0.5.23 has already answered 200 when its tokenizer manager refuses a streamed /generate (bad sampling
    values, over the context length): the error comes as an event, then [DONE]."""
    body = {"text": "def f():", "sampling_params": params, "stream": True}
    response = httpx.post(f"{zlab}/generate", json=body, timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    error = proto.native_stream_error(response.content)
    assert error is not None and error.code == 400 and error.kind == "invalid_request_error"
    assert response.content.endswith(proto.SSE_DONE)


def _accept_lengths(base: str, prompts: list[str], tokens: int) -> list[proto.MetaInfo]:
    async def one(client: httpx.AsyncClient, prompt: str) -> proto.MetaInfo:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
        response = await client.post(f"{base}/generate", json=body)
        return proto.parse_generate_response(response.content)[0].meta

    async def run() -> list[proto.MetaInfo]:
        async with httpx.AsyncClient(timeout=60) as client:
            return list(await asyncio.gather(*(one(client, p) for p in prompts)))

    return asyncio.run(run())


def test_mean_accept_length_of_200_zlab_requests_lies_in_its_95_percent_interval(zlab: str) -> None:
    tokens = 64
    prompts = [f"# task {i}\ndef solve_{i}(data):" for i in range(200)]
    metas = _accept_lengths(zlab, prompts, tokens)
    assert all(m.completion_tokens == tokens for m in metas)
    observed = [m.accept_length for m in metas]
    assert all(m.spec is not None and a == tokens / m.spec.verify_ct for m, a in zip(metas, observed, strict=True))
    profile = load_profile("zlab")
    assert profile is not None
    moments = [request_accept_length_moments(RoundModel.build(profile, prompt_difficulty(p)), tokens) for p in prompts]
    low, high = confidence_interval([m for m, _ in moments], [v for _, v in moments])
    mean = sum(a for a in observed if a is not None) / len(observed)
    assert low <= mean <= high, (low, mean, high)
    assert 7.5 < mean < 10.5


def test_same_text_for_every_profile_at_temperature_zero_and_lossy_differs_at_its_rate(zlab: str) -> None:
    prompts = [f"def task_{i}(x):" for i in range(120)]

    def texts(base: str) -> list[str]:
        async def run() -> list[str]:
            async with httpx.AsyncClient(timeout=60) as client:
                replies = await asyncio.gather(*(client.post(f"{base}/generate", json={
                    "text": p, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}) for p in prompts))
            return [proto.parse_generate_response(r.content)[0].text for r in replies]
        return asyncio.run(run())

    baseline = texts(zlab)
    with sim_server("inhouse", SCALE, 7) as inhouse:
        assert texts(inhouse) == baseline
    with sim_server("none", SCALE, 0, "--lossy-fraction", "0.3") as lossy:
        info = httpx.get(f"{lossy}/server_info").json()
        assert info["speculative_algorithm"] is None
        differs = sum(a != b for a, b in zip(texts(lossy), baseline, strict=True))
    # Binomial(120, 0.3): mean 36, sd 5; a prompt is lossy or not by its hash, so the count is reproducible.
    assert 21 <= differs <= 51


def test_no_speculation_means_one_token_per_round_and_no_spec_fields() -> None:
    with sim_server("none", SCALE, 0) as base:
        chunks = native_stream(base, {"text": "x", "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}})
    assert [c.meta.completion_tokens for c in chunks] == list(range(1, 13))
    assert chunks[-1].meta.spec is None and chunks[-1].meta.accept_length is None


def test_48_slots_under_100_concurrent_requests(zlab: str) -> None:
    """Each request lasts far longer than sending all 100 takes, even on a loaded machine: the slots fill, and the
    rest queue."""
    async def run() -> tuple[list[float], list[float]]:
        running: list[float] = []
        queued: list[float] = []
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"text": "slots", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
            load = asyncio.gather(*(client.post(f"{zlab}/generate", json=body) for _ in range(100)))
            task = asyncio.ensure_future(load)
            while not task.done():
                text = (await client.get(f"{zlab}/metrics")).text
                for family in text_string_to_metric_families(text):
                    if family.name == names.SGLANG_NUM_RUNNING_REQS:
                        running.append(family.samples[0].value)
                    if family.name == names.SGLANG_NUM_QUEUE_REQS:
                        queued.append(family.samples[0].value)
                await asyncio.sleep(0.01)
            replies = await task
        assert all(r.status_code == 200 for r in replies)
        return running, queued

    running, queued = asyncio.run(run())
    assert max(running) == 48 and max(queued) > 0


def test_a_disconnected_client_frees_its_slot() -> None:
    with sim_server("zlab", 0.05, 0, "--max-running-requests", "1") as base:
        body = {"text": "endless", "sampling_params": {"max_new_tokens": 100000, "ignore_eos": True}, "stream": True}
        with httpx.stream("POST", f"{base}/generate", json=body, timeout=30) as response:
            next(response.iter_raw())
        short = {"text": "next", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        reply = httpx.post(f"{base}/generate", json=short, timeout=10)
        assert reply.status_code == 200
        assert metric_samples(base)["sglang:num_aborted_requests_total"] == 1


def test_fault_flags_inject_errors_stalls_and_disconnects() -> None:
    with sim_server("zlab", SCALE, 3, "--error-rate", "1") as base:
        response = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
        assert response.status_code == 500 and "Simulated" in proto.parse_error_message(response.content)
    with sim_server("zlab", SCALE, 3, "--disconnect-fraction", "1") as base:
        body = {"text": "x", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}, "stream": True}
        with pytest.raises(httpx.RemoteProtocolError), httpx.stream("POST", f"{base}/generate", json=body) as r:
            for _ in r.iter_raw():
                pass
    with sim_server("zlab", SCALE, 3, "--stall-fraction", "1", "--stall-s", "25", "--record-chunk-times") as base:
        chunks = native_stream(base, {"text": "x", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}})
    sent = chunks[-1].meta.sim_chunk_sent_unix_s or ()
    gaps = [later - earlier for earlier, later in itertools.pairwise(sent)]
    assert len(gaps) > 4 and max(gaps) >= 0.45  # 25 s at time scale 0.02 (0.5 s, less timer slack)
    assert sorted(gaps)[-2] < 0.5


def test_incremental_streaming_output_sends_deltas() -> None:
    with sim_server("zlab", SCALE, 0, "--incremental-streaming-output") as base:
        body = {"text": "inc", "sampling_params": {"max_new_tokens": 60, "temperature": 0}}
        chunks = native_stream(base, body)
        whole = proto.parse_generate_response(httpx.post(f"{base}/generate", json=body, timeout=30).content)[0]
    assert "".join(c.text for c in chunks) == whole.text
    assert len(chunks) > 2 and chunks[-1].text != whole.text


def test_record_chunk_times_are_off_by_default() -> None:
    with sim_server("zlab", SCALE, 0) as base:
        chunks = native_stream(base, {"text": "t", "sampling_params": {"max_new_tokens": 30}})
    assert chunks[-1].meta.sim_chunk_sent_unix_s is None and chunks[-1].meta.sim_chunk_due_unix_s is None


def test_the_server_sets_tcp_nodelay_on_accepted_connections() -> None:
    sock = bind(LOOPBACK, 0)
    server = uvicorn.Server(uvicorn_config(SimConfig(port=0, time_scale=0.01)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        with httpx.Client(base_url=url_of(sock)) as client:
            assert client.get("/health").status_code == 200
            sockets = [c.transport.get_extra_info("socket") for c in server.server_state.connections]
            assert sockets and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_a_client_that_falls_behind_gets_one_chunk_for_several_rounds() -> None:
    """The backlog fault: SGLang sends a client that fell behind only its latest state, so one chunk spans several
    verify rounds; the counts stay exact, and there are fewer chunks than rounds."""
    body = {"text": "def fib(n):", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0},
            "stream": True}
    with sim_server("zlab", 0.01, 0, "--backlog-fraction", "1") as behind:
        raw = httpx.post(f"{behind}/generate", json=body, timeout=30).content
    chunks = [proto.parse_native_event(e) for e in proto.SSEDecoder().feed(raw) if e != proto.DONE]
    metas = [c.meta for c in chunks if isinstance(c, proto.NativeChunk)]
    final = metas[-1]
    assert final.completion_tokens == 200 and final.spec is not None
    assert len(metas) < final.spec.verify_ct + 1  # the prefill chunk plus one per round, less the merged ones
    deltas = [b.completion_tokens - a.completion_tokens for a, b in itertools.pairwise(metas)]
    assert max(deltas) > 16  # more than one block of 16 can hold: several rounds in one chunk
