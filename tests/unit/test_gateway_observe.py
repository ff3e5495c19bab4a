"""What the relay reads from bytes as they pass, without sockets: observers, the stream meter, whole bodies."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, Histogram

from dfserve import families, sglang
from dfserve._relay import EventRelay
from dfserve.errors import ProtocolError
from dfserve.gateway.relay import (
    Acceptance,
    Binned,
    Exchange,
    NativeOutputs,
    NativeStream,
    OpenAIStream,
    StreamKind,
    measure_whole,
    meter,
    outcome,
    response_headers,
    stream_kind,
)
from dfserve.metrics import ITL_BUCKETS_S


def test_response_headers_drop_hop_by_hop_and_name_the_arm() -> None:
    raw = [(b"content-type", b"text/event-stream"), (b"transfer-encoding", b"chunked"), (b"content-length", b"9"),
           (b"connection", b"keep-alive")]
    assert response_headers(raw, "cand", "http://h:1") == [
        (b"content-type", b"text/event-stream"), (b"x-dfserve-arm", b"cand"), (b"x-dfserve-replica", b"http://h:1")]


def test_response_headers_drop_those_the_connection_header_names() -> None:
    raw = [(b"x-secret", b"s"), (b"connection", b"close, X-Secret"), (b"connection", b" x-hop"), (b"x-hop", b"1"),
           (b"x-engine", b"e")]
    assert response_headers(raw, "a", "r")[0] == (b"x-engine", b"e")


def native(tokens: int, final: bool = False) -> bytes:
    meta = {"id": "r", "finish_reason": {"type": "stop"} if final else None, "prompt_tokens": 3,
            "completion_tokens": tokens}
    if final:
        meta["spec_verify_ct"] = 4
    return b"data: " + json.dumps({"text": "t", "meta_info": meta}).encode() + b"\n\n"


def relayed(kind: StreamKind, pieces: list[bytes]) -> tuple[EventRelay, list[bytes]]:
    """An EventRelay fed `pieces` at times 1, 2, ...; and what it wrote."""
    written: list[bytes] = []
    relay = EventRelay(written.append, False, kind.marks.keys, kind.marks.cumulative, BOUNDS, None, None, False,
                       kind.alarm)
    for at, piece in enumerate(pieces, start=1):
        relay.received(float(at), piece)
    return relay, written


BOUNDS = (1.5, 2.5)


def test_native_stream_counts_tokens_per_piece_of_events() -> None:
    relay, _ = relayed(NativeStream(), [native(1), b": keep-alive\n\n",
                                           native(4) + native(10, final=True) + b"data: [DONE]\n\n"])
    assert relay.tokens == 10 and relay.first == 1.0
    assert relay.chunk_gaps == ((0, 1, 0), 2.0) and relay.token_gaps == ((9, 0, 0), 2.0)  # 2 s over 9 tokens
    acceptance, error = NativeStream().read_end(relay.tokens, relay.tail)
    assert (acceptance.output_tokens, acceptance.verify_ct, acceptance.accept_length, acceptance.measure) == (
        10, 4, 2.5, "exact") and error is None


def test_native_stream_without_speculative_decoding_counts_tokens_only() -> None:
    relay, _ = relayed(NativeStream(), [native(3) + native(7)])
    assert NativeStream().read_end(relay.tokens, relay.tail) == (Acceptance(output_tokens=7), None)


def test_a_native_stream_that_never_counted_its_output_is_not_sglangs_unless_it_failed_in_band() -> None:
    with pytest.raises(ProtocolError, match="completion_tokens"):
        NativeStream().read_end(None, b'data: {"text":"hi"}\n\n' + sglang.SSE_DONE)
    error = b'data: {"error":{"message":"bad","code":400}}\n\n' + sglang.SSE_DONE
    acceptance, in_band = NativeStream().read_end(None, error)
    assert acceptance == Acceptance() and in_band is not None and in_band.message == "bad"


def test_openai_stream_estimates_only_with_usage() -> None:
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"ab"}}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":9}}\n\n'
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    last = b'data: {"choices":[{"index":0,"delta":{"content":"ab"},"finish_reason":"stop"}]}\n\n'
    relay, _ = relayed(OpenAIStream(), [b": ping\n\n" + role + chunk + chunk])
    assert relay.tokens == 2
    relay.received(2.0, last + usage)
    relay.received(3.0, b"data: [DONE]\n\n")
    assert relay.first == 1.0 and relay.chunk_gaps == ((1, 0, 0), 1.0) and relay.token_gaps is None
    acceptance, error = OpenAIStream().read_end(relay.tokens, relay.alarmed + relay.tail)
    assert acceptance.accept_length == 3.0 and acceptance.measure == "estimated" and error is None
    without_usage = last + b"data: [DONE]\n\n"
    assert OpenAIStream().read_end(relay.tokens, without_usage)[0].accept_length is None


def test_an_openai_stream_without_a_finish_reason_did_not_end_as_sglang_ends_one() -> None:
    """Its events read only for their keys: the finish reason is what says it ended well (the load tester's rule)."""
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"ab"}}]}\n\n'
    with pytest.raises(ProtocolError, match="stream finished without a finish_reason"):
        OpenAIStream().read_end(1, chunk + b"data: [DONE]\n\n")


