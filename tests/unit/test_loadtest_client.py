"""The load tester's client against servers on loopback whose answers have no end in sight: what it keeps of one
answer is bounded, and the request fails as the server's protocol error, soon and in one line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

import pytest

from dfserve.capture.replay import ReplayTask
from dfserve.loadtest import client as tester_client
from dfserve.loadtest.client import ArmClient, Finished, derive
from dfserve.sglang import SamplingParams

CAP = 64 * 1024
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def chat_event(content: str, finish: str | None = None) -> bytes:
    body = {"id": "c", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": content}, "finish_reason": finish}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def run(answer: list[bytes], head: bytes = HEAD, answer_cap: int = 64 * CAP,
        then: Callable[[], None] | None = None, timeout_s: float = 10.0, ended: bool = True) -> tuple[Finished, int]:
    """One chat request to a server that writes `head`, then `answer`'s chunks (each a read of its own, as far as
    the loop goes, chunked unless `head` gives a length) until the client hangs up, then the body's end unless not
    `ended`, then calls `then`, on the client's loop, and closes after the client; what the client handed its sink,
    and how many bytes the server got to write."""
    framed = b"chunked" in head
    written = 0
    served = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal written
        request = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in request.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        writer.write(head)
        with contextlib.suppress(ConnectionError):  # the client hung up: what an endless answer is for
            for part in answer:
                writer.write(chunk(part) if framed else part)
                written += len(part)
                await writer.drain()
                await asyncio.sleep(0)
            writer.write(b"0\r\n\r\n" if framed and ended else b"")
            await writer.drain()
        if then is not None:
            then()
            await reader.read()  # the client's end first: a FIN after the answer would date its last read
        writer.close()
        served.set()

    async def go() -> Finished:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        finished: list[Finished] = []
        client = ArmClient("a", f"http://127.0.0.1:{port}", "chat", SamplingParams(max_new_tokens=8), finished.append,
                           t0=0.0, request_timeout_s=timeout_s, max_event_bytes=CAP, max_answer_bytes=answer_cap)
        task = ReplayTask(id="t", prompt="p", route="chat", body={"messages": [{"role": "user", "content": "p"}]})
        try:
            await client.send(task, 0, warmup=False, scheduled_s=None)
        finally:
            client.close()
            if then is not None:
                await asyncio.wait_for(served.wait(), 5)
            server.close()
            await server.wait_closed()
        return finished[0]

    return asyncio.run(go()), written


def test_an_event_that_never_ends_fails_the_request_as_protocol_keeping_no_more_than_its_bound() -> None:
    endless = [b"data: {\"choices\": [{\"delta\": {\"content\": \"" + b"x" * 4096] + [b"x" * 4096] * 4096
    finished, written = run(endless)
    kept = sum(len(piece) for _, piece in finished.pieces)
    assert finished.error is not None and finished.error[0] == "protocol"
    assert f"over {CAP} bytes without its end" in finished.error[1]
    assert kept <= CAP and written < 16 * CAP  # the client hung up soon after the bound, not at the answer's end
    record = derive(0.0, finished)
    assert record.error_kind == "protocol" and record.output_sha256 is None


def test_events_each_within_the_bound_are_kept_however_long_the_answer() -> None:
    text = "y" * (CAP // 4)
    events = [chat_event(text) for _ in range(32)] + [chat_event("", "stop"), b"data: [DONE]\n\n"]
    reads = [b"".join(events)[at:at + 5000] for at in range(0, len(b"".join(events)), 5000)]  # ends inside reads
    finished, _ = run(reads)
    record = derive(0.0, finished)
    assert finished.error is None and record.ok and len(record.chunk_times_s) == 32
    assert sum(len(piece) for _, piece in finished.pieces) > 8 * CAP


def test_an_answer_of_whole_events_without_end_fails_past_its_bound() -> None:
    """Each event within its bound, the answer never ending: what one answer may keep is bounded too."""
    endless = [chat_event("z" * 1000) * 16] * 100_000
    finished, written = run(endless, answer_cap=4 * CAP)
    kept = sum(len(piece) for _, piece in finished.pieces)
    assert finished.error is not None and finished.error[0] == "protocol"
    assert f"an answer over {4 * CAP} bytes" in finished.error[1] and "--incremental-streaming-output" in finished.error[1]
    assert kept <= 4 * CAP and written < 64 * CAP
    assert derive(0.0, finished).error_kind == "protocol"


def test_tiny_events_without_end_fail_past_the_answers_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Comments of a few bytes each: within any bound of bytes, each line an object of its own once read."""
    monkeypatch.setattr(tester_client, "MAX_ANSWER_LINES", 20_000)
    finished, written = run([b":\n\n" * 4096] * 10_000)
    assert finished.error is not None and "20000 lines" in finished.error[1]
    assert sum(piece.count(b"\n") for _, piece in finished.pieces) <= 20_000 and written < 100 * 4096 * 3


