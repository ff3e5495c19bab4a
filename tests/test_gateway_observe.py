"""What the relay reads from bytes as they pass, without sockets: event boundaries, observers, whole bodies."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry, Histogram

from dfserve import sglang
from dfserve.errors import ProtocolError
from gateway.relay import (
    Acceptance,
    Exchange,
    NativeStream,
    OpenAIStream,
    StreamRelay,
    event_boundary,
    measure_whole,
    observe_many,
    response_headers,
)
from gateway.server import Discard


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


def test_native_stream_without_speculative_decoding_counts_tokens_only() -> None:
    observer = NativeStream()
    assert observer.acceptance() == Acceptance()
    observer.feed(native(3) + native(7))
    assert observer.acceptance() == Acceptance(output_tokens=7)


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
    quoted = {"text": 'a "spec_verify_ct": 7 b', "meta_info": {"completion_tokens": 3}}
    assert sglang.last_spec_verify_ct(b"data: " + json.dumps(quoted).encode() + b"\n\n") is None
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


class Recorder(Discard):
    """A client that keeps what the relay writes."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def write(self, body: bytes) -> None:
        self.bodies.append(body)


def test_stream_relay_writes_whole_events_in_order_and_times_them() -> None:
    async def scenario() -> tuple[Recorder, Exchange, StreamRelay]:
        reply, exchange = Recorder(), Exchange(arm="a", route="native")
        relay = StreamRelay(reply, NativeStream(), exchange)
        relay.received(1.0, native(2))
        relay.received(2.0, native(4)[:9])  # half an event: held back
        relay.received(3.0, native(4)[9:] + native(6)[:5])
        relay.received(4.0, native(6)[5:] + native(8, final=True))
        relay.ended()
        relay.received(5.0, b"data: [DONE]\n\n")  # after the end: not the client's
        await relay.settled
        relay.conclude()
        return reply, exchange, relay

    reply, exchange, relay = asyncio.run(scenario())
    assert reply.bodies == [native(2), native(4), native(6) + native(8, final=True)]
    assert relay.pending == b""
    assert exchange.first == 1.0 and exchange.chunk_gaps == [2.0, 1.0]
    assert exchange.token_gaps == [(2.0, 2), (1.0, 4)]
    assert exchange.acceptance.verify_ct == 4 and exchange.acceptance.measure == "exact"
