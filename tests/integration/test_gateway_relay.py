"""The gateway's relay against a scripted SGLang stand-in on loopback: exact bytes, awkward framing, meta_info
handling, retries before the first byte, failures after it, client disconnects and input limits."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from aiohttp import web

from tests.integration.servers import LOOPBACK, gateway_argv, gateway_server, refusing_port, serve, url_of

CHAT_EVENTS = [
    {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "def"}}]},
    {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": " f():\n    return 1 — ünï"}}]},
    {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "\n"}, "finish_reason": "stop"}]},
    {"id": "c1", "object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}},
]
META = {"id": "r1", "finish_reason": {"type": "length", "length": 12}, "prompt_tokens": 5, "completion_tokens": 12,
        "cached_tokens": 0, "spec_verify_ct": 4, "spec_accept_length": 3.0}
SGLEXT = {"spec_tokens_details": {"spec_accept_rate": 0.13, "spec_accept_length": 3.0, "spec_num_correct_drafts": 8,
                                  "spec_num_proposed_drafts": 60, "spec_verify_ct": 4}}
SPEC_CHUNK = {"id": "c1", "object": "chat.completion.chunk", "choices": [], "usage": None, "sglext": SGLEXT}
IN_BAND = {"error": {"object": "error", "message": "Retracted under decode memory pressure without a KV backup.",
                     "type": "SERVICE_UNAVAILABLE", "param": None, "code": 503}}
NATIVE_IN_BAND = {"error": {"message": "Requested token count exceeds the model's maximum context length",
                            "type": "invalid_request_error", "code": 400, "retryable": False}}


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


FLOOD_EVENT = sse({"id": "c1", "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": {"content": "x" * 4000}}]})
FLOOD_EVENTS = 24000
"""About 100 MB: well over what the sockets on the way can hold (Linux autotunes a receive buffer up to tcp_rmem's
maximum, 32 MB here), so that only back-pressure can stop the engine's writes before the end."""


