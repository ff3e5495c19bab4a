"""The gateway's request handler: routes, arm choice, shadow mirrors, client disconnects.

A plain handler on the gateway's own server (`gateway.server`) rather than a framework: the proxy path is the hot
path, and every microsecond per request or chunk is added latency (bench/RESULTS.md). Routes: `POST /v1/chat/completions`,
`POST /v1/completions`, `POST /generate` (relayed), `GET /v1/models` (relayed), `GET /health`, `GET /ready` (as
/health, but 503 until the first round of health checks has finished), `GET /metrics` (health and metrics also
answer HEAD; /ready does not). Every response names the arm
and replica that served it in `x-dfserve-arm` / `x-dfserve-replica`; the gateway's own errors are OpenAI-style JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
from collections.abc import Awaitable
from functools import partial

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from dfserve import sglang
from dfserve.errors import ProtocolError, UserError
from dfserve.gateway.config import GatewayConfig, RoutingConfig, floor_problem, moved_problem, routing_version
from dfserve.gateway.observers import Exchanged, MetricsObserver, Observers
from dfserve.gateway.relay import (
    ARM_HEADER,
    HOP_BY_HOP,
    Exchange,
    measure_whole,
    outcome,
    relay_stream,
    response_headers,
    stream_kind,
)
from dfserve.gateway.routing import Router, UnknownArm
from dfserve.gateway.scrape import Scraper
from dfserve.gateway.server import JSON_HEADERS, Discard, Reply, Request, Responder, send_error
from dfserve.gateway.upstream import MID_STREAM, Opened, Upstream, UpstreamFailure, mid_stream_error
from dfserve.headers import ARM
from dfserve.metrics import (
    GATEWAY_OVERLOADED,
    GATEWAY_STOPPED,
    GENERATION_ROUTES,
    PROTOCOL_ERROR,
    STREAM_ERROR,
    DfserveMetrics,
    ObserverMetrics,
    RoutingMetrics,
)

PROXIED = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/generate": "native"}
FORWARDED_GETS = {"/v1/models": "models", "/server_info": "server_info", "/model_info": "model_info",
                  "/get_server_info": "server_info", "/get_model_info": "model_info",
                  "/health_generate": "health_generate"}
"""Read-only engine documents, and SGLang's generation health check, answered by one replica of the pinned arm (else
of the arm the split picks). SGLang 0.5.23 still serves the `get_` names (deprecated), and its own clients ask for
them (`sglang.RuntimeEndpoint` reads /get_model_info when it starts)."""
ALLOWED = {**dict.fromkeys(PROXIED, "POST"), **dict.fromkeys(FORWARDED_GETS, "GET"), "/health": "GET, HEAD",
           "/ready": "GET", "/metrics": "GET, HEAD"}
"""Each route's methods, as a 405 answer's `Allow` header lists them (RFC 9110 §15.5.6)."""
PER_ENGINE = frozenset({"/server_info", "/get_server_info"})
"""Documents of one engine's own state (its drafter, its running acceptance): without an arm header they come from
the arm that answers all unpinned traffic, and are refused (409) while traffic is split, rather than show one arm's
figures for the split's. SGLang's own benchmark then prints no acceptance instead of the baseline's."""
_NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length", b"expect", b"accept-encoding", ARM_HEADER}
_IDENTITY = b"Accept-Encoding: identity\r\n"
"""Asked of every upstream instead of what the client accepts (httpx, the OpenAI SDK's client, accepts gzip): the
gateway reads each answer for its figures and may add to a stream, which a compressed body would defeat."""
TOO_DEEP = "request body: JSON nested too deeply"
"""A body nested past Python's recursion limit (json raises RecursionError): a bad request, not a gateway bug."""


def build_router(routing: RoutingConfig) -> Router:
    weights = {name: arm.weight for name, arm in routing.arms.items()}
    return Router(routing.mode, weights, primary=routing.primary, shadow_fraction=routing.shadow_fraction,
                  shed=routing.shed)