def test_measure_whole() -> None:
    meta = {"id": "r", "finish_reason": None, "prompt_tokens": 1, "completion_tokens": 12, "spec_verify_ct": 3}
    batch = json.dumps([{"text": "a", "meta_info": meta}, {"text": "b", "meta_info": dict(meta, spec_verify_ct=1)}])
    assert measure_whole("native", batch.encode()) == (Acceptance(24, 4, 24 / 4, "exact"), None)
    first_token_stop = {"id": "s", "finish_reason": {"type": "stop", "matched": "wo"}, "prompt_tokens": 1,
                        "completion_tokens": 1}  # no spec fields: SGLang 0.5.23 leaves them out at 0 rounds
    mixed = json.dumps([{"text": "", "meta_info": first_token_stop}, {"text": "b", "meta_info": meta}])
    assert measure_whole("native", mixed.encode()) == (Acceptance(13, 3, 13 / 3, "exact"), None)  # as streamed
    alone = json.dumps([{"text": "", "meta_info": first_token_stop}])
    assert measure_whole("native", alone.encode())[0] == Acceptance(output_tokens=1)
    chat = {"choices": [{"message": {"content": "x"}, "meta_info": meta}], "usage": {"completion_tokens": 12}}
    assert measure_whole("chat", json.dumps(chat).encode())[0].measure == "exact"
    del chat["choices"][0]["meta_info"]
    plain, error = measure_whole("completions", json.dumps(chat).encode())
    assert plain.output_tokens == 12 and plain.accept_length is None and error is None
    aborted = [{"text": "a", "meta_info": meta}, {"text": "b", "meta_info": dict(meta, finish_reason={
        "type": "abort", "message": "Aborted", "status_code": None, "err_type": None})}]
    assert measure_whole("native", json.dumps(aborted).encode())[1] == sglang.StreamError("Aborted")
    chat["choices"][0]["finish_reason"] = "abort"  # what /abort_request leaves of a whole answer: 200, cut short
    assert measure_whole("chat", json.dumps(chat).encode())[1] == sglang.StreamError("Aborted")
    two = {"choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "stop"},
                       {"index": 1, "message": {"content": "y"}, "finish_reason": "abort"}]}  # n=2, the second cut
    assert measure_whole("chat", json.dumps(two).encode())[1] == sglang.StreamError("Aborted")
    with pytest.raises(ProtocolError):
        measure_whole("chat", b"{}")


def test_byte_scanning_ignores_lookalikes_inside_strings() -> None:
    tricky = {"choices": [{"delta": {"content": 'say "content":"x" and\ndata: [DONE] "completion_tokens":99'}}]}
    events = b"data: " + json.dumps(tricky).encode() + b"\n\n"
    assert sglang.CONTENT_CHUNKS.read(events) == 1
    assert sglang.NATIVE_TOKENS.read(events) is None
    quoted = {"text": 'a "spec_verify_ct": 7 b', "meta_info": {"completion_tokens": 3}}
    assert sglang.last_spec_verify_ct(b"data: " + json.dumps(quoted).encode() + b"\n\n") is None
    said = {"text": 'he said "error": "status_code": 500', "meta_info": {"completion_tokens": 3}}
    assert sglang.native_stream_error(b"data: " + json.dumps(said).encode() + b"\n\ndata: [DONE]\n\n") is None
    assert sglang.CONTENT_CHUNKS.read(b'data: {"choices":[{"delta":{"reasoning_content":"hm"}}]}\n\n') == 1


def test_gaps_counted_by_the_relay_add_up_as_prometheus_observes_them() -> None:
    arrivals, tokens = [0.0, 0.01, 0.0125, 0.5, 0.503, 3.0], [1, 2, 5, 1, 4, 3]
    relay = EventRelay(None, True, sglang.NATIVE_TOKENS.keys, True, ITL_BUCKETS_S)
    total = 0
    for at, count in zip(arrivals, tokens, strict=True):
        total += count
        relay.received(at, native(total))
    registry = CollectorRegistry()
    observed = {name: Histogram(name, name, buckets=ITL_BUCKETS_S, registry=registry) for name in ("chunk", "token")}
    for earlier, later, count in zip(arrivals, arrivals[1:], tokens[1:], strict=False):
        observed["chunk"].observe(later - earlier)
        for _ in range(count):
            observed["token"].observe((later - earlier) / count)
    assert relay.token_gaps is not None
    binned = families.Histogram("binned", "binned", ("gaps",), ITL_BUCKETS_S, registry)
    binned.labels("chunk").add_binned(*relay.chunk_gaps)
    binned.labels("token").add_binned(*relay.token_gaps)
    [family] = binned.collect()

    for name in ("chunk", "token"):
        [expected] = observed[name].collect()
        want = {(s.name.removeprefix(name), s.labels.get("le")): s.value for s in expected.samples
                if "created" not in s.name}
        got = {(s.name.removeprefix("binned"), s.labels.get("le")): s.value for s in family.samples
               if s.labels["gaps"] == name}
        assert got.keys() == want.keys() and list(got.values()) == pytest.approx([want[key] for key in got])


