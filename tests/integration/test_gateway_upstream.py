"""The gateway against an upstream that writes raw bytes no HTTP library would send: a header value with a bare line
break, a head whose lines end in bare LFs, interim 1xx responses, a 204 without framing, a head over 64 KiB in one
write, an event that never ends, a stream that ends without `[DONE]` or in half an event, a whole body past its
bound; and
the same gateway with its relay in pure Python (the C extension made unimportable), byte for byte and metric for
metric."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.integration.servers import LOOPBACK, dfserve_argv, gateway_argv, gateway_server, serve, url_of

pytestmark = pytest.mark.slow

HEALTH = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
NATIVE_EVENTS = b"".join(
    b"data: " + json.dumps({"text": "x" * n, "meta_info": {"id": "r1", "completion_tokens": n, "prompt_tokens": 5}
                           | ({"spec_verify_ct": 4} if n == 12 else {})}).encode() + b"\n\n"
    for n in (1, 5, 9, 12)) + b"data: [DONE]\n\n"
EVENT_CAP = 256 * 1024
BODY_CAP = 1024 * 1024


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class RawUpstream:
    """A loopback server in a thread of its own that answers each request with the bytes its `x-raw` header
    names (keep-alive; `GET /health` is always 200)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((LOOPBACK, 0))
        self.url = url_of(self.sock)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.targets: list[bytes] = []
        """The request target of every request but health checks, as it came."""

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, sock=self.sock))
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> RawUpstream:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _shutdown(self) -> None:
        self._server.close()
        connections = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in connections:
            task.cancel()
        await asyncio.gather(*connections, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                headers = dict(line.lower().split(b": ", 1) for line in lines[1:] if b": " in line)
                await reader.readexactly(int(headers.get(b"content-length", b"0")))
                path = lines[0].split(b" ")[1]
                if path != b"/health":
                    self.targets.append(path)
                await self.answer(b"health" if path == b"/health" else headers.get(b"x-raw", b""), writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def answer(self, behaviour: bytes, writer: asyncio.StreamWriter) -> None:
        if behaviour == b"health":
            writer.write(HEALTH)
        elif behaviour == b"inject":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-evil: a\nSet-Cookie: pwned=1\r\n"
                         b"content-length: 2\r\n\r\n{}")
        elif behaviour == b"huge-head":
            fields = b"".join(b"x-field-%05d: %s\r\n" % (n, b"v" * 40) for n in range(1400))
            writer.write(b"HTTP/1.1 200 OK\r\n" + fields + b"content-length: 2\r\n\r\n{}")
        elif behaviour == b"interim":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await asyncio.sleep(0.2)
            writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>; rel=preload\r\n\r\n" + SSE_HEAD)
            await asyncio.sleep(0.05)
            writer.write(chunk(NATIVE_EVENTS) + b"0\r\n\r\n")
        elif behaviour == b"lf-head":  # and the connection left open: the head's end is never a CRLF CRLF
            writer.write(b"HTTP/1.1 200 OK\ncontent-type: application/json\ncontent-length: 2\n\n{}")
        elif behaviour == b"no-done":
            writer.write(SSE_HEAD + chunk(NATIVE_EVENTS.removesuffix(b"data: [DONE]\n\n")) + b"0\r\n\r\n")
        elif behaviour == b"half-event":
            writer.write(SSE_HEAD + chunk(NATIVE_EVENTS[:NATIVE_EVENTS.index(b"\n\n") + 2] + b'data: {"text": "x')
                         + b"0\r\n\r\n")
        elif behaviour == b"big-whole":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (2 * BODY_CAP))
            for _ in range(32):
                writer.write(b" " * (BODY_CAP // 16))
                await writer.drain()
        elif behaviour in (b"done-then-wait", b"first-then-wait"):  # the body's end comes a second later
            split = len(NATIVE_EVENTS) if behaviour == b"done-then-wait" else NATIVE_EVENTS.index(b"\n\n") + 2
            writer.write(SSE_HEAD + chunk(NATIVE_EVENTS[:split]))
            await writer.drain()
            await asyncio.sleep(1.0)
            writer.write((chunk(NATIVE_EVENTS[split:]) if split < len(NATIVE_EVENTS) else b"") + b"0\r\n\r\n")
        elif behaviour == b"no-content":
            writer.write(b"HTTP/1.1 204 No Content\r\nx-engine: raw\r\n\r\n")
        elif behaviour == b"endless-event":
            writer.write(SSE_HEAD + chunk(NATIVE_EVENTS[:NATIVE_EVENTS.index(b"\n\n") + 2] + b"data: {\"text\": \""))
            for _ in range(64):  # 4 MiB, well past the cap, and never a blank line
                writer.write(chunk(b"x" * 65536))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
        else:  # a native stream in awkward framing: an event split across chunks, several in one
            cuts = (0, 7, 40, 41, 200, len(NATIVE_EVENTS))
            writer.write(SSE_HEAD)
            for start, end in itertools.pairwise(cuts):
                writer.write(chunk(NATIVE_EVENTS[start:end]))
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
        await writer.drain()


def write_config(tmp_path: Path, url: str) -> Path:
    config = {"schema_version": 1, "arms": {"a": {"weight": 1, "replicas": [url]}}, "scrape": {"enabled": False},
              "health": {"interval_s": 5}, "limits": {"read_timeout_s": 3, "max_event_bytes": EVENT_CAP, "max_response_bytes": BODY_CAP}}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RawUpstream, str]]:
    with RawUpstream() as upstream, gateway_server(write_config(tmp_path_factory.mktemp("gw"), upstream.url)) as gw:
        yield upstream, gw


