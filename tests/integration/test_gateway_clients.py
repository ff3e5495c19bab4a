"""The client side of a real `dfserve gateway` on loopback, talked to with raw sockets: slow and surplus clients cut
off and counted, what of a request is forwarded upstream, and bad input answered 4xx without a traceback."""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.integration.servers import LOOPBACK, gateway_server

ANSWER = json.dumps({"text": "ok", "meta_info": {"id": "r", "finish_reason": {"type": "stop"}, "prompt_tokens": 1,
                                                 "completion_tokens": 2, "spec_verify_ct": 1}}).encode()


class Recorder(http.server.ThreadingHTTPServer):
    """An SGLang stand-in that records the headers of every POST it gets and answers a whole native response."""

    daemon_threads = True

    def __init__(self) -> None:
        self.heads: list[dict[str, str]] = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self._answer(b"{}")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                recorder.heads.append({name.lower(): value for name, value in self.headers.items()})
                self._answer(ANSWER)

            def _answer(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__((LOOPBACK, 0), Handler)
        self.url = f"http://{LOOPBACK}:{self.server_address[1]}"


@contextlib.contextmanager
def recorder() -> Iterator[Recorder]:
    server = Recorder()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def write_config(tmp_path: Path, replica: str, **limits: Any) -> Path:
    config = {"arms": {"a": {"weight": 1, "replicas": [replica]}}, "scrape": {"enabled": False},
              "health": {"interval_s": 60}, "limits": limits}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
    sock.close()
    return received


def refused(metrics: str, reason: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(f'dfserve_client_connections_refused_total{{reason="{reason}"}} '):
            return float(line.rsplit(" ", 1)[1])
    raise LookupError(reason)


def test_slow_and_surplus_clients_are_cut_off_as_configured_and_counted(tmp_path: Path) -> None:
    with recorder() as upstream, gateway_server(write_config(tmp_path, upstream.url, max_connections=3,
                                                             head_timeout_s=0.5, body_timeout_s=0.5)) as gw:
        slow_head, slow_body, idle = connect(gw), connect(gw), connect(gw)
        slow_head.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        slow_body.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        surplus = read_until_closed(connect(gw))
        for _ in range(8):  # past both deadlines, though bytes keep coming
            for sock, byte in ((slow_head, b"X"), (slow_body, b" ")):
                with contextlib.suppress(OSError):
                    sock.sendall(byte)
            time.sleep(0.1)
        answers = [read_until_closed(sock) for sock in (slow_head, slow_body, idle)]
        deadline = time.monotonic() + 5
        while (scraped := httpx.get(gw + "/metrics")).status_code == 503:  # until the gateway has seen them close
            assert time.monotonic() < deadline
            time.sleep(0.05)
        metrics = scraped.text
    assert surplus.startswith(b"HTTP/1.1 503 Service Unavailable\r\n") and b"limits.max_connections" in surplus
    assert answers[0].startswith(b"HTTP/1.1 408 ") and b"request head not received within 0.5 s" in answers[0]
    assert answers[1].startswith(b"HTTP/1.1 408 ") and b"request body not received within 0.5 s" in answers[1]
    assert answers[2] == b""  # sent nothing: closed without an answer
    assert (refused(metrics, "over_capacity"), refused(metrics, "head_timeout"), refused(metrics, "body_timeout")) \
        == (1, 2, 1)


def test_a_kept_alive_connection_is_closed_after_the_configured_idle_timeout(tmp_path: Path) -> None:
    with recorder() as upstream, gateway_server(write_config(tmp_path, upstream.url, idle_timeout_s=0.5,
                                                             head_timeout_s=30)) as gw:
        sock = connect(gw)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        began = time.monotonic()
        answer = read_until_closed(sock)
        idle_s = time.monotonic() - began
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.count(b"HTTP/1.1") == 1
    assert 0.4 < idle_s < 5


def test_hop_by_hop_headers_and_trailers_stay_on_the_client_side(tmp_path: Path) -> None:
    """Headers the client's Connection header names are hop-by-hop (RFC 9110 §7.6.1), and trailer fields of a
    chunked body are not headers: neither reaches the replica. Nor does the compression the client accepts: the
    gateway reads every answer, and asks for it uncompressed."""
    with recorder() as upstream, gateway_server(write_config(tmp_path, upstream.url)) as gw:
        sock = connect(gw)
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\n"
                     b"X-Kept: 1\r\nAccept-Encoding: gzip, deflate\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"d\r\n{\"text\": \"a\"}\r\n0\r\nX-Trailer: evil\r\nX-Kept: 2\r\n\r\n"
                     b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answers = read_until_closed(sock)
    assert answers.startswith(b"HTTP/1.1 200 OK\r\n") and answers.count(b"HTTP/1.1 200 OK\r\n") == 2
    (head,) = upstream.heads
    assert head["x-kept"] == "1" and not {"x-hop", "x-trailer", "connection"} & head.keys()
    assert head["accept-encoding"] == "identity"


def test_head_of_health_answers_like_get_without_a_body(tmp_path: Path) -> None:
    with recorder() as upstream, gateway_server(write_config(tmp_path, upstream.url)) as gw:
        sock = connect(gw)
        sock.sendall(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answers = read_until_closed(sock)
    head, _, rest = answers.partition(b"\r\n\r\n")
    get_head, _, get_body = rest.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and get_head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"content-length: %d" % len(get_body) in head  # the HEAD answer's body is the next answer's head
    assert json.loads(get_body)["status"] == "ok"


def test_a_transfer_coding_other_than_chunked_is_a_501_never_read_as_plain_chunks(tmp_path: Path) -> None:
    """RFC 9112 §6.1: a coding the server does not know is not implemented; read as chunked, a gzip body would be
    refused as invalid JSON, and a body only mislabelled would be taken as it is."""
    with recorder() as upstream, gateway_server(write_config(tmp_path, upstream.url)) as gw:
        sock = connect(gw)
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
                     b"d\r\n{\"text\": \"a\"}\r\n0\r\n\r\n")
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 501 ") and b"transfer coding 'gzip' is not supported" in answer
    assert not upstream.heads


def test_deeply_nested_json_is_a_400_without_a_traceback_or_a_log_line(tmp_path: Path) -> None:
    log = tmp_path / "gateway.log"
    nested = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with recorder() as upstream, gateway_server(write_config(tmp_path, upstream.url), log=log) as gw:
        logged = log.read_text()
        with httpx.Client(base_url=gw) as client:
            answers = [client.post(path, content=nested) for path in ("/generate", "/v1/chat/completions") * 25]
        assert log.read_text() == logged
    assert {a.status_code for a in answers} == {400}
    assert {a.json()["error"]["message"] for a in answers} == {"request body: JSON nested too deeply"}
    assert not upstream.heads
