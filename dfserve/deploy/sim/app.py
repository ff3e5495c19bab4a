"""The simulator's HTTP face: SGLang's routes on Starlette, streaming written straight to the ASGI channel.

Every body comes from a builder in `dfserve.sglang.server`, so field names live in one place. A stream sends one chunk per
step of the engine; a client that disconnects is noticed by a watcher on the ASGI `receive` channel and its slot is
freed at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dfserve import __version__, sglang
from dfserve.deploy.sim.config import SimConfig
from dfserve.deploy.sim.engine import Engine, EngineSettings, SimRequest, Update
from dfserve.deploy.sim.faults import (
    ABORT_MESSAGE,
    ABORT_STATUS,
    BACKLOG_ROUNDS,
    FaultPlan,
    RequestFaults,
    SimulatedDisconnect,
)
from dfserve.deploy.sim.latency import LatencyModel, LatencyParams
from dfserve.deploy.sim.profiles import DrafterProfile
from dfserve.deploy.sim.stamps import StampedStreamEncoder
from dfserve.deploy.sim.telemetry import Telemetry
from dfserve.deploy.sim.text import Limits, TextModel, Vocabulary, render_chat
from dfserve.sglang import server as proto

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
JSON_HEADERS = [(b"content-type", b"application/json")]
INLINE_PROMPT_CHARS = 32768
"""Prompts up to this length are counted on the event loop (a few ms at most); a longer one in a thread, so that one
huge prompt (seconds to tokenize) holds up neither other requests nor the health checks."""


@dataclass
class Context:
    """What a response needs besides its request: settings fixed at start-up."""

    config: SimConfig
    engine: Engine
    created: int
    """When the engine started: its model's `created` in /v1/models."""