class Stub:
    """A scripted SGLang stand-in in a background thread. `x-stub` request header picks a behaviour."""

    def __init__(self, status: int = 200, sock: socket.socket | None = None, health_s: float = 0.0) -> None:
        """Listens on `sock` when given (a `refusing_port` brought to life), else on a free loopback port; answers
        `/health` after `health_s`."""
        self.status = status
        self.health_s = health_s
        self.seen: list[dict[str, Any]] = []
        self.cancelled = threading.Event()
        self.flood_written = 0
        self.headed = threading.Event()
        """A `held` stream's head is written; its events wait for `release`."""
        self.release = threading.Event()
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((LOOPBACK, 0))
        self.sock = sock
        self.url = url_of(sock)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.SockSite(self._runner, self.sock).start())
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> Stub:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def health(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.health_s)
        return web.Response(status=200 if self.status < 500 else 503)

    async def models(self, request: web.Request) -> web.Response:
        if request.headers.get("x-stub") == "304":  # as a cache validator would answer
            return web.Response(status=304, headers={"ETag": '"m"', "Content-Length": "61"})
        if request.headers.get("x-stub") == "204":
            return web.Response(status=204, headers={"Connection": "keep-alive, X-Hop", "X-Hop": "for the proxy"})
        return web.json_response({"object": "list", "data": [{"id": "qwen", "object": "model"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        if self.status >= 500 or request.headers.get("x-stub") == "poison":  # poison: this request's own 500
            status = max(self.status, 500)
            return web.json_response({"object": "error", "message": "engine down", "code": status}, status=status)
        if request.headers.get("x-stub") == "garbage":
            return garbage(body)
        if not body.get("stream"):
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "def f(): — ü"},
                                      "finish_reason": "length"}
            if body.get("return_meta_info"):
                choice["meta_info"] = META
            payload = {"id": "c2", "object": "chat.completion", "choices": [choice],
                       "usage": {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}}
            if body.get("return_spec_tokens_details"):
                payload["sglext"] = SGLEXT
            odd = request.headers.get("x-stub") == "odd-usage"  # a count the gateway's measuring refuses
            if odd:  # and a lone surrogate, escaped: JSON, but no UTF-8 of it
                payload["usage"]["completion_tokens"] = 12.5
                choice["message"]["content"] = "\ud800 ü"
            return web.Response(body=json.dumps(payload, ensure_ascii=odd, separators=(",", ":")).encode(),
                                content_type="application/json")
        mode = request.headers.get("x-stub", "")
        if mode == "stall":
            await asyncio.sleep(3)
        if mode == "gzip":  # asked for identity, gzips anyway
            wire = b"".join(sse(e) for e in CHAT_EVENTS) + b"data: [DONE]\n\n"
            return web.Response(body=gzip.compress(wire), headers={"Content-Type": "text/event-stream",
                                                                   "Content-Encoding": "gzip"})
        if mode == "end-held":  # a whole stream to [DONE]; its chunked end waits for `release`
            held = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await held.prepare(request)
            await held.write(b"".join(sse(e) for e in CHAT_EVENTS) + b"data: [DONE]\n\n")
            await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 10)
            await held.write_eof()
            return held
        if mode == "long-length":  # a whole stream, then the connection closed short of its Content-Length
            wire = b"".join(sse(e) for e in CHAT_EVENTS) + b"data: [DONE]\n\n"
            short = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            short.content_length = len(wire) + 100
            await short.prepare(request)
            await short.write(wire)
            assert request.transport is not None
            request.transport.close()
            return short
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Engine": "stub"})
        await response.prepare(request)
        try:
            if mode == "flood":
                for _ in range(FLOOD_EVENTS):
                    await response.write(FLOOD_EVENT)
                    self.flood_written += 1
                await response.write(b"data: [DONE]\n\n")  # a whole stream: else the gateway ends it with an error of its own
                await response.write_eof()
                return response
            if mode == "slow":
                for _ in range(200):
                    await response.write(sse(CHAT_EVENTS[1]))
                    await asyncio.sleep(0.01)
            events = CHAT_EVENTS
            if body.get("return_spec_tokens_details") and mode != "no-spec-details":  # else: before SGLang 0.5.23
                events = [*CHAT_EVENTS[:-1], SPEC_CHUNK, CHAT_EVENTS[-1]]
            if mode == "in-band":  # aborted after two chunks: the error event, then usage (SGLang sends it still)
                events = [*CHAT_EVENTS[:2], IN_BAND, CHAT_EVENTS[-1]]
            if mode == "no-finish":  # every chunk, and [DONE], but no finish reason
                events = [*CHAT_EVENTS[:3], CHAT_EVENTS[-1]]
            if mode in ("in-band-apart", "apart"):  # each event read apart (in-band: an error 4 back from the end)
                spec = [SPEC_CHUNK] if body.get("return_spec_tokens_details") else []
                middle = [IN_BAND] if mode == "in-band-apart" else CHAT_EVENTS[2:-1]
                for event in [*CHAT_EVENTS[:2], *middle, *spec, CHAT_EVENTS[-1], None]:
                    await response.write(sse(event) if event is not None else b"data: [DONE]\n\n")
                    await asyncio.sleep(0.02)
                await response.write_eof()
                return response
            frames = [sse(e) for e in events] + [b"data: [DONE]\n\n"]
            wire = b": ping\n\n" + b"".join(frames)
            # Awkward framing: an event split across writes, and several events in one write.
            for piece in (wire[:7], wire[7:40], wire[40:41], wire[41:200], wire[200:]):
                if mode == "cut" and piece is not wire[:7] and len(piece) > 1:
                    await response.write(piece[: len(piece) // 2])
                    assert request.transport is not None
                    request.transport.close()
                    return response
                await response.write(piece)
                await asyncio.sleep(0.003)
        except (ConnectionResetError, asyncio.CancelledError):
            self.cancelled.set()
            raise
        await response.write_eof()
        return response

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        if request.headers.get("x-stub") == "garbage":
            return garbage(body)
        if not body.get("stream"):
            return web.json_response({"text": "abc", "output_ids": [1, 2, 3], "meta_info": META})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if request.headers.get("x-stub") == "in-band":
            await response.write(sse(NATIVE_IN_BAND) + b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        if request.headers.get("x-stub") in ("outputs", "outputs-abort"):  # n = 2: each output's own counts
            for index, tokens in ((0, 1), (1, 2), (1, 6), (0, 4)):
                meta = {**META, "completion_tokens": tokens, "spec_verify_ct": 2}
                if (index, request.headers.get("x-stub")) == (0, "outputs-abort"):  # output 0 retracted, 1 goes on
                    meta["finish_reason"] = {"type": "abort", "message": "retracted", "status_code": 503}
                await response.write(sse({"index": index, "text": "x" * tokens, "meta_info": meta}))
                await asyncio.sleep(0.01)
                if meta["finish_reason"] != META["finish_reason"]:
                    for tokens in (7, 9, 12):  # the other output's events after it: more than the relay's tail
                        await response.write(sse({"index": 1, "text": "x" * tokens, "meta_info": {
                            **META, "completion_tokens": tokens, "spec_verify_ct": 3}}))
                        await asyncio.sleep(0.01)
                    break
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        held = request.headers.get("x-stub") == "held"
        if held:
            self.headed.set()
            await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 10)
        for tokens, final in ((1, False), (5, False), (12, True)):
            meta = dict(META, completion_tokens=tokens) if final else {
                "id": "r1", "finish_reason": None, "prompt_tokens": 5, "completion_tokens": tokens}
            await response.write(sse({"text": "x" * tokens, "meta_info": meta}))
            await asyncio.sleep(0 if held else 0.01)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def garbage(body: dict[str, Any]) -> web.Response:
    """200 with what no SGLang sends: an event that is not JSON, or a whole body that is not."""
    if body.get("stream"):
        return web.Response(body=b"data: {not json\n\ndata: [DONE]\n\n", content_type="text/event-stream")
    return web.Response(body=b"<html>busy</html>", content_type="application/json")


def write_config(tmp_path: Path, arms: dict[str, Any], **extra: Any) -> Path:
    config = {"schema_version": 1, "mode": "split", "arms": arms, "scrape": {"enabled": False},
              "health": {"interval_s": 0.2, "eject_after_failures": 2}, **extra}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def one_arm(tmp_path: Path) -> Iterator[tuple[Stub, str]]:
    with Stub() as stub, gateway_server(write_config(tmp_path, {"a": {"weight": 1, "replicas": [stub.url]}})) as gw:
        yield stub, gw


CHAT_STREAM = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "stream": True,
               "stream_options": {"include_usage": True}}
CHAT_WHOLE = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}]}


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        series, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