def metric(gw: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(gw + "/metrics").text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.partition("{")[0] == name and all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


GENERATE = {"text": "def f():", "stream": True, "sampling_params": {"max_new_tokens": 12}}


def post(gw: str, behaviour: str) -> httpx.Response:
    return httpx.post(gw + "/generate", json=GENERATE, headers={"x-raw": behaviour}, timeout=10)


def test_a_header_smuggled_by_a_bare_line_break_never_reaches_the_client(gateway: tuple[RawUpstream, str]) -> None:
    _, gw = gateway
    with socket.create_connection((LOOPBACK, int(gw.rsplit(":", 1)[1])), timeout=10) as client:
        client.sendall(b"POST /generate HTTP/1.1\r\nHost: gw\r\nx-raw: inject\r\nconnection: close\r\n"
                       b"content-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
        answer = b""
        while piece := client.recv(65536):
            answer += piece
    assert answer.startswith(b"HTTP/1.1 502 ") and b"pwned" not in answer.lower()
    assert metric(gw, "dfserve_upstream_errors_total", kind="bad_response") >= 1


def test_a_head_over_64_kib_in_one_write_is_refused(gateway: tuple[RawUpstream, str]) -> None:
    _, gw = gateway
    before = metric(gw, "dfserve_upstream_errors_total", kind="bad_response")
    response = post(gw, "huge-head")
    assert response.status_code == 502 and "x-field-00000" not in response.headers
    assert metric(gw, "dfserve_upstream_errors_total", kind="bad_response") == before + 1


def test_interim_responses_are_skipped_and_the_stream_relayed(gateway: tuple[RawUpstream, str]) -> None:
    _, gw = gateway
    response = post(gw, "interim")
    assert response.status_code == 200 and response.content == NATIVE_EVENTS
    assert "link" not in response.headers


def test_a_204_is_answered_at_once_without_waiting_for_a_body(gateway: tuple[RawUpstream, str]) -> None:
    _, gw = gateway
    response = httpx.get(gw + "/v1/models", headers={"x-raw": "no-content"}, timeout=10)
    assert response.status_code == 204 and response.content == b"" and response.headers["x-engine"] == "raw"
    assert response.elapsed.total_seconds() < 2  # the read timeout (3 s) never came into it
    assert post(gw, "stream").content == NATIVE_EVENTS  # and the kept-alive connection serves the next request


def test_an_event_past_the_cap_ends_the_stream_with_an_error_event(gateway: tuple[RawUpstream, str]) -> None:
    _, gw = gateway
    response = post(gw, "endless-event")
    assert response.status_code == 200
    events = response.content.split(b"\n\n")
    assert events[0] + b"\n\n" == NATIVE_EVENTS[:NATIVE_EVENTS.index(b"\n\n") + 2]
    error = json.loads(events[1].removeprefix(b"data: "))["error"]
    assert f"an event longer than {EVENT_CAP} bytes" in error["message"] and error["code"] == 502
    assert events[2:] == [b"data: [DONE]", b""]
    assert metric(gw, "dfserve_requests_total", error="event_too_large", status="error") == 1
    assert metric(gw, "dfserve_upstream_errors_total", kind="event_too_large") == 1


def test_a_head_with_bare_lf_line_endings_is_a_bad_response_at_once(gateway: tuple[RawUpstream, str]) -> None:
    _, gw = gateway
    before = metric(gw, "dfserve_upstream_errors_total", kind="bad_response")
    response = post(gw, "lf-head")
    assert response.status_code == 502
    assert response.elapsed.total_seconds() < 2  # not the read timeout's 3 s
    assert metric(gw, "dfserve_upstream_errors_total", kind="bad_response") == before + 1
    assert metric(gw, "dfserve_requests_total", error="bad_response", status="5xx") >= 1


@pytest.mark.parametrize(("behaviour", "relayed"), [
    ("no-done", NATIVE_EVENTS.removesuffix(b"data: [DONE]\n\n")),
    ("half-event", NATIVE_EVENTS[:NATIVE_EVENTS.index(b"\n\n") + 2]),
])
def test_a_stream_cut_short_in_well_framed_bytes_is_a_failure_and_never_half_an_event(
        gateway: tuple[RawUpstream, str], behaviour: str, relayed: bytes) -> None:
    _, gw = gateway
    before = metric(gw, "dfserve_requests_total", error="stream_cut", status="error")
    response = post(gw, behaviour)
    assert response.status_code == 200 and response.content.startswith(relayed)
    rest = response.content.removeprefix(relayed)
    # an error event follows, unless the relay had already ended the client's body with the upstream's last events
    # (the end of the chunked body in the same read as them): a client then sees no [DONE] and knows
    if rest or behaviour == "half-event":
        error = json.loads(rest.split(b"\n\n")[0].removeprefix(b"data: "))["error"]
        assert "ended the stream before [DONE]" in error["message"] and error["code"] == 502
        assert rest.endswith(b"\n\ndata: [DONE]\n\n")
    assert metric(gw, "dfserve_requests_total", error="stream_cut", status="error") == before + 1


def test_a_whole_body_past_its_bound_is_a_502_and_let_go(gateway: tuple[RawUpstream, str]) -> None:
    _, gw = gateway
    response = httpx.post(gw + "/generate", json={"text": "a"}, headers={"x-raw": "big-whole"}, timeout=10)
    assert response.status_code == 502 and f"a body longer than {BODY_CAP} bytes" in response.json()["error"]["message"]
    assert metric(gw, "dfserve_requests_total", error="body_too_large") == 1
    assert metric(gw, "dfserve_upstream_errors_total", kind="body_too_large") == 1


def test_the_query_string_goes_upstream_as_the_client_sent_it(gateway: tuple[RawUpstream, str]) -> None:
    upstream, gw = gateway
    query = "api-version=2024-06-01&x=%C3%A9&empty="
    assert httpx.post(f"{gw}/generate?{query}", json=GENERATE, timeout=10).content == NATIVE_EVENTS
    assert httpx.get(f"{gw}/v1/models?limit=5", headers={"x-raw": "no-content"}, timeout=10).status_code == 204
    assert upstream.targets[-2:] == [f"/generate?{query}".encode(), b"/v1/models?limit=5"]


def leave_after(gw: str, behaviour: str, seen: bytes) -> None:
    """A client that closes its connection as soon as `seen` has come, as OpenAI's SDK does at `[DONE]`."""
    body = json.dumps(GENERATE).encode()
    with socket.create_connection((LOOPBACK, int(gw.rsplit(":", 1)[1])), timeout=10) as client:
        client.sendall(b"POST /generate HTTP/1.1\r\nHost: gw\r\nx-raw: %b\r\ncontent-type: application/json\r\n"
                       b"content-length: %d\r\n\r\n%b" % (behaviour.encode(), len(body), body))
        answer = b""
        while seen not in answer:
            answer += client.recv(65536)


def test_a_client_that_leaves_at_done_was_answered_and_one_that_leaves_before_was_not(
        gateway: tuple[RawUpstream, str]) -> None:
    _, gw = gateway
    answered = metric(gw, "dfserve_requests_total", status="2xx", route="native")
    left = metric(gw, "dfserve_requests_total", error="client_disconnect")
    leave_after(gw, "done-then-wait", b"data: [DONE]\n\n")
    leave_after(gw, "first-then-wait", b"\n\n")
    for _ in range(100):
        if metric(gw, "dfserve_requests_total", status="2xx", route="native") == answered + 1 and metric(
                gw, "dfserve_requests_total", error="client_disconnect") == left + 1:
            break
        time.sleep(0.05)
    assert metric(gw, "dfserve_requests_total", status="2xx", route="native") == answered + 1
    assert metric(gw, "dfserve_requests_total", error="client_disconnect") == left + 1
    assert metric(gw, "dfserve_output_tokens_total", route="native") > 0
    assert post(gw, "stream").content == NATIVE_EVENTS  # no connection left with a body's end still to come


def twin_argv(config: Path) -> list[str]:
    """The gateway in a Python where the C extension cannot be imported, as in an install without a compiler."""
    return [sys.executable, "-c", "import sys, runpy; sys.modules['dfserve._relay'] = None; "
            "runpy.run_module('dfserve', run_name='__main__')", *gateway_argv(config)[len(dfserve_argv()):]]


def test_without_the_extension_the_gateway_relays_through_the_twin_alike(tmp_path: Path) -> None:
    log = tmp_path / "twin.log"
    with RawUpstream() as upstream, gateway_server(write_config(tmp_path, upstream.url)) as accelerated, \
            serve(twin_argv(write_config(tmp_path, upstream.url)), log=log) as twin:
        for gw in (accelerated, twin.url):
            for behaviour in ("stream", "interim", "stream"):
                assert post(gw, behaviour).content == NATIVE_EVENTS
            assert json.loads(post(gw, "endless-event").content.split(b"\n\n")[1][6:])["error"]["code"] == 502
        figures: list[dict[str, Any]] = [
            {name: metric(gw, name, route="native") for name in (
                "dfserve_output_tokens_total", "dfserve_spec_verify_rounds_total", "dfserve_accept_length_sum",
                "dfserve_inter_chunk_latency_seconds_count", "dfserve_inter_token_latency_per_token_seconds_count",
                "dfserve_time_to_first_token_seconds_count", "dfserve_requests_total")}
            for gw in (accelerated, twin.url)]
    # Gaps are counted per read that brings events, and how the upstream's writes split into reads depends on the
    # machine's load: both relays must count some, the same number only on the same reads (the unit tests' job).
    gaps = ("dfserve_inter_chunk_latency_seconds_count", "dfserve_inter_token_latency_per_token_seconds_count")
    assert all(f.pop(name) > 0 for f in figures for name in gaps)
    assert figures[0] == figures[1] and figures[0]["dfserve_output_tokens_total"] == 3 * 12
    assert "using its pure-Python twin" in log.read_text()