class SimResponse(Response):
    """Streams (or answers once) one request as the engine advances it; it owns the request's lifetime.

    A stream encodes each chunk when the engine computes the step, before the step's modelled end, so at the
    deadline only the send is left. Only the send times of --record-chunk-times are added to a final chunk
    as it is sent, and a stream ends its response on a later turn of the loop: in a step where many requests
    finish, encoding final chunks or ending responses during the hand-over would delay every chunk behind them.
    A stream whose client falls behind (the backlog fault) encodes as it sends instead: SGLang then sends one chunk
    with the latest state, whose delta spans every step the client missed.
    """

    def __init__(self, ctx: Context, request: proto.EngineRequest, sim: SimRequest, faults: RequestFaults) -> None:
        self.ctx = ctx
        self.request = request
        self.sim = sim
        self.faults = faults
        self.created = int(time.time())
        """An OpenAI answer's `created`: when its request came, in each chunk of it, as SGLang stamps it."""
        self.sent_unix: list[float] = []
        self.due_unix: list[float] = []
        self._encoded = 0
        self._shown_text = 0
        self._shown_ids = 0
        self._native = StampedStreamEncoder(ctx.config.incremental_streaming_output)
        self._fault_chunks = {faults.stall_after_chunk, faults.disconnect_after_chunk, faults.abort_after_chunk,
                              faults.backlog_after_chunk} - {None}
        self._stamp_final = request.stream and ctx.config.record_chunk_times
        self._spec_details = request.return_spec_tokens_details and ctx.config.spec_details
        if request.stream and faults.backlog_after_chunk is None:
            sim.encode = self._encode

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        updates = self.sim.updates
        watcher = asyncio.create_task(self._watch(receive, updates))
        try:
            if self.request.stream:
                await self._stream(send, updates)
            else:
                await self._whole(send, updates)
        finally:
            watcher.cancel()
            self.ctx.engine.cancel(self.sim)
            self.sim.encode = None  # the request and its response refer to each other: freed now, not by a GC pause

    async def _watch(self, receive: Receive, updates: asyncio.Queue[Update | None]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.ctx.engine.cancel(self.sim)
        updates.put_nowait(None)

    async def _stream(self, send: Send, updates: asyncio.Queue[Update | None]) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        chunks = 0
        while True:
            update = await updates.get()
            if update is None:
                return
            if chunks == self.faults.backlog_after_chunk:
                update = await self._fall_behind(update, updates)
                if update is None:
                    return
            payload = update.payload if update.payload is not None else self._chunk(update)
            self.sent_unix.append(time.time())
            if update.finished and self._stamp_final:
                payload = self._stamped(payload)
            await send({"type": "http.response.body", "body": payload, "more_body": True})
            chunks += 1
            if chunks == self.faults.abort_after_chunk and not update.finished:
                await send({"type": "http.response.body", "body": self._aborted(update), "more_body": False})
                return
            if update.finished:
                await asyncio.sleep(0)  # the response's end and teardown wait until the step's chunks are out
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            if chunks in (self.faults.stall_after_chunk, self.faults.disconnect_after_chunk):
                await self._fault(chunks)

    async def _fall_behind(self, update: Update, updates: asyncio.Queue[Update | None]) -> Update | None:
        """The client misses `BACKLOG_ROUNDS` steps: the latest of them is what it gets next (None: it left)."""
        for _ in range(BACKLOG_ROUNDS - 1):
            if update.finished:
                break
            latest = await updates.get()
            if latest is None:
                return None
            update = latest
        return update

    def _aborted(self, last: Update) -> bytes:
        """The end of a stream the engine aborts with a status after `last` (the abort fault): native, a final
        chunk whose finish reason carries the status; OpenAI, an error event and the closing chunks."""
        self.ctx.engine.cancel(self.sim)
        abort = sglang.FinishReason(kind="abort", message=ABORT_MESSAGE, status_code=ABORT_STATUS)
        sim, tokens = self.sim, last.completion_tokens
        if self.request.api == "native":
            meta = proto.meta_info_body(rid=sim.rid, finish=abort, prompt_tokens=sim.prompt_tokens,
                                        completion_tokens=tokens, queue_time_s=sim.queue_time_s,
                                        e2e_latency_s=time.perf_counter() - sim.arrived_s, spec=sim.spec_stats(),
                                        simulated=True)
            text = sim.output.text[: self._shown_text]
            body = proto.generate_response_body(text, sim.output.ids[:tokens], meta)
            return proto.sse_event(body) + sglang.SSE_DONE
        status = HTTPStatus(ABORT_STATUS)
        parts = [proto.openai_error_event(ABORT_MESSAGE, status.name, status.value)]
        parts += [proto.sse_event(chunk) for chunk in self._end_chunks(tokens)]
        return b"".join([*parts, sglang.SSE_DONE])

    def _stamped(self, payload: bytes) -> bytes:
        """The final payload with every chunk's send time, its own (taken just before) included."""
        if self.request.api == "native":
            return self._native.with_sent_times(payload, self.sent_unix) + sglang.SSE_DONE
        times = sglang.SimStreamTimes(tuple(self.sent_unix), tuple(self.due_unix), self.sim.queue_time_s)
        return payload[: -len(sglang.SSE_DONE)] + sglang.sim_times_comment(times) + sglang.SSE_DONE

    def _encode(self, update: Update) -> bytes:
        return self._chunk(update)

    async def _fault(self, chunks: int) -> None:
        if chunks == self.faults.disconnect_after_chunk:
            raise SimulatedDisconnect(self.sim.rid)
        await asyncio.sleep(self.ctx.config.faults.stall_s * self.ctx.config.time_scale)

    async def _whole(self, send: Send, updates: asyncio.Queue[Update | None]) -> None:
        while True:
            update = await updates.get()
            if update is None:
                return
            if update.finished:
                break
            if self.faults.abort_after_chunk is not None:
                self.ctx.engine.cancel(self.sim)
                await _answer(proto.failure_answer(self.request.api, ABORT_MESSAGE, ABORT_STATUS))(
                    {"type": "http"}, _never, send)
                return
        if self.faults.stall_after_chunk is not None:
            await asyncio.sleep(self.ctx.config.faults.stall_s * self.ctx.config.time_scale)
        body = sglang.json_bytes(self._whole_body(update))
        headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if self.faults.disconnect_after_chunk is not None:
            raise SimulatedDisconnect(self.sim.rid)
        await send({"type": "http.response.body", "body": body, "more_body": False})

    # --- bodies ---------------------------------------------------------------------------------------------

    def _meta(self, update: Update) -> dict[str, Any]:
        sim = self.sim
        final = update.finished
        meta = proto.meta_info_body(
            rid=sim.rid,
            finish=sim.finish if final else None,
            prompt_tokens=sim.prompt_tokens,
            completion_tokens=update.completion_tokens,
            queue_time_s=sim.queue_time_s,
            e2e_latency_s=(sim.finished_s or 0.0) - sim.arrived_s if final else None,
            spec=sim.spec_stats() if final else None,
            simulated=True,
        )
        if final and self.ctx.config.record_chunk_times:
            meta[sglang.SIM_CHUNK_DUE_KEY] = self.due_unix
            if not self.request.stream:  # a stream's final chunk gets its send times as it is sent
                meta[sglang.SIM_CHUNK_SENT_KEY] = [time.time()]
        return meta

    def _text_delta(self, update: Update) -> str:
        text = self.sim.output.text
        end = len(text) if update.finished else update.text_len
        delta = text[self._shown_text : end]
        self._shown_text = end
        return delta

    def _end_chunks(self, completion_tokens: int) -> list[dict[str, Any]]:
        request, sim = self.request, self.sim
        obj = "chat.completion.chunk" if request.api == "chat" else "text_completion"
        spec = sim.spec_stats() if self._spec_details else None
        return proto.stream_end_chunks(self._head(), obj=obj, prompt_tokens=sim.prompt_tokens,
                                       completion_tokens=completion_tokens, spec=spec,
                                       include_usage=request.include_usage)

    def _chunk(self, update: Update) -> bytes:
        """One update's bytes; called once per update sent, in order (it advances what was shown).

        Chat sends the role first, a content chunk only where there is new text, and the finish reason in a chunk
        of its own (``_generate_chat_stream``); completions send a chunk per update, the last with the finish
        reason (``_generate_completion_stream``). Both end with the spec details and usage asked for."""
        first = self._encoded == 0
        self._encoded += 1
        self.due_unix.append(update.due_unix_s)
        if self.request.api == "native":
            return self._native_chunk(update)
        head = self._head()
        delta = self._text_delta(update)
        finish = self.sim.finish if update.finished else None
        if self.request.api == "chat":
            parts = [proto.sse_event(proto.chat_chunk_body(head, content="", first=True))] if first else []
            if delta:
                parts.append(proto.sse_event(proto.chat_chunk_body(head, content=delta)))
            if finish is not None:
                parts.append(proto.sse_event(proto.chat_chunk_body(head, content=None, finish=finish)))
        else:
            parts = [proto.sse_event(proto.completion_chunk_body(head, text=delta, finish=finish))]
        if update.finished:
            parts += [proto.sse_event(chunk) for chunk in self._end_chunks(update.completion_tokens)]
            parts.append(sglang.SSE_DONE)
        return b"".join(parts)

    def _native_chunk(self, update: Update) -> bytes:
        output = self.sim.output
        if self._stamp_final:
            self._native.encode_sent_times(self.sent_unix)
        meta = self._meta(update)
        if not update.finished:
            new_ids = output.ids[self._shown_ids : update.completion_tokens]
            self._shown_ids = update.completion_tokens
            return self._native.event(self._text_delta(update), new_ids, meta)
        if self.ctx.config.incremental_streaming_output:
            body = proto.generate_response_body(self._text_delta(update), output.ids[self._shown_ids :], meta)
        else:
            body = proto.generate_response_body(output.text, output.ids, meta)
        event = proto.sse_event(body)
        return event if self._stamp_final else event + sglang.SSE_DONE

    def _whole_body(self, update: Update) -> dict[str, Any]:
        sim, api = self.sim, self.request.api
        text = sim.output.text
        self.due_unix.append(update.due_unix_s)  # a whole response is one "chunk" for --record-chunk-times
        if api == "native":
            return proto.generate_response_body(text, sim.output.ids, self._meta(update))
        head, tokens = self._head(), update.completion_tokens
        spec = sim.spec_stats() if self._spec_details else None
        if api == "chat":
            meta = self._meta(update) if self.request.return_meta_info else None
            return proto.chat_completion_body(head, text=text, finish=sim.finish, prompt_tokens=sim.prompt_tokens,
                                              completion_tokens=tokens, meta=meta, spec=spec)
        return proto.completion_body(head, text=text, finish=sim.finish, prompt_tokens=sim.prompt_tokens,
                                     completion_tokens=tokens, spec=spec)

    def _head(self) -> proto.ResponseHead:
        return proto.ResponseHead(self.sim.rid, self.created, self.request.model or self.ctx.config.model_name)


def build_app(config: SimConfig, profile: DrafterProfile | None, vocabulary: Vocabulary) -> GenerationRoutes:
    """The ASGI app of one simulated engine; its scheduler starts and stops with the app's lifespan."""
    registry = CollectorRegistry()
    settings = EngineSettings(config.max_running_requests, config.max_prefill_tokens)
    telemetry = Telemetry(registry, config.model_name, max_total_tokens=settings.max_total_tokens)
    rng = random.Random(config.seed)
    latency = LatencyModel(
        LatencyParams(**config.latency.model_dump()), config.time_scale, random.Random(rng.getrandbits(64))
    )
    engine = Engine(settings, profile, latency, telemetry, config.seed)
    faults = FaultPlan(config.faults, random.Random(rng.getrandbits(64)))
    text_model = TextModel(vocabulary, config.lossy_fraction)
    ctx = Context(config=config, engine=engine, created=int(time.time()))

    async def count(prompt: str) -> int:
        if len(prompt) <= INLINE_PROMPT_CHARS:
            return vocabulary.count(prompt)
        return await asyncio.to_thread(vocabulary.count_releasing_gil, prompt)

    async def prompt_of(request: proto.EngineRequest) -> tuple[str, int]:
        if request.input_ids is not None:
            return " ".join(map(str, request.input_ids)), len(request.input_ids)
        prompt = render_chat(list(request.messages)) if request.messages is not None else request.prompt or ""
        return prompt, await count(prompt)

    async def start(request: proto.EngineRequest) -> Response:
        """Validate as SGLang's tokenizer manager does (context length, then sampling parameters), then submit."""
        draw = faults.draw()
        if draw.error:
            return _answer(proto.failure_answer(request.api, "Simulated engine error (--error-rate).", 500))
        prompt, prompt_tokens = await prompt_of(request)
        try:
            refused = proto.context_error(config.context_length, prompt_tokens, request.max_new_tokens)
            if refused is not None:
                raise refused
            proto.verify(request)
            if request.rid is not None and engine.serving(request.rid):
                raise proto.RequestError(f"Duplicate request ID detected: {request.rid}", "engine")
        except proto.RequestError as exc:
            return _answer(proto.error_answer(request.api, exc, request.stream))
        max_new = request.max_new_tokens
        if max_new is None:
            max_new = config.context_length - prompt_tokens
        limits = Limits(max_new, request.stop, request.stop_token_ids, request.ignore_eos, request.no_stop_trim)
        output = text_model.start(prompt, request.sampling_key, limits)
        sim = engine.submit(prompt=prompt, sampling_key=request.sampling_key, prompt_tokens=prompt_tokens,
                            output=output, rid=request.rid)
        return SimResponse(ctx, request, sim, draw)

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    async def health_generate(_: Request) -> Response:
        """Like SGLang's: 200 once a one-token generation has gone through the scheduler."""
        output = text_model.start("ping", "", Limits(max_new_tokens=1))
        probe = engine.submit(prompt="ping", sampling_key="", prompt_tokens=1, output=output)
        while (update := await probe.updates.get()) is not None and not update.finished:
            pass
        return Response(status_code=200)

    async def models(_: Request) -> Response:
        return JSONResponse(proto.models_body(config.model_name, config.model_path, ctx.created,
                                              config.context_length))

    async def model_info(_: Request) -> Response:
        return JSONResponse(proto.model_info_body(config.model_path, "qwen3_5", ["Qwen3_5ForConditionalGeneration"]))

    async def server_info(_: Request) -> Response:
        return JSONResponse(proto.server_info_body(
            _server_args(config, engine), avg_spec_accept_length=telemetry.avg_spec_accept_length,
            last_gen_throughput=telemetry.last_gen_throughput, version=f"dfserve-sim {__version__}", simulated=True,
        ))

    async def flush_cache(_: Request) -> Response:
        if engine.running or engine.queued:
            return PlainTextResponse("Cache not flushed because there are pending requests.", status_code=400)
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation will not be performed.)")

    async def abort_request(request: Request) -> Response:
        """SGLang's `POST /abort_request`: 200 with no body whether or not it held the request."""
        try:
            abort = proto.parse_abort_request(await request.body())
        except proto.RequestError as exc:
            return _answer(proto.error_answer("native", exc, stream=False))
        engine.abort(abort.rid, abort.abort_all)
        return Response(status_code=200)

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        scheduler = asyncio.create_task(engine.run())
        try:
            yield
        finally:
            scheduler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await scheduler

    routes = [
        Route("/v1/models", models),
        Route("/health", health),
        Route("/health_generate", health_generate),
        Route("/model_info", model_info),
        Route("/get_model_info", model_info),
        Route("/server_info", server_info),
        Route("/get_server_info", server_info),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/metrics", metrics),
    ]
    return GenerationRoutes(Starlette(routes=routes, lifespan=lifespan), start, config.api_key)


