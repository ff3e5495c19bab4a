"""The streaming client of one arm: sends one request, takes `perf_counter()` stamps as bytes arrive, and returns a
`RequestRecord` with the failure classified. Per-request failures are data here, never exceptions.

aiohttp, not httpx, on this path: httpx's default transport spends about ten times the CPU per chunk and collapses at
64-128 streams, which turns the tester's own load into measured latency. One `aiohttp.ClientSession` per arm, its
connection pool sized to the load. SGLang's JSON is read only through `dfserve.sglang`.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from dfserve import sglang
from dfserve.errors import ProtocolError
from loadtest.records import Acceptance, ErrorKind, RequestRecord
from loadtest.tasks import Task

_DISCONNECTS = (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError)


@dataclass
class _Stream:
    """What one stream has shown so far; turned into the record however the request ends."""

    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    verify_ct: int | None = None
    text: str = ""
    finish_reason: str | None = None
    simulated: bool = False
    sim_sent: list[float] | None = None
    sim_due: list[float] | None = None
    server_e2e: float | None = None
    usage_seen: bool = False
    done: bool = False


def make_session(concurrency: int, request_timeout_s: float) -> aiohttp.ClientSession:
    """One keep-alive pool per arm, as large as the most requests the load can have in flight."""
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=10.0)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)


class ArmClient:
    """Sends requests of one arm; `sink` receives every record, also of requests cancelled mid-flight."""

    def __init__(
        self,
        arm: str,
        base_url: str,
        api: sglang.Api,
        sampling: sglang.SamplingParams,
        session: aiohttp.ClientSession,
        sink: Callable[[RequestRecord], None],
        *,
        model: str = "default",
        t0: float,
    ) -> None:
        if api not in ("native", "chat"):
            raise ValueError(f"unsupported api {api!r}")
        self.arm = arm
        self.url = base_url.rstrip("/") + sglang.ROUTES[api]
        self.api = api
        self.sampling = sampling
        self.session = session
        self.model = model
        self.t0 = t0
        self._sink = sink

    def _body(self, task: Task) -> dict[str, Any]:
        if self.api == "native":
            return sglang.generate_body(task.as_text(), self.sampling, stream=True)
        return sglang.chat_body(self.model, task.as_messages(), self.sampling, stream=True, include_usage=True)

    async def send(self, task: Task, index: int, *, warmup: bool, scheduled_s: float | None) -> RequestRecord:
        clock = time.perf_counter
        dispatched = clock() - self.t0
        body = self._body(task)
        stream = _Stream()
        status: int | None = None
        sent: float | None = None
        error: tuple[ErrorKind, str] | None = None
        try:
            sent = clock() - self.t0
            async with self.session.post(self.url, json=body) as response:
                status = response.status
                if status != 200:
                    error = ("http_status", sglang.parse_error_message(await response.read()))
                else:
                    error = await self._read(response, stream)
        except asyncio.CancelledError:
            self._finish(task, index, warmup, scheduled_s, dispatched, sent, status, stream, ("cancelled", "stopped"))
            raise
        except aiohttp.ClientConnectorError as exc:
            error = ("connect", str(exc))
        except TimeoutError:
            error = ("timeout", "no complete answer within the request timeout")
        except _DISCONNECTS as exc:
            error = ("disconnect", f"{type(exc).__name__}: {exc}")
        except ProtocolError as exc:
            error = ("protocol", str(exc))
        except aiohttp.ClientError as exc:
            error = ("protocol", f"{type(exc).__name__}: {exc}")
        return self._finish(task, index, warmup, scheduled_s, dispatched, sent, status, stream, error)

    async def _read(self, response: aiohttp.ClientResponse, stream: _Stream) -> tuple[ErrorKind, str] | None:
        decoder = sglang.SSEDecoder()
        clock, t0 = time.perf_counter, self.t0
        handle = self._native_event if self.api == "native" else self._chat_event
        content = response.content
        while True:
            data = await content.readany()
            now = clock() - t0
            if not data:
                break
            for event in decoder.feed(data):
                if event == sglang.DONE:
                    stream.done = True
                    continue
                failure = handle(event, stream, now)
                if failure is not None:
                    return ("protocol", failure)
        if not stream.done:
            return ("disconnect", "stream ended before [DONE]")
        if stream.finish_reason is None:
            return ("protocol", "stream finished without a finish_reason")
        return None

    def _native_event(self, data: str, stream: _Stream, now: float) -> str | None:
        event = sglang.parse_native_event(data)
        if isinstance(event, sglang.StreamError):
            return event.message
        meta = event.meta
        delta = meta.completion_tokens - stream.completion_tokens
        if delta < 0:
            raise ProtocolError(f"completion_tokens went backwards: {stream.completion_tokens} -> {meta.completion_tokens}")
        if delta:
            stream.chunk_times.append(now)
            stream.chunk_tokens.append(delta)
            stream.completion_tokens = meta.completion_tokens
        stream.text = event.text
        stream.prompt_tokens = meta.prompt_tokens
        stream.simulated = meta.simulated
        if meta.finish_reason is not None:
            stream.finish_reason = meta.finish_reason.kind
            stream.verify_ct = meta.spec.verify_ct if meta.spec is not None else None
            stream.server_e2e = meta.e2e_latency_s
            if meta.sim_chunk_sent_unix_s is not None:
                stream.sim_sent = list(meta.sim_chunk_sent_unix_s)
            if meta.sim_chunk_due_unix_s is not None:
                stream.sim_due = list(meta.sim_chunk_due_unix_s)
        return None

    def _chat_event(self, data: str, stream: _Stream, now: float) -> str | None:
        event = sglang.parse_openai_event(data)
        if isinstance(event, sglang.StreamError):
            return event.message
        if event.text:
            stream.chunk_times.append(now)
            stream.text += event.text
        if event.finish_reason is not None:
            stream.finish_reason = event.finish_reason.kind
        if event.usage is not None:
            stream.usage_seen = True
            stream.prompt_tokens = event.usage.prompt_tokens
            stream.completion_tokens = event.usage.completion_tokens
        return None

    def _finish(
        self,
        task: Task,
        index: int,
        warmup: bool,
        scheduled_s: float | None,
        dispatched: float,
        sent: float | None,
        status: int | None,
        stream: _Stream,
        error: tuple[ErrorKind, str] | None,
    ) -> RequestRecord:
        acceptance: Acceptance
        if self.api == "native":
            acceptance = "exact" if stream.verify_ct is not None else "unknown"
            chunk_tokens: list[int] | None = stream.chunk_tokens
        else:
            acceptance = "estimated" if stream.usage_seen and stream.chunk_times else "unknown"
            chunk_tokens = None
        finished = error is None
        record = RequestRecord(
            arm=self.arm,
            index=index,
            task_id=task.id,
            warmup=warmup,
            scheduled_s=scheduled_s,
            dispatched_s=dispatched,
            sent_s=sent,
            first_token_s=stream.chunk_times[0] if stream.chunk_times else None,
            end_s=time.perf_counter() - self.t0,
            chunk_times_s=stream.chunk_times,
            chunk_tokens=chunk_tokens,
            prompt_tokens=stream.prompt_tokens,
            completion_tokens=stream.completion_tokens if (finished or stream.chunk_times) else None,
            spec_verify_ct=stream.verify_ct,
            acceptance=acceptance if finished else "unknown",
            finish_reason=stream.finish_reason,
            output_sha256=hashlib.sha256(stream.text.encode()).hexdigest() if finished else None,
            http_status=status,
            error_kind=error[0] if error else None,
            error_message=error[1][:500] if error else None,
            simulated=stream.simulated,
            server_e2e_latency_s=stream.server_e2e,
            sim_chunk_sent_unix_s=stream.sim_sent,
            sim_chunk_due_unix_s=stream.sim_due,
        )
        self._sink(record)
        return record
