"""What the relay reads from bytes as they pass, without sockets: event boundaries, observers, whole bodies."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, Histogram

from dfserve import sglang
from dfserve.errors import ProtocolError
from gateway.relay import (
    NativeStream,
    OpenAIStream,
    event_boundary,
    measure_whole,
    observe_many,
    response_headers,
)


def test_event_boundary() -> None:
    assert event_boundary(b"data: {}\n\ndata: {") == 10
    assert event_boundary(b"data: {}\r\n\r\n") == 12
    assert event_boundary(b"data: {") == 0
    assert event_boundary(b"") == 0


def test_response_headers_drop_hop_by_hop_and_name_the_arm() -> None:
    raw = [(b"Content-Type", b"text/event-stream"), (b"Transfer-Encoding", b"chunked"), (b"Content-Length", b"9"),
           (b"Connection", b"keep-alive")]
    assert response_headers(raw, "cand", "http://h:1", drop_length=True) == [
        (b"content-type", b"text/event-stream"), (b"x-dfserve-arm", b"cand"), (b"x-dfserve-replica", b"http://h:1")]


def native(tokens: int, final: bool = False) -> bytes:
    meta = {"id": "r", "finish_reason": {"type": "stop"} if final else None, "prompt_tokens": 3,
            "completion_tokens": tokens}
    if final:
        meta["spec_verify_ct"] = 4
    return b"data: " + json.dumps({"text": "t", "meta_info": meta}).encode() + b"\n\n"


def test_native_stream_counts_tokens_per_batch_of_events() -> None:
    observer = NativeStream()
    assert observer.feed(native(1)) == 1
    assert observer.feed(b": keep-alive\n\n") == 0
    assert observer.feed(native(4) + native(10, final=True) + b"data: [DONE]\n\n") == 9
    acceptance = observer.acceptance()
    assert (acceptance.output_tokens, acceptance.verify_ct, acceptance.accept_length, acceptance.measure) == (
        10, 4, 2.5, "exact")


def test_openai_stream_estimates_only_with_usage() -> None:
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"ab"}}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":9}}\n\n'
    observer = OpenAIStream()
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    assert observer.feed(b": ping\n\n" + role + chunk + chunk) == 2
    assert observer.acceptance().accept_length is None
    assert observer.feed(chunk + usage + b"data: [DONE]\n\n") == 1
    assert observer.acceptance().accept_length == 3.0 and observer.acceptance().measure == "estimated"


def test_measure_whole() -> None:
    meta = {"id": "r", "finish_reason": None, "prompt_tokens": 1, "completion_tokens": 12, "spec_verify_ct": 3}
    batch = json.dumps([{"text": "a", "meta_info": meta}, {"text": "b", "meta_info": dict(meta, spec_verify_ct=1)}])
    assert measure_whole("native", batch.encode()).accept_length == 24 / 4
    chat = {"choices": [{"message": {"content": "x"}, "meta_info": meta}], "usage": {"completion_tokens": 12}}
    assert measure_whole("chat", json.dumps(chat).encode()).measure == "exact"
    del chat["choices"][0]["meta_info"]
    plain = measure_whole("completions", json.dumps(chat).encode())
    assert plain.output_tokens == 12 and plain.accept_length is None
    with pytest.raises(ProtocolError):
        measure_whole("chat", b"{}")


def test_byte_scanning_ignores_lookalikes_inside_strings() -> None:
    tricky = {"choices": [{"delta": {"content": 'say "content":"x" and\ndata: [DONE] "completion_tokens":99'}}]}
    events = b"data: " + json.dumps(tricky).encode() + b"\n\n"
    assert sglang.count_content_events(events) == 1
    assert sglang.last_completion_tokens(events) is None
    assert sglang.last_data_event(events + b"data: [DONE]\n\n") == json.dumps(tricky)
    assert sglang.last_data_event(b"data: [DONE]\n\n") is None
    assert sglang.count_content_events(b'data: {"choices":[{"delta":{"reasoning_content":"hm"}}]}\n\n') == 1


def test_observe_many_equals_repeated_observe() -> None:
    one_by_one = Histogram("a", "a", buckets=(0.001, 0.004, 0.01), registry=CollectorRegistry())
    at_once = Histogram("b", "b", buckets=(0.001, 0.004, 0.01), registry=CollectorRegistry())
    weighted = ((0.004, 3), (0.0005, 2), (0.02, 1), (0.0041, 5), (0.004, 1))
    for value, count in weighted:
        for _ in range(count):
            one_by_one.observe(value)
    observe_many(at_once, weighted)
    def samples(histogram: Histogram) -> list[tuple[str, dict[str, str], float]]:
        return [(s.name[1:], s.labels, s.value) for s in histogram.collect()[0].samples if "created" not in s.name]

    expected, got = samples(one_by_one), samples(at_once)
    assert [(n, labels) for n, labels, _ in got] == [(n, labels) for n, labels, _ in expected]
    assert [v for *_, v in got] == pytest.approx([v for *_, v in expected])