GENERATION_ROUTES: dict[str, tuple[sglang.Api, Callable[[bytes], proto.EngineRequest]]] = {
    sglang.ROUTES["native"]: ("native", proto.parse_generate_request),
    sglang.ROUTES["chat"]: ("chat", proto.parse_chat_request),
    sglang.ROUTES["completions"]: ("completions", proto.parse_completions_request),
}


class GenerationRoutes:
    """The three generation routes as plain ASGI in front of Starlette, which serves everything else.

    A streamed chunk then passes through no middleware: each layer costs a coroutine per chunk, and at 48 streams
    per verify round those microseconds are the lateness budget. The API key is checked here, for every route.
    """

    def __init__(self, app: ASGIApp, start: Callable[[proto.EngineRequest], Awaitable[Response]],
                 api_key: str | None) -> None:
        self.app = app
        self.start = start
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_key is not None and scope["type"] == "http" and not proto.authorized(
                scope["method"], scope["path"], Headers(scope=scope).get("authorization"), self.api_key):
            await _answer(proto.UNAUTHORIZED)(scope, receive, send)
            return
        route = GENERATION_ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if route is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        api, parse = route
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            request = parse(body)
        except proto.RequestError as exc:
            response = _answer(proto.error_answer(api, exc, _asks_stream(body)))
        else:
            response = await self.start(request)
        await response(scope, receive, send)


