"""How an SGLang server refuses or fails a request: error bodies and events by the stage that refused it, the
API key check, and whole answers (status, body, whether it streams)."""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import Any

from dfserve.sglang.client.requests import Api
from dfserve.sglang.server.bodies import sse_event
from dfserve.sglang.server.requests import RequestError
from dfserve.sglang.wire import SSE_DONE, json_bytes


def error_response(message: str, kind: str, code: int) -> dict[str, Any]:
    """SGLang's ``ErrorResponse``: what its OpenAI routes and FastAPI's validation handler answer."""
    return {"object": "error", "message": message, "type": kind, "param": None, "code": code}


STREAM_ERROR_TYPE = "invalid_request_error"
"""`type` of the error event a streamed native request that fails validation gets (``generate_request``)."""


def native_error_event(message: str, code: int = 400) -> bytes:
    """The in-band end of a streamed native request refused by the engine: the error event, then `[DONE]`."""
    error = {"message": message, "type": STREAM_ERROR_TYPE, "code": code, "retryable": False}
    return sse_event({"error": error}) + SSE_DONE


def openai_error_event(message: str, kind: str, code: int) -> bytes:
    """The error event of an OpenAI stream aborted with a status (``create_streaming_error_response``)."""
    return b"data: " + json.dumps({"error": error_response(message, kind, code)}).encode() + b"\n\n"


@dataclass(frozen=True)
class Answer:
    """A whole HTTP answer: status, body, and whether the body is an event stream."""

    status: int
    body: bytes
    stream: bool = False


def authorized(method: str, path: str, authorization: str | None, api_key: str | None) -> bool:
    """SGLang's check of `--api-key` (`decide_request_auth` in `srt/utils/auth.py`): health, readiness and metrics
    paths and OPTIONS are open; anything else needs `Authorization: Bearer KEY` (scheme case-insensitive)."""
    if api_key is None or method == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics")):
        return True
    scheme, sep, token = (authorization or "").partition(" ")
    return bool(sep) and scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode())


UNAUTHORIZED = Answer(401, json_bytes({"error": "Unauthorized"}))
"""SGLang's refusal of a request without the API key (an `ORJSONResponse`, not an OpenAI error)."""


def error_answer(api: Api, error: RequestError, stream: bool) -> Answer:
    """How SGLang answers a request refused at `error.stage` (see `Stage`)."""
    message = str(error)
    if error.stage == "contract":
        return Answer(400, json_bytes({"error": message}))
    if error.stage == "body":
        return Answer(400, json_bytes(error_response(message, "Bad Request", 400)))
    if api != "native":
        return Answer(400, json_bytes(error_response(message, "BadRequestError", 400)))
    if stream:
        return Answer(200, native_error_event(message), stream=True)
    return Answer(400, json_bytes({"error": {"message": message}}))


def failure_answer(api: Api, message: str, status: int) -> Answer:
    """A request the engine fails with an HTTP status before answering it: a 400 from the native route
    (``_create_error_response``), else an ``ErrorResponse`` typed by the status (the `HTTPException` that
    ``TokenizerManager._handle_abort_finish_reason`` raises, as the OpenAI routes and the app's handler answer it)."""
    if api == "native" and status == 400:
        return Answer(status, json_bytes({"error": {"message": message}}))
    return Answer(status, json_bytes(error_response(message, str(status), status)))
