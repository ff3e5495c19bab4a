"""The admin API, on its own listener (127.0.0.1 unless configured): `GET /admin/arms` and `PUT /admin/arms`.

Every request needs `Authorization: Bearer <token>`, the token read from the environment variable named by
`admin.token_env`. A PUT body is a whole routing document (mode, arms, weights, replicas); it is validated in full
before anything changes, so a bad one is answered 400/422 and the running config stays. A PUT changes this process
only; where several replicas watch one config file (`watch_interval_s`, `gateway.watch`) the file is the one
routing truth, and PUT is refused with 409 (GET still shows this replica's routing and its version)::

    curl -X PUT -H "Authorization: Bearer $DFSERVE_ADMIN_TOKEN" 127.0.0.1:9001/admin/arms \\
         -d '{"mode": "split", "arms": {"baseline": {"weight": 50, "replicas": ["http://10.0.0.1:30000"]},
                                       "candidate": {"weight": 50, "replicas": ["http://10.0.0.3:30000"]}}}'
"""

from __future__ import annotations

import hmac
import json
from pathlib import Path

from dfserve.errors import UserError
from dfserve.gateway.app import TOO_DEEP, Gateway
from dfserve.gateway.config import parse_routing
from dfserve.gateway.server import JSON_HEADERS, Reply, Request, send_error

MAX_ADMIN_BODY_BYTES = 1024 * 1024
MAX_ADMIN_CONNECTIONS = 32


class AdminApp:
    """The admin listener's handler (`gateway.server`)."""

    def __init__(self, gateway: Gateway, token: str, watched: Path | None = None) -> None:
        self.gateway = gateway
        self.watched = watched
        self._expected = f"Bearer {token}".encode()

    def _authorized(self, request: Request) -> bool:
        for name, value in request.headers:
            if name == b"authorization":
                return hmac.compare_digest(value, self._expected)
        return False

    async def __call__(self, request: Request, reply: Reply) -> None:
        if not self._authorized(request):
            send_error(reply, 401, "admin API: missing or wrong bearer token", "authentication_error",
                       [(b"www-authenticate", b"Bearer")])
            return
        path, method = request.path, request.method
        if path != "/admin/arms":
            send_error(reply, 404, f"{method} {path}: no such route", "invalid_request_error")
        elif method == "GET":
            reply.whole(200, JSON_HEADERS, self.describe())
        elif method == "PUT":
            self.put(request.body, reply)
        else:
            send_error(reply, 405, f"{method} {path}: use GET or PUT", "invalid_request_error",
                       [(b"allow", b"GET, PUT")])

    def describe(self) -> bytes:
        """The routing in force and each replica's state."""
        gateway = self.gateway
        replicas = {
            name: [{"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight, "failures": r.failures}
                   for r in arm.replicas]
            for name, arm in gateway.upstream.arms.items()
        }
        return json.dumps({"routing": gateway.routing.model_dump(mode="json"), "version": gateway.version,
                           "watched": None if self.watched is None else str(self.watched),
                           "replicas": replicas}, allow_nan=False).encode()  # standard JSON: weights are finite

    def put(self, body: bytes, reply: Reply) -> None:
        if self.watched is not None:
            send_error(reply, 409, f"routing comes from {self.watched}, which every replica watches: change it there",
                       "invalid_request_error")
            return
        try:
            raw = json.loads(body)
        except ValueError as exc:  # also not UTF-8, or an integer of over 4300 digits
            send_error(reply, 400, f"body: invalid JSON ({exc})", "invalid_request_error")
            return
        except RecursionError:
            send_error(reply, 400, TOO_DEEP, "invalid_request_error")
            return
        try:
            routing = parse_routing(raw, "body")
            self.gateway.apply(routing)
        except (UserError, ValueError) as exc:
            send_error(reply, 422, str(exc), "invalid_request_error")
            return
        reply.whole(200, JSON_HEADERS, self.describe())
