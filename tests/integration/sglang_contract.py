"""Checks bodies against SGLang 0.5.23's own models; run by the interpreter of `.venv-sglang` (which imports them),
reading `[{"kind": ..., "body": ...}, ...]` as JSON on stdin and printing the problems found as a JSON list, each
naming the `item` it is about by its place in the input.

Where SGLang builds a body with a pydantic model, the body must be what that model writes back after reading it
(same keys, none missing, none added); where it encodes with msgspec (`build_sse_content`), what that encoder writes
for the same values; native bodies must decode with the schema SGLang's servers share (`sglang.api.v1`). Requests
must pass the gate SGLang puts them through.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import orjson
from sglang.api.v1 import api_types
from sglang.srt.entrypoints.api_contract import generate_contract_error
from sglang.srt.entrypoints.openai import protocol
from sglang.srt.entrypoints.openai.sse_utils import build_sse_content


def dumped(model: Any, body: dict[str, Any]) -> Any:
    return json.loads(model.model_validate(body).model_dump_json())


def chat_chunk(body: dict[str, Any]) -> Any:
    [choice] = body["choices"]
    delta = choice["delta"]
    return json.loads(build_sse_content(
        chunk_id=body["id"], created=body["created"], model=body["model"], index=choice["index"],
        role=delta.get("role"), content=delta.get("content"), reasoning_content=delta["reasoning_content"],
        finish_reason=choice["finish_reason"], logprobs=choice["logprobs"], matched_stop=choice["matched_stop"],
        usage=body.get("usage"))[len("data: "):])


def native(body: dict[str, Any]) -> Any:
    api_types.GenerateResponse.from_json_value(body)
    return body


def native_error(body: dict[str, Any]) -> Any:
    error = api_types.GenerateStreamError.from_json_value(body).error
    assert error is not None and error.message
    return body


def contract_error(body: dict[str, Any]) -> Any:
    """A refused native request's body: the same text SGLang's gate gives for the request."""
    return {"error": generate_contract_error(body["request"])}


def json_invalid(body: dict[str, Any]) -> Any:
    """A body SGLang reads with orjson and refuses: the answer names orjson's error and its offset, as FastAPI's
    `json_invalid` error, in SGLang's `ErrorResponse`."""
    try:
        orjson.loads(body["request"].encode())
    except orjson.JSONDecodeError as exc:
        error = (f"[{{'type': 'json_invalid', 'loc': ('body', {exc.pos}), 'msg': 'JSON decode error', 'input': {{}}, "
                 f"'ctx': {{'error': '{exc.msg}'}}}}]")
        return dumped(protocol.ErrorResponse, {"message": error, "type": "Bad Request", "code": 400})
    raise AssertionError("orjson reads the request")


def openai_request(model: Any) -> Any:
    return lambda body: json.loads(model.model_validate(body).model_dump_json(exclude_unset=True))


def generate_request(body: dict[str, Any]) -> Any:
    error = generate_contract_error(body)
    assert error is None, error
    return body


CHECKS = {
    "native": native,
    "native_stream_error": native_error,
    "native_error": lambda body: {"error": {"message": body["error"]["message"]}},
    "contract_error": contract_error,
    "json_invalid": json_invalid,
    "chat": lambda body: dumped(protocol.ChatCompletionResponse, body),
    "chat_chunk": chat_chunk,
    "chat_stream_response": lambda body: dumped(protocol.ChatCompletionStreamResponse, body),
    "completion": lambda body: dumped(protocol.CompletionResponse, body),
    "completion_chunk": lambda body: dumped(protocol.CompletionStreamResponse, body),
    "error_response": lambda body: dumped(protocol.ErrorResponse, body),
    "stream_error_response": lambda body: {"error": dumped(protocol.ErrorResponse, body["error"])},
    "models": lambda body: dumped(protocol.ModelList, body),
    "generate_request": generate_request,
    "chat_request": openai_request(protocol.ChatCompletionRequest),
    "completion_request": openai_request(protocol.CompletionRequest),
}


def main() -> None:
    problems = []
    for index, item in enumerate(json.load(sys.stdin)):
        body = item["body"]
        try:
            want = CHECKS[item["kind"]](body)
        except Exception as exc:
            problems.append({"item": index, "kind": item["kind"], "body": body,
                             "refused": f"{type(exc).__name__}: {exc}"})
            continue
        got = {k: v for k, v in body.items() if k != "request"} if "request" in body else body
        if want != got:
            problems.append({"item": index, "kind": item["kind"], "body": got, "sglang": want})
    json.dump(problems, sys.stdout)


if __name__ == "__main__":
    main()