def test_stream_bytes_equal_direct_and_headers_name_arm(one_arm: tuple[Stub, str]) -> None:
    """The gateway asks for spec details the client did not ask for, and cuts the chunk SGLang sends for them out
    of the stream (which the stub writes in awkward pieces): the client reads the bytes it reads without the
    gateway, and the gateway's acceptance is exact."""
    stub, gw = one_arm
    direct = httpx.post(stub.url + "/v1/chat/completions", json=CHAT_STREAM)
    via = httpx.post(gw + "/v1/chat/completions", json=CHAT_STREAM)
    assert stub.seen[-1]["return_spec_tokens_details"] is True and "return_spec_tokens_details" not in stub.seen[-2]
    assert via.status_code == 200
    assert via.content == direct.content and b"sglext" not in via.content
    assert via.headers["x-dfserve-arm"] == "a" and via.headers["x-dfserve-replica"] == stub.url
    assert via.headers["x-engine"] == "stub"
    text = httpx.get(gw + "/metrics").text
    assert metric(text, "dfserve_accept_length_sum", arm="a", route="chat", measure="exact") == 3.0  # 12 over 4
    assert metric(text, "dfserve_accept_length_count", arm="a", route="chat", measure="estimated") == 0
    assert metric(text, "dfserve_requests_total", arm="a", route="chat", status="2xx", error="") == 1
    assert metric(text, "dfserve_time_to_first_token_seconds_count", arm="a", route="chat") == 1


def test_spec_details_stay_hidden_from_an_answer_the_gateway_cannot_measure(one_arm: tuple[Stub, str]) -> None:
    stub, gw = one_arm
    via = httpx.post(gw + "/v1/chat/completions", json=CHAT_WHOLE, headers={"x-stub": "odd-usage"})
    assert stub.seen[-1]["return_spec_tokens_details"] is True
    assert via.status_code == 200 and via.json()["usage"]["completion_tokens"] == 12.5 and "sglext" not in via.json()
    assert via.json()["choices"][0]["message"]["content"] == "\ud800 ü"


def test_a_bodiless_answer_says_no_length_and_hop_by_hop_headers_it_names_stay_behind(
        one_arm: tuple[Stub, str]) -> None:
    _, gw = one_arm
    with httpx.Client() as client:
        for status in (304, 204):
            via = client.get(gw + "/v1/models", headers={"x-stub": str(status)})
            assert via.status_code == status and "content-length" not in via.headers and "x-hop" not in via.headers
        assert client.get(gw + "/v1/models").json()["data"][0]["id"] == "qwen"  # the connection is still in step


def test_whole_chat_gets_exact_acceptance_and_spec_details_stay_hidden(one_arm: tuple[Stub, str]) -> None:
    stub, gw = one_arm
    direct = httpx.post(stub.url + "/v1/chat/completions", json=CHAT_WHOLE)
    via = httpx.post(gw + "/v1/chat/completions", json=CHAT_WHOLE)
    assert stub.seen[-1]["return_spec_tokens_details"] is True and "return_spec_tokens_details" not in stub.seen[-2]
    assert via.content == direct.content
    assert "sglext" not in via.json() and "meta_info" not in via.json()["choices"][0]
    asked = httpx.post(gw + "/v1/chat/completions", json={**CHAT_WHOLE, "return_meta_info": True})
    assert asked.json()["choices"][0]["meta_info"]["spec_verify_ct"] == 4
    text = httpx.get(gw + "/metrics").text
    assert metric(text, "dfserve_accept_length_count", arm="a", route="chat", measure="exact") == 2
    assert metric(text, "dfserve_accept_length_sum", arm="a", route="chat", measure="exact") == 6.0
    assert metric(text, "dfserve_spec_verify_rounds_total", arm="a", route="chat") == 8


def test_text_with_a_lone_surrogate_is_passed_on_as_the_client_escaped_it(one_arm: tuple[Stub, str]) -> None:
    """JSON may escape a lone surrogate, which UTF-8 cannot hold: the body the gateway re-encodes keeps the escape."""
    stub, gw = one_arm
    for body in (CHAT_STREAM, CHAT_WHOLE):
        raw = json.dumps({**body, "messages": [{"role": "user", "content": "\ud800 hi"}]}).encode()
        assert b"\\ud800" in raw
        via = httpx.post(gw + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert via.status_code == 200 and stub.seen[-1]["messages"][0]["content"] == "\ud800 hi"
        assert stub.seen[-1]["return_spec_tokens_details"] is True


def test_spec_details_a_client_asked_for_stay_and_a_server_without_them_leaves_an_estimate(
        one_arm: tuple[Stub, str]) -> None:
    """A client that asked for spec details (the load tester does) gets the stream untouched, and the gateway reads
    them from its last events; a server that sends none (before SGLang 0.5.23) leaves the stream to an estimate."""
    stub, gw = one_arm
    asked = {**CHAT_STREAM, "return_spec_tokens_details": True}
    direct = httpx.post(stub.url + "/v1/chat/completions", json=asked)
    via = httpx.post(gw + "/v1/chat/completions", json=asked)
    assert via.content == direct.content and b'"sglext"' in via.content
    old = {"x-stub": "no-spec-details"}
    direct = httpx.post(stub.url + "/v1/chat/completions", json=CHAT_STREAM, headers=old)
    via = httpx.post(gw + "/v1/chat/completions", json=CHAT_STREAM, headers=old)
    assert stub.seen[-1]["return_spec_tokens_details"] is True and via.content == direct.content
    text = httpx.get(gw + "/metrics").text
    assert metric(text, "dfserve_accept_length_sum", arm="a", route="chat", measure="exact") == 3.0  # 12 over 4
    assert metric(text, "dfserve_spec_verify_rounds_total", arm="a", route="chat") == 4
    # 3 content chunks carried 12 tokens (usage): an estimate, labelled so.
    assert metric(text, "dfserve_accept_length_sum", arm="a", route="chat", measure="estimated") == 4.0


@pytest.mark.parametrize(("route", "body", "status", "mode"), [
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 12}, "stream": True}, "4xx", "in-band"),
    ("/v1/chat/completions", CHAT_STREAM, "5xx", "in-band"),
    ("/v1/chat/completions", CHAT_STREAM, "5xx", "in-band-apart"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 2}, "stream": True}, "5xx", "outputs-abort")])