def test_a_metered_relay_writes_whole_events_in_order_and_times_them() -> None:
    relay, written = relayed(NativeStream(), [
        native(2),
        native(4)[:9],  # half an event: held back
        native(4)[9:] + native(6)[:5],
        native(6)[5:] + native(8, final=True)])
    relay.ended()
    relay.ended()
    relay.received(5.0, b"data: [DONE]\n\n")  # after the end: not the client's
    exchange = Exchange(arm="a", route="native")
    meter(relay, exchange)
    assert written == [native(2), native(4), native(6) + native(8, final=True)]
    assert relay.pending == b""
    assert exchange.first == 1.0 and exchange.chunk_gaps == Binned((1, 1, 0), 3.0)  # gaps of 2 s and 1 s
    assert exchange.token_gaps == Binned((6, 0, 0), 3.0)  # 2 s over 2 tokens, 1 s over 4


def test_a_client_waits_from_its_request_and_a_mirror_is_timed_from_its_own_send() -> None:
    """A mirror goes out when the event loop gets to it, after its client's request: that wait is the gateway's, and
    charged to the mirrored arm it would make identical arms differ."""
    client = outcome(Exchange(arm="a", route="chat", start=10.0, sent=10.001, first=10.1, end=11.0))
    mirror = outcome(Exchange(arm="b", route="chat", mirror=True, start=10.0, sent=10.03, first=10.13, end=11.03))
    assert (client.ttft_s, client.e2e_s) == pytest.approx((0.1, 1.0))
    assert (mirror.ttft_s, mirror.e2e_s) == pytest.approx((0.1, 1.0))
    unsent = outcome(Exchange(arm="b", route="chat", mirror=True, start=10.0, end=10.5))  # refused before a replica
    assert unsent.e2e_s == pytest.approx(0.5)


def test_a_native_stream_of_several_outputs_is_read_event_by_event_and_its_counts_left_unknown() -> None:
    """SGLang interleaves the outputs' events, each with its own running total: read as one total, the gateway
    counted one output's tokens and rounds."""
    several = [{"text": "a", "sampling_params": {"n": 2}}, {"text": ["a", "b"]}, {"input_ids": [[1], [2]]}]
    assert all(isinstance(stream_kind(Exchange(arm="a", route="native", request=r)), NativeOutputs) for r in several)
    one = [{"text": "a", "sampling_params": {"n": 1}}, {"input_ids": [1, 2]}, {"text": "a"}]
    assert all(isinstance(stream_kind(Exchange(arm="a", route="native", request=r)), NativeStream) for r in one)
    events = [b'data: {"index":%d,"text":"%s","meta_info":{"completion_tokens":%d}}\n\n' % (i, t, n)
              for i, t, n in ((0, b"a", 1), (1, b"x", 2), (1, b"xy", 5), (0, b"ab", 3))]
    relay, _ = relayed(NativeOutputs(), [*events, sglang.SSE_DONE])
    assert relay.first == 1.0 and relay.chunk_gaps[0][-1] == 0 and sum(relay.chunk_gaps[0]) == 3
    assert NativeOutputs().read_end(relay.tokens, relay.tail) == (Acceptance(), None)


def test_an_abort_of_one_choice_of_several_is_read_whatever_finished_after_it() -> None:
    """n = 2: choice 0 stops, then choice 1 is aborted, then the spec details and the usage, each read apart. With
    every finish reason an alarm, choice 0's stop held the relay's first place and the later pieces pushed the abort
    out of its latest: a success with an acceptance sample."""
    def event(obj: object) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def choice(index: int, content: str, finish: str | None = None) -> bytes:
        return event({"id": "c", "choices": [{"index": index, "delta": {"content": content}, "finish_reason": finish}]})

    pieces = [choice(0, "a"), choice(1, "b"), choice(0, "", "stop"), choice(1, "c"), choice(1, "", "abort"),
              event({"id": "c", "choices": [], "sglext": {"spec_tokens_details": {"spec_verify_ct": 2}}}),
              event({"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}), sglang.SSE_DONE]
    kind = stream_kind(Exchange(arm="a", route="chat", request={"n": 2}))
    assert kind == OpenAIStream(one_choice=False)
    relay = EventRelay(lambda _: None, False, kind.marks.keys, kind.marks.cumulative, BOUNDS, 1 << 20, None, False,
                       kind.alarm)
    for at, piece in enumerate(pieces, start=1):
        relay.received(float(at), piece)
    _, error = kind.read_end(relay.tokens, relay.alarmed + relay.stripped + relay.tail)
    assert error is not None and stream_kind(Exchange(arm="a", route="chat", request={})) == OpenAIStream()