class Gateway:
    """The live state behind both listeners: routing (swapped atomically by `apply`), upstream, metrics, and the
    observers every finished exchange goes to (metrics first; `add` more before `start`)."""

    def __init__(self, config: GatewayConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = DfserveMetrics.build(self.registry)
        self.routing_metrics = RoutingMetrics.build(self.registry)
        self.observers = Observers(ObserverMetrics.build(self.registry))
        self.observers.add("metrics", MetricsObserver(self.metrics), inline=True)
        self.request_ids = itertools.count()
        self.mirroring = True
        """Shadow mode mirrors requests until `stop_mirroring`; only a restart mirrors again."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self.records_streams = config.shadow is not None
        """Shadow records want a mirrored stream's pieces (`Exchanged.pieces`): its output and chunk times."""
        self.version = ""
        self.rng = random.Random(config.seed)
        self.routing = config.routing
        self.router = build_router(config.routing)
        self._upstream: Upstream | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._mirrors: set[asyncio.Task[None]] = set()
        self._set_weights(config.routing)
        self._set_version(config.routing)

    @property
    def upstream(self) -> Upstream:
        if self._upstream is None:
            raise RuntimeError("Gateway.start() has not run")
        return self._upstream

    def _set_weights(self, routing: RoutingConfig) -> None:
        """Each arm's weight, and its per-request series started (`DfserveMetrics.start`)."""
        for name, arm in routing.arms.items():
            self.metrics.arm_weight.labels(name).set(arm.weight)
            self.metrics.start(name, GENERATION_ROUTES, arm.replicas)
        for name in self.routing.arms.keys() - routing.arms.keys():
            self.metrics.arm_weight.remove(name)

    def _set_version(self, routing: RoutingConfig) -> None:
        version = routing_version(routing)
        if self.version and self.version != version:
            self.routing_metrics.version.remove(self.version)
        self.routing_metrics.version.labels(version).set(1)
        self.version = version

    def apply(self, routing: RoutingConfig) -> None:
        """Replace the routing config: everything is built first, then swapped, so a failure changes nothing."""
        shadow = self.config.shadow
        if (problem := floor_problem(shadow, routing) or moved_problem(shadow, self.config.routing, routing)) is not None:
            raise UserError(problem)
        router = build_router(routing)
        if self._upstream is not None:
            self._upstream.set_arms(routing.arms)
        self._set_weights(routing)
        self._set_version(routing)
        self.routing, self.router = routing, router

    def stop_mirroring(self) -> None:
        """From any thread (a shadow decision is made on the recorder's): no request is mirrored from the loop's
        next turn on, while the ones under way finish; the request path reads one flag."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(setattr, self, "mirroring", False)
        else:
            self.mirroring = False

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        limits = self.config.limits
        http = httpx.AsyncClient(timeout=httpx.Timeout(limits.read_timeout_s, connect=limits.connect_timeout_s),
                                 trust_env=False)
        self._upstream = Upstream(http, self.routing.arms, limits, self.config.health, self.metrics)
        self.spawn(self._upstream.health_loop())
        scrape = self.config.scrape
        if scrape.enabled:
            scraper = Scraper(http, lambda: {n: a.replicas for n, a in self.routing.arms.items()}, self.metrics,
                              scrape.interval_s, scrape.window_s, scrape.timeout_s)
            self.spawn(scraper.run())

    def spawn(self, coroutine: Awaitable[None], *, mirror: bool = False) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coroutine)
        for tasks in (self._tasks, self._mirrors) if mirror else (self._tasks,):
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        return task

    async def stop(self, drain_s: float = 10.0) -> None:
        """Let the mirrored requests under way finish, `drain_s` at most, then cancel what runs: a mirror cut short
        is no record (the slowest answers would be the ones cut), and makes its shadow folder incomplete."""
        if self._mirrors:
            await asyncio.wait(list(self._mirrors), timeout=drain_s)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._upstream is not None:
            self._upstream.close()
            await self._upstream.http.aclose()
        await asyncio.to_thread(self.observers.close)


class GatewayApp:
    """The client-facing listener's handler (`gateway.server`)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def __call__(self, request: Request, reply: Reply) -> None:
        path, method = request.path, request.method
        api = PROXIED.get(path)
        if api is not None and method == "POST":
            await self.proxy(api, request, reply)
        elif path in FORWARDED_GETS and method == "GET":
            _, pinned = self._routing_keys(request, None)
            router = self.gateway.router
            if path in PER_ENGINE and pinned is None:
                pinned = router.sole_arm()
                if pinned is None:
                    arms = ", ".join(f"{name} ({weight:g})" for name, weight in router.weights.items())
                    self.refuse(reply, 409, f"{path}: traffic is split between arms {arms}, and one engine's state "
                                f"is not the split's; name an arm with the {ARM} header")
                    return
            try:
                arm = router.decide(self.gateway.rng, None, self.gateway.upstream.down(), pinned).arm
            except UnknownArm as exc:
                self.refuse(reply, 400, str(exc))
                return
            exchange = Exchange(arm=arm, route=FORWARDED_GETS[path], request_id=next(self.gateway.request_ids))
            await self.forward(exchange, b"GET", path, b"", self._headers(request), reply, query=request.query)
        elif path == "/health" and method in ("GET", "HEAD"):
            self.health(reply)
        elif path == "/ready" and method == "GET":
            if self.gateway.upstream.checked:
                self.health(reply)
            else:
                reply.whole(503, JSON_HEADERS, b'{"status": "starting"}')
        elif path == "/metrics" and method in ("GET", "HEAD"):
            reply.whole(200, [(b"content-type", CONTENT_TYPE_LATEST.encode())], generate_latest(self.gateway.registry))
        elif (allowed := ALLOWED.get(path)) is not None:
            self.refuse(reply, 405, f"{method} {path}: method not allowed (use {allowed})", [(b"allow", allowed.encode())])
        else:
            self.refuse(reply, 404, f"{method} {path}: no such route")

    def refuse(self, reply: Reply, status: int, message: str, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """The gateway's own answer to a request no arm takes, counted (`dfserve_gateway_answered_requests_total`)."""
        metrics = self.gateway.metrics
        metrics.child(metrics.answered_by_gateway, str(status)).inc()
        send_error(reply, status, message, "invalid_request_error", extra)

    def health(self, reply: Reply) -> None:
        down = self.gateway.upstream.down()
        arms = {name: name not in down for name in self.gateway.routing.arms}
        status = 200 if any(arms.values()) else 503
        reply.whole(status, JSON_HEADERS, json.dumps({"status": "ok" if status == 200 else "unavailable",
                                                      "arms": arms}).encode())

    @staticmethod
    def _headers(request: Request) -> bytes:
        """The client's headers to pass upstream, as header lines: neither hop-by-hop ones nor those its
        `Connection` header names as such (RFC 9110 §7.6.1), and an uncompressed answer asked for (`_IDENTITY`)."""
        dropped = _NOT_FORWARDED
        for name, value in request.headers:
            if name == b"connection":
                dropped = dropped | {option.strip().lower() for option in value.split(b",")}
        return b"".join(k + b": " + v + b"\r\n" for k, v in request.headers if k not in dropped) + _IDENTITY

    def _routing_keys(self, request: Request, user: str | None) -> tuple[str | None, str | None]:
        """The sticky key (header, else the OpenAI `user` field) and the arm the request pins itself to, if any."""
        key, pinned = user, None
        sticky = self.gateway.routing.sticky_header.lower().encode()
        for name, value in request.headers:
            if name == sticky:
                key = value.decode("latin-1")
            elif name == ARM_HEADER:
                pinned = value.decode("latin-1")
        return key, pinned

    async def proxy(self, api: str, request: Request, reply: Reply) -> None:
        gateway = self.gateway
        start = time.perf_counter()
        try:
            inspected = sglang.inspect_request(request.body)
        except ProtocolError as exc:
            self.refuse(reply, 400, str(exc))
            return
        except RecursionError:
            self.refuse(reply, 400, TOO_DEEP)
            return
        key, pinned = self._routing_keys(request, inspected.user)
        down = gateway.upstream.down()
        try:
            decision = gateway.router.decide(gateway.rng, key, down, pinned)
        except UnknownArm as exc:
            self.refuse(reply, 400, str(exc))
            return
        headers = self._headers(request)
        path = request.path
        # Spec fields for exact acceptance: asked for upstream where the client did not, and cut out of the answer
        # again before the client gets it (a whole body, or a stream's events); a mirror's answer goes to nobody.
        with_spec = request.body
        if api != "native" and not inspected.return_spec_tokens_details:
            with_spec = sglang.with_spec_details(inspected.body)
        request_id, body = next(gateway.request_ids), request.body
        mirrors = decision.mirrors if gateway.mirroring else ()
        mirrored = with_spec
        if mirrors and (copied := sglang.without_request_id(inspected.body, with_spec is not request.body)):
            mirrored = copied
        recorded = gateway.records_streams and any(mirror not in down for mirror in mirrors)
        for mirror in mirrors:
            if mirror in down:
                gateway.metrics.shadow_requests.labels(mirror, "skipped").inc()
            else:
                gateway.spawn(self.shadow(Exchange(arm=mirror, route=api, request_id=request_id, mirror=True,
                                                   body=body, request=inspected.body, start=start,
                                                   keep_pieces=recorded), path, mirrored,
                                          headers, request.query), mirror=True)
        skipped = tuple(mirror for mirror in mirrors if mirror in down)
        exchange = Exchange(arm=decision.arm, route=api, request_id=request_id, body=body, request=inspected.body,
                            start=start, mirrors=tuple(mirror for mirror in mirrors if mirror not in skipped),
                            skipped=skipped, keep_pieces=recorded)
        await self.forward(exchange, b"POST", path, with_spec, headers, reply, strip_spec=with_spec is not request.body,
                           query=request.query)

    async def shadow(self, exchange: Exchange, path: str, body: bytes, headers: bytes, query: str) -> None:
        """A mirrored request: measured like any other, answered to nobody, and never able to fail the client's."""
        try:
            await self.forward(exchange, b"POST", path, body, headers, Discard(), query=query)
            outcome = "ok" if exchange.status < 400 and exchange.error is None else "error"
        except Exception:
            outcome = "error"
        if exchange.error == GATEWAY_OVERLOADED:
            outcome = "dropped"
        self.gateway.metrics.shadow_requests.labels(exchange.arm, outcome).inc()

    async def forward(
        self,
        exchange: Exchange,
        method: bytes,
        path: str,
        body: bytes,
        headers: bytes,
        reply: Responder,
        strip_spec: bool = False,
        query: str = "",
    ) -> None:
        """Send one request to `exchange.arm` (at `path`, with the client's `query` string) and relay the answer; a
        client that leaves cancels this task (`gateway.server`), which closes the upstream connection, so the
        replica aborts the request."""
        gateway = self.gateway
        in_flight = gateway.metrics.in_flight.labels(exchange.arm, exchange.route)
        in_flight.inc()
        opened: Opened | None = None
        try:
            try:
                target = f"{path}?{query}" if query else path
                opened = await gateway.upstream.open(exchange.arm, method, target, body, headers,
                                                     partial(setattr, exchange, "replica"))
            except UpstreamFailure as failure:
                exchange.status, exchange.error = failure.status, failure.kind
                send_error(reply, failure.status, str(failure), "upstream_error", [(ARM_HEADER, exchange.arm.encode())])
            else:
                await self._relay(opened, exchange, reply, strip_spec)
        except asyncio.CancelledError:
            if not reply.disconnected:
                exchange.error = GATEWAY_STOPPED  # not an answer, whatever came of it so far
                raise
            exchange.error = "client_disconnect"
        finally:
            completed = opened.response.completed if opened is not None else None
            if completed is None and opened is not None and exchange.error is None:
                completed = opened.call.last_arrival()  # the client had its whole stream and left before the end
            exchange.end = completed if completed is not None else time.perf_counter()
            if opened is not None:
                clean = exchange.error in (None, STREAM_ERROR)  # an error in band ends a well-formed stream
                gateway.upstream.release(opened, clean=clean, failure=exchange.error)
            in_flight.dec()
            gateway.observers.finished(Exchanged(
                exchange.request_id, exchange.mirror, method.decode(), path, headers, exchange.body, exchange.start,
                outcome(exchange), exchange.unparsed, exchange.answer, exchange.streamed, exchange.mirrors,
                exchange.pieces, exchange.request, exchange.sent, exchange.skipped, exchange.paused_s))

    async def _relay(self, opened: Opened, exchange: Exchange, reply: Responder, strip_spec: bool) -> None:
        response = opened.response
        exchange.replica, exchange.status, exchange.sent = opened.replica.url, response.status, response.sent
        arm, replica = opened.arm.name, opened.replica.url
        headers = response_headers(response.headers, arm, replica)
        coded = response.header(b"content-encoding") not in (None, b"identity")  # asked identity, sent gzip: no events
        if response.media_type() == b"text/event-stream" and not coded:
            reply.start(response.status, headers)
            await relay_stream(opened, reply, stream_kind(exchange),
                               exchange, self.gateway.config.limits.max_event_bytes,
                               sglang.SPEC_DETAILS_KEY if strip_spec else None)
            return
        try:
            await opened.call.finish()
            payload = response.body()
        except MID_STREAM as exc:
            exchange.error = mid_stream_error(exc)
            message = (f"upstream replica sent {exc} (max_response_bytes)" if exchange.error == "body_too_large"
                       else f"upstream replica failed mid-response ({type(exc).__name__})")
            send_error(reply, 502, message, "upstream_error", [(ARM_HEADER, arm.encode())])
            return
        exchange.answer = payload
        if response.status == 200 and exchange.route in PROXIED.values():
            try:
                exchange.acceptance, in_band = measure_whole(exchange.route, payload)
                if in_band is not None:
                    exchange.error, exchange.error_code = STREAM_ERROR, in_band.code
            except (ProtocolError, RecursionError) as exc:
                exchange.error, exchange.unparsed = PROTOCOL_ERROR, str(exc)
            if strip_spec:  # also from an answer measuring refused: the client never asked for them
                with contextlib.suppress(ProtocolError, RecursionError):  # not JSON: nothing to cut
                    payload = sglang.strip_spec_details(payload)
        reply.whole(response.status, headers, payload)