def test_a_stream_ended_by_an_error_in_band_is_a_failure(one_arm: tuple[Stub, str], route: str,
                                                         body: dict[str, Any], status: str, mode: str) -> None:
    """HTTP 200, then an error event: the client gets the bytes as sent, the metrics count a failure with the class
    of the error's code, and none of its latencies or tokens; also when the closing chunks after the error came in
    reads of their own, and when one output of several aborted and the other's events went on after it."""
    stub, gw = one_arm
    direct = httpx.post(stub.url + route, json=body, headers={"x-stub": mode})
    via = httpx.post(gw + route, json=body, headers={"x-stub": mode})
    assert via.status_code == 200 and via.content == direct.content
    text = httpx.get(gw + "/metrics").text
    api = "native" if route == "/generate" else "chat"
    assert metric(text, "dfserve_requests_total", arm="a", route=api, status=status, error="stream_error") == 1
    assert metric(text, "dfserve_requests_total", arm="a", route=api, status="2xx") == 0
    assert metric(text, "dfserve_time_to_first_token_seconds_count", arm="a", route=api) == 0
    assert metric(text, "dfserve_output_tokens_total", arm="a", route=api) == 0
    healthy = httpx.post(gw + route, json=body)  # the connection an error in band ended is still a good one
    assert healthy.status_code == 200


@pytest.mark.parametrize(("route", "body", "mode"), [
    ("/generate", {"text": "hi", "stream": True}, "garbage"), ("/generate", {"text": "hi"}, "garbage"),
    ("/v1/chat/completions", CHAT_WHOLE, "garbage"), ("/v1/chat/completions", CHAT_STREAM, "garbage"),
    ("/v1/chat/completions", CHAT_STREAM, "no-finish")])
def test_a_200_answer_that_is_not_sglangs_is_a_protocol_failure_passed_on_as_it_came(
        one_arm: tuple[Stub, str], route: str, body: dict[str, Any], mode: str) -> None:
    """A replica answering 200 with what is not SGLang's answer did not answer: the client gets the bytes as they
    came, and the metrics count the arm's protocol failure, with none of its latencies, as the load tester would;
    an OpenAI stream whose events are read only for their keys is one when no finish reason came before `[DONE]`
    (its events not JSON, or without one)."""
    stub, gw = one_arm
    direct = httpx.post(stub.url + route, json=body, headers={"x-stub": mode})
    via = httpx.post(gw + route, json=body, headers={"x-stub": mode})
    assert via.status_code == 200 and via.content == direct.content
    text = httpx.get(gw + "/metrics").text
    api = "native" if route == "/generate" else "chat"
    assert metric(text, "dfserve_requests_total", arm="a", route=api, status="error", error="protocol") == 1
    assert metric(text, "dfserve_requests_total", arm="a", route=api, status="2xx") == 0
    assert metric(text, "dfserve_e2e_request_latency_seconds_count", arm="a", route=api) == 0
    assert metric(text, "dfserve_upstream_errors_total", arm="a", kind="protocol") == 1
    assert httpx.post(gw + route, json=body).status_code == 200  # the replica is not taken down for it


@pytest.mark.parametrize("asked", [False, True])
def test_spec_details_in_a_read_of_their_own_give_exact_acceptance(one_arm: tuple[Stub, str], asked: bool) -> None:
    """SGLang writes its spec details, the usage chunk and `[DONE]` one after another: read apart, the spec details
    are third from the end. The acceptance is exact whether the gateway cut them out for the client or passed them
    on (a client that asked for them, as a mirror does)."""
    _, gw = one_arm
    body = {**CHAT_STREAM, "return_spec_tokens_details": True} if asked else CHAT_STREAM
    via = httpx.post(gw + "/v1/chat/completions", json=body, headers={"x-stub": "apart"})
    assert via.status_code == 200 and (b'"spec_tokens_details"' in via.content) == asked
    text = httpx.get(gw + "/metrics").text
    assert metric(text, "dfserve_accept_length_count", arm="a", route="chat", measure="exact") == 1
    assert metric(text, "dfserve_spec_verify_rounds_total", arm="a", route="chat") == 4