def test_a_whole_json_answer_to_a_streamed_request_is_the_servers_protocol_error() -> None:
    body = json.dumps({"id": "c", "choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}]})
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    finished, _ = run([body.encode()], head)
    assert finished.error == ("protocol", "a 200 answer to a streamed request that is not an event stream "
                              f"(Content-Type: application/json): {body}")
    assert derive(0.0, finished).error_kind == "protocol"
    sse = head.replace(b"application/json", b"Text/Event-Stream; charset=utf-8").replace(
        b"%d" % len(body), b"%d" % len(b"".join([chat_event("a", "stop"), b"data: [DONE]\n\n"])))
    finished, _ = run([chat_event("a", "stop"), b"data: [DONE]\n\n"], sse)
    assert finished.error is None and derive(0.0, finished).ok


def test_a_stream_cut_after_done_is_answered_when_done_came_and_cut_short_otherwise() -> None:
    """As the gateway counts it, and as a client that leaves at `[DONE]` has it: the answer was whole."""
    whole = [chat_event("a"), chat_event("b", "stop"), b"data: [DONE]\n\n"]
    finished, _ = run(whole, ended=False)
    assert finished.error is not None and finished.error[0] == "disconnect"
    record = derive(0.0, finished)
    assert record.ok and record.output_sha256 is not None and record.finish_reason == "stop"
    assert record.end_s == finished.pieces[-1][0]
    for short in (whole[:-1], [*whole, b"data: {"], [*whole, b": keep"]):
        record = derive(0.0, run(short, ended=False)[0])
        assert record.error_kind == "disconnect" and not record.ok
    split = [*whole[:-1], b"d", b"ata: [DO", b"NE]", b"\n", b"\n"]  # [DONE] over five reads
    assert derive(0.0, run(split, ended=False)[0]).ok
    assert derive(0.0, run([*whole, b": keep-alive\n\n"], ended=False)[0]).ok


def test_a_server_holding_the_connection_after_done_has_answered_by_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tester leaves `DONE_GRACE_S` after a read that ended in `[DONE]`, not at its timeout: the request's slot
    is free for the next; the answer was whole at `[DONE]`, as the gateway has it."""
    monkeypatch.setattr(tester_client, "DONE_GRACE_S", 0.3)
    started = time.perf_counter()
    finished, _ = run([chat_event("a", "stop"), b"data: [DONE]\n\n"], ended=False, then=lambda: None, timeout_s=30)
    assert time.perf_counter() - started < 10
    assert finished.error == ("timeout", "the stream was held open 0.3 s after [DONE]")
    record = derive(0.0, finished)
    assert record.ok and record.end_s == finished.pieces[-1][0]
    monkeypatch.setattr(tester_client, "DONE_GRACE_S", 5.0)  # past the request's own timeout: that one ran out
    finished, _ = run([chat_event("a", "stop"), b"data: [DONE]\n\n"], ended=False, then=lambda: None, timeout_s=0.5)
    assert finished.error == ("timeout", "no complete answer within 0.5 s") and derive(0.0, finished).ok
    for answer, fault in (([chat_event("a"), b"data: [DONE]\n\n"], "stream finished without a finish_reason"),
                          ([chat_event("a", "stop"), b"data: [DONE]\n\n", chat_event("b")], "an event after [DONE]")):
        finished, _ = run(answer, ended=False, then=lambda: None, timeout_s=0.5)
        assert finished.error is not None and finished.error[0] == "timeout"
        record = derive(0.0, finished)  # the server's fault in the answer, not the hold after it
        assert (record.error_kind, record.error_message) == ("protocol", fault)
    split = [chat_event("a", "stop"), b"data: [DO", b"NE]\n\n"]  # not seen: the timeout, and still whole
    finished, _ = run(split, ended=False, then=lambda: None, timeout_s=0.5)
    assert finished.error == ("timeout", "no complete answer within 0.5 s") and derive(0.0, finished).ok


def test_an_error_document_in_a_200_event_stream_is_a_protocol_error_in_the_servers_words() -> None:
    """Not a cut stream: the server answered, with something else than events."""
    body = json.dumps({"error": {"message": "nope", "code": 400}}).encode()
    for framing in (b"", b"\n\n"):
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(body + framing)
        finished, _ = run([body + framing], head)
        record = derive(0.0, finished)
        assert (record.error_kind, record.error_message) == ("protocol", "an event stream without an event: nope")


def test_a_request_encoded_before_the_run_goes_out_as_it_was_encoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run encodes its bodies before its clock starts (`prepare_all`): sending one encodes nothing."""
    task = ReplayTask(id="t", prompt="p", route="chat", body={"messages": [{"role": "user", "content": "p" * 1000}]})
    sampling = SamplingParams(max_new_tokens=8)
    bodies = tester_client.prepare_all([task, task], "chat", sampling, ["served", "served"])
    assert list(bodies) == [("t", "served")]  # once per task and model, whatever names it twice
    received: list[bytes] = []
    answer = HEAD + chunk(chat_event("x", "stop")) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        received.append(await reader.readexactly(length))
        writer.write(answer)
        await writer.drain()
        writer.close()

    async def go() -> list[Finished]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        finished: list[Finished] = []
        client = ArmClient("a", f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "chat", sampling,
                           finished.append, model="served", t0=0.0, request_timeout_s=10.0, bodies=bodies)
        monkeypatch.setattr(tester_client.json, "dumps", lambda *args, **kwargs: pytest.fail("encoded as sent"))
        try:
            await client.send(task, 0, warmup=False, scheduled_s=None)
        finally:
            monkeypatch.undo()
            client.close()
            server.close()
            await server.wait_closed()
        return finished

    (finished,) = asyncio.run(go())
    assert received == [bodies[("t", "served")].body] and finished.http_status == 200 and finished.error is None
    assert json.loads(received[0])["messages"] == task.body["messages"]


def busy_loop(seconds: float, started: list[float]) -> Callable[[], None]:
    """Work that holds the event loop `seconds` once the answer is written (its start put in `started`)."""
    def hold() -> None:
        started.append(time.perf_counter())
        while time.perf_counter() < started[0] + seconds:
            pass
    return hold


def test_a_request_ends_when_its_last_byte_arrived_not_when_a_busy_loop_got_to_it() -> None:
    """E2E is the server's and the network's: the loop busy when the answer's end comes (other streams' work) is
    not added to it."""
    written_by: list[float] = []
    finished, _ = run([chat_event("a", "stop"), b"data: [DONE]\n\n"], then=busy_loop(0.1, written_by))
    assert finished.error is None and finished.sent.sent_s is not None
    assert finished.sent.sent_s < finished.sent.end_s <= written_by[0], (finished.sent.end_s - written_by[0])


def test_an_answer_whole_before_its_timeout_is_no_timeout_however_late_the_loop_reads_it() -> None:
    """The loop busy past the request's timeout when its end arrived: the read comes first, then the timeout's
    cancellation, which called a whole answer a timeout."""
    finished, _ = run([chat_event("a", "stop"), b"data: [DONE]\n\n"], then=busy_loop(0.3, []), timeout_s=0.15)
    assert finished.error is None and derive(0.0, finished).ok
