"""The gateway's relay and the load tester turn the same streams into the same `dfserve_*` series: both build a
`dfserve.metrics.Outcome` and update the families through `dfserve.metrics.observe`, and count the same requests."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dfserve import sglang
from dfserve._relay import EventRelay
from dfserve.gateway import relay
from dfserve.gateway.relay import Exchange, NativeStream, OpenAIStream, StreamKind, meter
from dfserve.loadtest.client import Sent, build_record, read_stream
from dfserve.loadtest.exporter import outcome
from dfserve.metrics import ITL_BUCKETS_S, DfserveMetrics, observe
from dfserve.sglang import server as engine

T0 = 100.0
HEAD = engine.ResponseHead("r", 1, "m")
SPEC = sglang.SpecStats(verify_ct=3, num_correct_drafts=12, num_proposed_drafts=45, accept_rate=12 / 45,
                        correct_drafts_histogram=(0, 0, 1, 1, 1))


RETRACTED = sglang.FinishReason(kind="abort", message="retracted", status_code=503)


def native(tokens: int, final: bool = False, abort: sglang.FinishReason | None = None) -> bytes:
    finish = abort or (sglang.FinishReason(kind="length", length=tokens) if final else None)
    meta = engine.meta_info_body(rid="r", finish=finish, prompt_tokens=4, completion_tokens=tokens,
                                 e2e_latency_s=0.5 if finish else None, spec=SPEC if final else None)
    return engine.sse_event(engine.generate_response_body("x" * tokens, list(range(tokens)), meta))


def chat(text: str | None, finish: bool | str = False, first: bool = False) -> bytes:
    stop = sglang.FinishReason(kind=finish if isinstance(finish, str) else "stop") if finish else None
    return engine.sse_event(engine.chat_chunk_body(HEAD, content=text, finish=stop, first=first))


def chat_end(tokens: int, spec: bool) -> bytes:
    chunks = engine.stream_end_chunks(HEAD, obj="chat.completion.chunk", prompt_tokens=4, completion_tokens=tokens,
                                      spec=SPEC if spec else None, include_usage=True)
    return b"".join(engine.sse_event(chunk) for chunk in chunks) + sglang.SSE_DONE


ERROR = engine.openai_error_event("retracted", "SERVICE_UNAVAILABLE", 503)
STREAMS: list[tuple[sglang.Api, list[bytes]]] = [
    ("native", [native(1), native(5), native(9), native(13, final=True) + sglang.SSE_DONE]),
    ("native", [native(1), native(7), native(10, final=True) + sglang.SSE_DONE]),
    ("native", [native(1), native(4), native(4, abort=RETRACTED) + sglang.SSE_DONE]),  # aborted in band
    ("native", [native(1), native(6, abort=engine.ABORTED) + sglang.SSE_DONE]),  # through /abort_request
    ("native", [engine.native_error_event("over the context length")]),  # refused in band
    ("chat", [chat("", first=True) + chat("def"), chat(" f"), chat("():", finish=True) + chat_end(13, spec=True)]),
    ("chat", [chat("", first=True) + chat("a"), chat("b"), chat(None, finish=True) + chat_end(6, spec=False)]),
    ("chat", [chat("", first=True) + chat("a"), ERROR + chat_end(3, spec=True)]),  # aborted in band
    ("chat", [chat("", first=True) + chat("a"), chat(None, finish="abort") + chat_end(3, spec=True)]),  # /abort_request
    ("chat", [chat("", first=True) + chat("x"), chat(None, finish=True) + chat_end(1, spec=False)]),  # no round
]


def through_the_gateway(api: sglang.Api, pieces: list[bytes], start: float, times: list[float]) -> Exchange:
    kind: StreamKind = NativeStream() if api == "native" else OpenAIStream()
    relay = EventRelay(None, False, kind.marks.keys, kind.marks.cumulative, ITL_BUCKETS_S)
    for at, piece in zip(times, pieces, strict=True):
        relay.received(at, piece)
    exchange = Exchange(arm="a", route=api, start=start, status=200, end=times[-1] + 0.001)
    meter(relay, exchange)
    exchange.acceptance, in_band = kind.read_end(relay.tokens, relay.tail)
    if in_band is not None:
        exchange.error, exchange.error_code = "stream_error", in_band.code
    return exchange


def series(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_same_streams_give_the_same_series_from_the_gateway_and_the_load_tester() -> None:
    gateway, tester = CollectorRegistry(), CollectorRegistry()
    gateway_metrics, tester_metrics = DfserveMetrics.build(gateway), DfserveMetrics.build(tester)
    for index, (api, pieces) in enumerate(STREAMS):
        sent = 0.01 * index
        times = [T0 + sent + 0.02 + 0.013 * (i + 1) ** 1.5 for i in range(len(pieces))]
        exchange = through_the_gateway(api, pieces, T0 + sent, times)
        observe(gateway_metrics, relay.outcome(exchange))
        stream = read_stream(api, list(zip(times, pieces, strict=True)), T0)
        stamps = Sent("a", f"t{index}", index, False, None, sent, sent, times[-1] + 0.001 - T0, api)
        observe(tester_metrics, outcome(build_record(stamps, 200, stream, stream.failure), api))
    got, want = series(tester), series(gateway)
    assert got.keys() == want.keys()
    assert [got[key] for key in want] == pytest.approx(list(want.values()), abs=1e-9)
    failed = {labels for (name, labels), value in want.items() if name == "dfserve_requests_total" and value
              and ("error", "stream_error") in labels}
    assert {dict(labels)["status"] for labels in failed} == {"4xx", "5xx", "error"}  # /abort_request: no code
    assert sum(want[key] for key in want if key[0] == "dfserve_requests_total" and key[1] in failed) == 5
    ttft = {dict(labels)["route"]: value for (name, labels), value in want.items()
            if name == "dfserve_time_to_first_token_seconds_count"}
    assert ttft == {"native": 2, "chat": 3}  # the failed streams' first tokens count nowhere
    accepted = {(dict(labels)["route"], dict(labels)["measure"]): value for (name, labels), value in want.items()
                if name == "dfserve_accept_length_count"}
    assert accepted == {("native", "exact"): 2, ("chat", "exact"): 1, ("chat", "estimated"): 1}  # not one token