def test_a_native_stream_of_several_outputs_is_timed_and_its_counts_left_unknown_not_one_outputs(
        one_arm: tuple[Stub, str]) -> None:
    stub, gw = one_arm
    body = {"text": "hi", "sampling_params": {"n": 2}, "stream": True}
    direct = httpx.post(stub.url + "/generate", json=body, headers={"x-stub": "outputs"})
    via = httpx.post(gw + "/generate", json=body, headers={"x-stub": "outputs"})
    assert via.status_code == 200 and via.content == direct.content
    text = httpx.get(gw + "/metrics").text
    assert metric(text, "dfserve_requests_total", arm="a", route="native", status="2xx") == 1
    assert metric(text, "dfserve_time_to_first_token_seconds_count", arm="a", route="native") == 1
    assert metric(text, "dfserve_inter_chunk_latency_seconds_count", arm="a", route="native") == 3
    assert metric(text, "dfserve_output_tokens_total", arm="a", route="native") == 0  # one output's 4 were counted
    assert metric(text, "dfserve_spec_verify_rounds_total", arm="a", route="native") == 0


def test_a_gateway_that_reads_an_answer_late_times_it_by_its_arrival(tmp_path: Path) -> None:
    """TTFT and E2E are the replica's and the network's: a gateway whose loop gets to an answer late (here: stopped
    while the whole answer arrives) dates its reads by the kernel, and ends the request when its last byte came."""
    stop_s = 2.0  # against 1 s of the buckets read below: room for a loaded machine's wake-ups on the way
    with Stub() as stub, serve(gateway_argv(write_config(tmp_path, {"a": {"weight": 1, "replicas": [stub.url]}}))
                               ) as gateway:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, gateway.url + "/generate", json={"text": "hi", "stream": True},
                                 headers={"x-stub": "held"}, timeout=10)
            assert stub.headed.wait(10)
            os.kill(gateway.process.pid, signal.SIGSTOP)
            try:
                stub.release.set()
                time.sleep(stop_s)
            finally:
                os.kill(gateway.process.pid, signal.SIGCONT)
            assert answer.result().status_code == 200 and answer.result().content.endswith(b"data: [DONE]\n\n")
        text = httpx.get(gateway.url + "/metrics").text
    assert metric(text, "dfserve_e2e_request_latency_seconds_count", arm="a") == 1
    assert metric(text, "dfserve_e2e_request_latency_seconds_bucket", arm="a", le="1.0") == 1
    assert metric(text, "dfserve_time_to_first_token_seconds_bucket", arm="a", le="1.0") == 1


def test_a_client_that_leaves_at_done_ends_the_exchange_at_the_arrival_of_the_last_piece(tmp_path: Path) -> None:
    """The OpenAI SDK closes at `[DONE]`, before the replica's chunked end: the exchange ends when `[DONE]` arrived,
    not when the gateway's loop (here: stopped meanwhile) heard the client go."""
    with Stub() as stub, serve(gateway_argv(write_config(tmp_path, {"a": {"weight": 1, "replicas": [stub.url]}}))
                               ) as gateway:
        with httpx.Client(timeout=10) as client, client.stream(
                "POST", gateway.url + "/v1/chat/completions", json=CHAT_STREAM, headers={"x-stub": "end-held"}) as answer:
            lines = answer.iter_lines()  # held: a generator let go closes the response
            for line in lines:
                if line == "data: [DONE]":
                    break
            os.kill(gateway.process.pid, signal.SIGSTOP)
        try:
            time.sleep(2.0)  # the client has left; the gateway hears of it when it runs again
        finally:
            os.kill(gateway.process.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while metric(text := httpx.get(gateway.url + "/metrics").text, "dfserve_requests_total", arm="a") == 0:
            assert time.monotonic() < deadline, "the exchange never ended"
            time.sleep(0.02)
        stub.release.set()  # the replica's end comes only after the exchange ended without it
    assert metric(text, "dfserve_requests_total", arm="a", route="chat", status="2xx", error="") == 1
    assert metric(text, "dfserve_e2e_request_latency_seconds_bucket", arm="a", le="1.0") == 1


def test_native_stream_reads_exact_acceptance_and_per_token_gaps(one_arm: tuple[Stub, str]) -> None:
    stub, gw = one_arm
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 12}, "stream": True}
    direct = httpx.post(stub.url + "/generate", json=body)
    via = httpx.post(gw + "/generate", json=body)
    assert via.content == direct.content
    text = httpx.get(gw + "/metrics").text
    assert metric(text, "dfserve_accept_length_sum", arm="a", route="native", measure="exact") == 3.0
    assert metric(text, "dfserve_output_tokens_total", arm="a", route="native") == 12
    # chunks of 1, 4 and 7 tokens: two gaps, 11 per-token samples.
    assert metric(text, "dfserve_inter_chunk_latency_seconds_count", arm="a", route="native") == 2
    assert metric(text, "dfserve_inter_token_latency_per_token_seconds_count", arm="a", route="native") == 11


def test_mixed_exact_and_estimated_traffic_pools_only_exact_tokens(one_arm: tuple[Stub, str]) -> None:
    """Streamed chat from a server without spec details shows no verify rounds: its 12 tokens count as output but
    stay out of pooled acceptance, which over the exact requests (12 tokens, 4 rounds each) is 3, not
    (12 + 12 + 12) / 8."""
    _, gw = one_arm
    native = {"text": "hi", "sampling_params": {"max_new_tokens": 12}, "stream": True}
    old = {"x-stub": "no-spec-details"}
    for response in (httpx.post(gw + "/generate", json=native),
                     httpx.post(gw + "/v1/chat/completions", json=CHAT_STREAM, headers=old),
                     httpx.post(gw + "/v1/chat/completions", json=CHAT_WHOLE)):
        assert response.status_code == 200
    text = httpx.get(gw + "/metrics").text
    assert metric(text, "dfserve_accept_length_count", arm="a", measure="estimated") == 1
    assert metric(text, "dfserve_output_tokens_total", arm="a") == 36
    assert metric(text, "dfserve_spec_verify_rounds_total", arm="a") == 8
    assert metric(text, "dfserve_spec_output_tokens_total", arm="a") == 24
    assert metric(text, "dfserve_spec_output_tokens_total", arm="a", route="chat") == 12