def _asks_stream(body: bytes) -> bool:
    """Whether a refused request asked for a stream (it decides where a native engine error goes)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("stream") is True


def _answer(answer: proto.Answer) -> Response:
    media_type = "text/event-stream; charset=utf-8" if answer.stream else "application/json"
    return Response(answer.body, status_code=answer.status, media_type=media_type)


async def _never() -> Message:
    raise RuntimeError("a whole answer reads nothing")


def _server_args(config: SimConfig, engine: Engine) -> dict[str, Any]:
    """The resolved ServerArgs fields that matter to dfserve, under SGLang's names, plus the sim's own settings."""
    speculative = engine.profile is not None
    return {
        "model_path": config.model_path,
        "tokenizer_path": config.model_path,
        "served_model_name": config.model_name,
        "host": config.host,
        "port": config.port,
        "tp_size": 1,
        "dp_size": 1,
        "context_length": config.context_length,
        "max_running_requests": config.max_running_requests,
        "max_prefill_tokens": config.max_prefill_tokens,
        "max_total_num_tokens": engine.settings.max_total_tokens,
        "random_seed": config.seed,
        "enable_metrics": True,
        "incremental_streaming_output": config.incremental_streaming_output,
        "speculative_algorithm": "DFLASH" if speculative else None,
        "speculative_draft_model_path": config.resolved_draft_model_path(),
        "speculative_num_draft_tokens": engine.block_size if speculative else None,
        "speculative_dflash_block_size": engine.block_size if speculative else None,
        "speculative_num_steps": 1 if speculative else None,
        "speculative_eagle_topk": 1 if speculative else None,
        "dfserve_sim": config.model_dump(mode="json", include={"profile", "time_scale", "seed", "lossy_fraction",
                                                               "faults", "latency"}),
    }
