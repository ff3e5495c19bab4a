"""The streaming client of one arm: sends one request, keeps the raw arrival time of every read, and returns a
`RequestRecord` with the failure classified. Per-request failures are data here, never exceptions.

Timing comes first: the transport (`dfserve.http1`) stamps `perf_counter()` the moment bytes arrive and does
nothing else on that path; SSE framing and SGLang's JSON (through `dfserve.sglang` only) are parsed once the
response has ended, or failed, or was cancelled. Each event takes the arrival time of the read that completed it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dfserve import sglang
from dfserve.errors import ProtocolError
from dfserve.headers import ARM as PIN_HEADER
from dfserve.http1 import BadResponse, ConnectFailed, Disconnected, Pool, Response
from dfserve.loadtest.records import Acceptance, ErrorKind, RequestRecord
from dfserve.loadtest.tasks import Task


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


class ArmClient:
    """Sends requests of one arm; `sink` receives every record, also of requests cancelled mid-flight."""

    def __init__(
        self,
        arm: str,
        base_url: str,
        api: sglang.Api,
        sampling: sglang.SamplingParams,
        sink: Callable[[RequestRecord], None],
        *,
        model: str = "default",
        t0: float,
        request_timeout_s: float,
        pin_arm: bool = False,
    ) -> None:
        if api not in ("native", "chat"):
            raise ValueError(f"unsupported api {api!r}")
        self.arm = arm
        self.pool = Pool(base_url, time.perf_counter, {PIN_HEADER: arm} if pin_arm else None)
        self.route = sglang.ROUTES[api]
        self.api = api
        self.sampling = sampling
        self.model = model
        self.t0 = t0
        self.timeout_s = request_timeout_s
        self._sink = sink

    def close(self) -> None:
        self.pool.close()

    def _body(self, task: Task) -> dict[str, Any]:
        if self.api == "native":
            return sglang.generate_body(task.as_text(), self.sampling, stream=True)
        return sglang.chat_body(self.model, task.as_messages(), self.sampling, stream=True, include_usage=True)

    async def send(self, task: Task, index: int, *, warmup: bool, scheduled_s: float | None) -> RequestRecord:
        dispatched = time.perf_counter() - self.t0
        body = json.dumps(self._body(task)).encode()
        response = Response()
        sent: list[float] = []
        error: tuple[ErrorKind, str] | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.pool.post(self.route, body, response, sent.append)
        except asyncio.CancelledError:
            stream, _ = self._read(response)
            self._finish(task, index, warmup, scheduled_s, dispatched, sent, response, stream, ("cancelled", "stopped"))
            raise
        except ConnectFailed as exc:
            error = ("connect", str(exc))
        except TimeoutError:
            error = ("timeout", f"no complete answer within {self.timeout_s:g} s")
        except (Disconnected, OSError) as exc:
            error = ("disconnect", str(exc) or type(exc).__name__)
        except BadResponse as exc:
            error = ("protocol", str(exc))
        if response.status not in (0, 200) and (error is None or error[0] != "connect"):
            stream, error = _Stream(), ("http_status", sglang.parse_error_message(response.body()))
        else:
            stream, failure = self._read(response)
            error = error or failure
        return self._finish(task, index, warmup, scheduled_s, dispatched, sent, response, stream, error)

    def _read(self, response: Response) -> tuple[_Stream, tuple[ErrorKind, str] | None]:
        """Decode the SSE events received so far, each at the arrival time of the read that completed it."""
        decoder = sglang.SSEDecoder()
        stream = _Stream()
        handle = self._native_event if self.api == "native" else self._chat_event
        try:
            for arrived, data in response.pieces:
                for event in decoder.feed(data):
                    if event == sglang.DONE:
                        stream.done = True
                        continue
                    failure = handle(event, stream, arrived - self.t0)
                    if failure is not None:
                        return stream, ("protocol", failure)
        except ProtocolError as exc:
            return stream, ("protocol", str(exc))
        if not stream.done:
            return stream, ("disconnect", "stream ended before [DONE]")
        if stream.finish_reason is None:
            return stream, ("protocol", "stream finished without a finish_reason")
        return stream, None

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
        sent: list[float],
        response: Response,
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
            sent_s=sent[0] - self.t0 if sent else None,
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
            http_status=response.status or None,
            error_kind=error[0] if error else None,
            error_message=error[1][:500] if error else None,
            simulated=stream.simulated,
            server_e2e_latency_s=stream.server_e2e,
            sim_chunk_sent_unix_s=stream.sim_sent,
            sim_chunk_due_unix_s=stream.sim_due,
        )
        self._sink(record)
        return record