def test_bad_input_gets_4xx_json_never_500(one_arm: tuple[Stub, str], tmp_path: Path) -> None:
    _, gw = one_arm
    cases = [
        (httpx.post(gw + "/v1/chat/completions", content=b"{not json"), 400),
        (httpx.post(gw + "/v1/chat/completions", content=b"[1, 2]"), 400),
        (httpx.post(gw + "/v1/chat/completions", content=b'{"max_tokens": ' + b"9" * 5000 + b"}"), 400),  # > 4300 digits
        (httpx.post(gw + "/v1/nope", json={}), 404),
        (httpx.get(gw + "/generate"), 405),
        (httpx.post(gw + "/generate", content=b"x" * (5 * 1024 * 1024)), 413),
    ]
    for response, status in cases:
        assert response.status_code == status
        assert response.json()["error"]["message"]
    assert cases[4][0].headers["allow"] == "POST"
    assert httpx.delete(gw + "/metrics").headers["allow"] == "GET, HEAD"
    text = httpx.get(gw + "/metrics").text  # counted as the gateway's own answers, not as any arm's
    answered = {status: metric(text, "dfserve_gateway_answered_requests_total", status=str(status))
                for status in (400, 404, 405, 413)}
    assert answered == {400: 3, 404: 1, 405: 2, 413: 1}
    assert metric(text, "dfserve_requests_total", arm="a", route="chat", status="4xx") == 0


def test_5xx_before_first_byte_retries_on_same_arm(tmp_path: Path) -> None:
    with Stub(status=500) as bad, Stub() as good:
        arms = {"a": {"weight": 1, "replicas": [bad.url, good.url]}}
        with gateway_server(write_config(tmp_path, arms, health={"interval_s": 60, "eject_after_failures": 1000})) as gw:
            for _ in range(6):
                response = httpx.post(gw + "/v1/chat/completions", json=CHAT_STREAM)
                assert response.status_code == 200 and response.headers["x-dfserve-replica"] == good.url
            text = httpx.get(gw + "/metrics").text
    assert bad.seen, "the failing replica was tried"
    assert metric(text, "dfserve_retries_total", arm="a", replica=good.url) == len(bad.seen)
    assert metric(text, "dfserve_upstream_errors_total", replica=bad.url, kind="http_500") == len(bad.seen)


def test_only_replica_5xx_is_passed_through(tmp_path: Path) -> None:
    with Stub(status=500) as bad, gateway_server(write_config(tmp_path, {"a": {"weight": 1, "replicas": [bad.url]}},
                                                              health={"interval_s": 60})) as gw:
        response = httpx.post(gw + "/v1/chat/completions", json=CHAT_STREAM)
        text = httpx.get(gw + "/metrics").text
    assert response.status_code == 500 and response.json()["message"] == "engine down"
    assert response.headers["x-dfserve-arm"] == "a"
    assert metric(text, "dfserve_requests_total", arm="a", status="5xx", error="http_status") == 1


def test_failure_after_first_byte_ends_with_well_formed_error_event(one_arm: tuple[Stub, str]) -> None:
    _, gw = one_arm
    response = httpx.post(gw + "/v1/chat/completions", json=CHAT_STREAM, headers={"x-stub": "cut"})
    assert response.status_code == 200
    body = response.content
    assert body.endswith(b"data: [DONE]\n\n")
    events = [e for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    assert all(json.loads(e[6:]) for e in events), "no event was cut in half"
    assert "error" in json.loads(events[-1][6:])
    text = httpx.get(gw + "/metrics").text
    assert metric(text, "dfserve_upstream_errors_total", arm="a", kind="stream_cut") == 1
    assert metric(text, "dfserve_requests_total", arm="a", status="error", error="stream_cut") == 1
    assert metric(text, "dfserve_requests_total", arm="a", status="2xx") == 0


def test_a_whole_stream_whose_connection_closed_short_of_its_length_gets_no_error_after_its_end(
        one_arm: tuple[Stub, str]) -> None:
    """The client had every event and `[DONE]`: an error event and a second `[DONE]` after them made its stream
    malformed. It is an answer, as one a client leaves at `[DONE]` is (and a killed replica's after its `[DONE]`)."""
    _, gw = one_arm
    response = httpx.post(gw + "/v1/chat/completions", json=CHAT_STREAM, headers={"x-stub": "long-length"})
    assert response.status_code == 200
    assert response.content == b"".join(sse(e) for e in CHAT_EVENTS) + b"data: [DONE]\n\n"
    text = httpx.get(gw + "/metrics").text
    assert metric(text, "dfserve_requests_total", arm="a", status="2xx", error="") == 1


def test_a_gzipped_stream_is_passed_on_whole_as_it_came_and_counted_unreadable(one_arm: tuple[Stub, str]) -> None:
    """The gateway asks for identity; a replica that gzips anyway: its events cannot be read as they pass, and an
    error event in plain text after gzip bytes broke the client's decoding."""
    _, gw = one_arm
    response = httpx.post(gw + "/v1/chat/completions", json=CHAT_STREAM, headers={"x-stub": "gzip"})
    assert response.status_code == 200 and response.headers["content-encoding"] == "gzip"
    assert response.content == b"".join(sse(e) for e in CHAT_EVENTS) + b"data: [DONE]\n\n"  # httpx decoded it
    text = httpx.get(gw + "/metrics").text
    assert metric(text, "dfserve_requests_total", arm="a", status="error", error="protocol") == 1


def test_requests_that_make_the_engine_fail_never_take_an_arm_down(tmp_path: Path) -> None:
    """One client's requests answered 500 used to eject an arm's only replica, and every client got 503 until the
    next health check; passive signals now never eject the last healthy replica (health checks still do)."""
    with Stub() as stub:
        config = write_config(tmp_path, {"a": {"weight": 1, "replicas": [stub.url]}},
                              health={"interval_s": 60, "eject_after_failures": 2})
        with gateway_server(config) as gw:
            poisoned = [httpx.post(gw + "/v1/chat/completions", json=CHAT_STREAM, headers={"x-stub": "poison"})
                        for _ in range(5)]
            after = httpx.post(gw + "/v1/chat/completions", json=CHAT_STREAM)
            text = httpx.get(gw + "/metrics").text
    assert [r.status_code for r in poisoned] == [500] * 5 and after.status_code == 200
    assert metric(text, "dfserve_upstream_errors_total", arm="a", kind="http_500") == 5
    assert metric(text, "dfserve_replica_ejections_total", arm="a") == 0
    assert metric(text, "dfserve_replica_healthy", replica=stub.url) == 1


def test_a_replica_whose_health_check_takes_a_second_as_sglangs_does_stays_healthy(tmp_path: Path) -> None:
    """SGLang 0.5.23's /health generates a token, then answers a second later at the soonest."""
    with Stub(health_s=1.1) as stub, gateway_server(write_config(tmp_path, {"a": {"weight": 1, "replicas": [stub.url]}},
                                                                  health={"interval_s": 0.2, "eject_after_failures": 1})) as gw:
        time.sleep(2.5)
        text = httpx.get(gw + "/metrics").text
        assert metric(text, "dfserve_upstream_errors_total", kind="health") == 0
        assert metric(text, "dfserve_replica_healthy", arm="a") == 1
        assert httpx.post(gw + "/v1/chat/completions", json=CHAT_WHOLE).status_code == 200


def test_dead_replica_is_ejected_then_readmitted(tmp_path: Path) -> None:

    def wait_for(name: str, value: float) -> str:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = httpx.get(gw + "/metrics").text
            if metric(text, name, replica=dead) == value:
                return text
            time.sleep(0.1)
        raise AssertionError(f"{name}{{replica={dead}}} never reached {value}")

    with refusing_port() as dead_sock, Stub() as good:
        dead = url_of(dead_sock)
        arms = {"a": {"weight": 1, "replicas": [dead, good.url]}}
        with gateway_server(write_config(tmp_path, arms)) as gw:
            text = wait_for("dfserve_replica_ejections_total", 1)
            assert metric(text, "dfserve_replica_healthy", replica=dead) == 0
            assert metric(text, "dfserve_replica_healthy", replica=good.url) == 1
            for _ in range(4):
                assert httpx.post(gw + "/v1/chat/completions", json=CHAT_STREAM).status_code == 200
            with Stub(sock=dead_sock) as revived:  # the replica comes back: the next health check re-admits it
                wait_for("dfserve_replica_healthy", 1)
                replies = [httpx.post(gw + "/v1/chat/completions", json=CHAT_STREAM) for _ in range(8)]
                assert {r.headers["x-dfserve-replica"] for r in replies} == {dead, good.url}
                assert revived.seen


def metrics_once_left(gw: str) -> str:
    """The gateway's /metrics once it has counted the one client that left (499), within 5 s."""
    deadline = time.monotonic() + 5
    while True:
        text = httpx.get(gw + "/metrics").text
        if metric(text, "dfserve_requests_total", arm="a", status="499") == 1 or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def test_client_disconnect_cancels_upstream(one_arm: tuple[Stub, str]) -> None:
    stub, gw = one_arm
    with httpx.stream("POST", gw + "/v1/chat/completions", json=CHAT_STREAM, headers={"x-stub": "slow"}) as response:
        next(response.iter_raw())
    assert stub.cancelled.wait(5), "upstream request was not cancelled"
    text = metrics_once_left(gw)
    assert metric(text, "dfserve_requests_total", arm="a", status="499", error="client_disconnect") == 1
    assert metric(text, "dfserve_requests_in_flight", arm="a") == 0


def test_a_client_that_leaves_before_the_answer_starts_is_counted_against_the_replica_it_waited_for(
        one_arm: tuple[Stub, str]) -> None:
    stub, gw = one_arm
    with pytest.raises(httpx.ReadTimeout):
        # leaves after 1.5 s, the replica's answer starting after 3: the request went upstream long before
        httpx.post(gw + "/v1/chat/completions", json=CHAT_STREAM, headers={"x-stub": "stall"}, timeout=1.5)
    text = metrics_once_left(gw)
    assert metric(text, "dfserve_requests_total", arm="a", status="499", replica=stub.url) == 1


def test_a_slow_client_slows_the_upstream_instead_of_filling_the_gateway(one_arm: tuple[Stub, str]) -> None:
    stub, gw = one_arm
    with httpx.stream("POST", gw + "/v1/chat/completions", json=CHAT_STREAM, headers={"x-stub": "flood"},
                      timeout=30) as response:
        # the client reads nothing: every socket buffer on the way fills, then the upstream waits (however slowly a
        # busy machine gets there: its writes are watched until they stop for half a second, 10 s at most)
        held, deadline = -1, time.monotonic() + 10
        while stub.flood_written != held and time.monotonic() < deadline:
            held = stub.flood_written
            time.sleep(0.5)
        stopped = stub.flood_written == held
        body = b"".join(response.iter_raw())
    assert stopped and held < FLOOD_EVENTS  # the engine is held, not read into the gateway
    assert body == FLOOD_EVENT * FLOOD_EVENTS + b"data: [DONE]\n\n"


def test_a_stalled_client_is_abandoned_without_blaming_the_replica(tmp_path: Path) -> None:
    with Stub() as stub, gateway_server(write_config(tmp_path, {"a": {"weight": 1, "replicas": [stub.url]}},
                                                     limits={"read_timeout_s": 0.5})) as gw:
        with httpx.stream("POST", gw + "/v1/chat/completions", json=CHAT_STREAM, headers={"x-stub": "flood"},
                          timeout=30) as response:
            deadline = time.monotonic() + 30  # reads nothing until the gateway has given it up
            while metric(httpx.get(gw + "/metrics").text, "dfserve_requests_total", arm="a", status="499",
                         error="client_stalled") == 0:
                assert time.monotonic() < deadline, "the stalled client was never given up"
                time.sleep(0.1)
            body = b"".join(response.iter_raw())
        text = httpx.get(gw + "/metrics").text
    events = body.split(b"\n\n")
    assert b'"upstream_error"' in events[-3] and events[-2] == b"data: [DONE]"
    assert metric(text, "dfserve_requests_total", arm="a", status="499", error="client_stalled") == 1
    assert metric(text, "dfserve_upstream_errors_total", arm="a") == 0
    assert metric(text, "dfserve_replica_healthy", arm="a") == 1


def test_models_and_health(one_arm: tuple[Stub, str]) -> None:
    _, gw = one_arm
    models = httpx.get(gw + "/v1/models")
    assert models.json()["data"][0]["id"] == "qwen" and models.headers["x-dfserve-arm"] == "a"
    assert httpx.get(gw + "/health").json() == {"status": "ok", "arms": {"a": True}}



def test_arm_concurrency_limit_and_read_timeout(tmp_path: Path) -> None:
    with Stub() as stub:
        config = write_config(tmp_path, {"a": {"weight": 1, "replicas": [stub.url]}},
                              limits={"max_concurrent_per_arm": 1, "read_timeout_s": 0.5})
        with gateway_server(config) as gw:
            # the gateway's own refusal, before any replica had the request, is counted on a failure series
            # exported at 0 from the start: Prometheus' rate() never counts a series' first sample
            started = [line for line in httpx.get(gw + "/metrics").text.splitlines()
                       if line.startswith("dfserve_requests_failed_total{")
                       and all(label in line for label in ('arm="a"', 'route="chat"', 'replica=""'))]
            assert len(started) == 1 and started[0].endswith(" 0.0"), started
            with httpx.stream("POST", gw + "/v1/chat/completions", json=CHAT_STREAM, headers={"x-stub": "slow"}) as busy:
                still_reading = busy.iter_raw()  # held: dropping the iterator would close the stream
                next(still_reading)
                refused = httpx.post(gw + "/v1/chat/completions", json=CHAT_STREAM)
            assert refused.status_code == 429 and refused.json()["error"]["message"]
            text = httpx.get(gw + "/metrics").text
            assert metric(text, "dfserve_requests_total", arm="a", status="4xx", error="overloaded") == 1
            assert metric(text, "dfserve_requests_failed_total", arm="a", route="chat", replica="") == 1
            deadline = time.monotonic() + 5
            while httpx.post(gw + "/v1/chat/completions", json=CHAT_STREAM).status_code != 200:
                assert time.monotonic() < deadline, "the slot was never returned"
                time.sleep(0.05)
            stalled = httpx.post(gw + "/v1/chat/completions", json=CHAT_STREAM, headers={"x-stub": "stall"})
            assert stalled.status_code == 504 and stalled.headers["x-dfserve-arm"] == "a"


def test_down_arm_sheds_only_when_configured(tmp_path: Path) -> None:
    with refusing_port() as dead_sock, Stub() as stub:
        dead = url_of(dead_sock)
        for shed, expected in ((True, {200}), (False, {200, 503})):
            arms = {"up": {"weight": 1, "replicas": [stub.url]}, "down": {"weight": 1, "replicas": [dead]}}
            with gateway_server(write_config(tmp_path, arms, shed=shed)) as gw:
                deadline = time.monotonic() + 10
                while httpx.get(gw + "/health").json()["arms"]["down"]:
                    assert time.monotonic() < deadline, "dead replica never ejected"
                    time.sleep(0.1)
                statuses = {httpx.post(gw + "/v1/chat/completions", json=CHAT_STREAM).status_code for _ in range(30)}
                documents = {httpx.get(gw + "/v1/models").status_code for _ in range(30)}  # a client's probe too
            assert statuses == expected and documents == expected, (shed, statuses, documents)
