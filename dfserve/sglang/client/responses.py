"""Whole (non-streamed) answers: native `/generate`, OpenAI chat and completions, error bodies, `/server_info`
and `/v1/models`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dfserve.errors import ProtocolError
from dfserve.sglang.client.meta import (
    FinishReason,
    MetaInfo,
    SpecStats,
    StreamError,
    parse_finish_reason,
    parse_meta_info,
    parse_spec,
    pooled_spec,
)
from dfserve.sglang.simulated import SIM_MARKER_KEY
from dfserve.sglang.wire import MAX_GENERATED, decode_json, int_field, json_bytes


@dataclass(frozen=True)
class GenerateResult:
    """One prompt's answer from native `/generate`."""

    text: str
    meta: MetaInfo
    output_ids: tuple[int, ...] | None = None


def parse_generate_response(body: bytes | str | Any) -> list[GenerateResult]:
    """Native `/generate` answers an object for one prompt and a list for a batch; both come back as a list."""
    data = decode_json(body, "/generate response")
    items = data if isinstance(data, list) else [data]
    results = []
    for item in items:
        if not isinstance(item, dict) or "meta_info" not in item:
            raise ProtocolError("/generate response: expected an object with 'text' and 'meta_info'")
        text = item.get("text", "")
        if not isinstance(text, str):
            raise ProtocolError(f"/generate response: 'text' must be a string, got {type(text).__name__}")
        ids = item.get("output_ids")
        results.append(
            GenerateResult(
                text=text,
                meta=parse_meta_info(item["meta_info"]),
                output_ids=tuple(ids) if isinstance(ids, list) else None,
            )
        )
    return results


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


def parse_usage(raw: Any) -> Usage | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ProtocolError(f"usage: expected an object, got {raw!r}")
    return Usage(prompt_tokens=int_field(raw, "prompt_tokens", 0),
                 completion_tokens=int_field(raw, "completion_tokens", 0, most=MAX_GENERATED))


@dataclass(frozen=True)
class OpenAIResult:
    """An OpenAI chat or completions response: its output (`joined_choices`), the first choice's finish reason and
    `meta` (only with `return_meta_info`), and `spec` (only with `return_spec_tokens_details`, and a verify round)."""

    text: str
    finish_reason: FinishReason | None
    usage: Usage | None
    meta: MetaInfo | None
    spec: SpecStats | None = None
    choice_metas: tuple[MetaInfo | None, ...] = ()
    """Every choice's `meta_info` (n > 1), in the order they came."""
    finish_reasons: tuple[FinishReason | None, ...] = ()
    """Every choice's finish reason, in the order they came."""

    @property
    def error(self) -> StreamError | None:
        """The first error or abort among the choices' finish reasons: one choice of several that failed fails the
        answer."""
        reasons = self.finish_reasons or (self.finish_reason,)
        return next((reason.error for reason in reasons if reason is not None and reason.error is not None), None)

    @property
    def acceptance(self) -> tuple[int, SpecStats] | None:
        """Completion tokens and spec fields of every choice, from their `meta_info` or from `sglext`, whichever
        came; None without either."""
        metas = self.choice_metas or (self.meta,)
        specs = [meta.spec for meta in metas if meta is not None and meta.spec is not None]
        if specs and len(specs) == len(metas):
            return sum(meta.completion_tokens for meta in metas if meta is not None), pooled_spec(specs)
        tokens = spec_completion_tokens(self.spec, self.usage)
        return (tokens, self.spec) if tokens is not None and self.spec is not None else None


def parse_sglext_spec(sglext: Any) -> SpecStats | None:
    """`sglext.spec_tokens_details`: one object, or a list with one per choice (n > 1), pooled (`pooled_spec`): the
    usage beside it counts every choice's tokens."""
    if sglext is None:
        return None
    if not isinstance(sglext, dict):
        raise ProtocolError(f"sglext: expected an object, got {sglext!r}")
    details = sglext.get("spec_tokens_details")
    if details is None:
        return None
    where = "sglext.spec_tokens_details"
    choices = details if isinstance(details, list) else [details]
    stats = []
    for index, choice in enumerate(choices):
        named = f"{where}.{index}" if isinstance(details, list) else where
        if not isinstance(choice, dict):
            raise ProtocolError(f"{named}: expected an object, got {choice!r}")
        spec = parse_spec(choice, named)
        if spec is None:
            return None  # a choice without a verify round: no rounds to divide by for all of them
        stats.append(spec)
    return pooled_spec(stats) if stats else None


def spec_completion_tokens(spec: SpecStats | None, usage: Usage | None) -> int | None:
    """The completion tokens behind `sglext.spec_tokens_details` (which does not carry them): the usage's where the
    details are of them (`spec_covers`), else SGLang's own accept length times the rounds it divided by."""
    if spec is None:
        return None
    if usage is not None:
        return usage.completion_tokens if spec_covers(spec, usage.completion_tokens) else None
    return round(spec.accept_length * spec.verify_ct) if spec.accept_length is not None else None


def spec_covers(spec: SpecStats, completion_tokens: int) -> bool:
    """Whether spec details are of `completion_tokens` tokens, as far as they say (SGLang's accept length is tokens
    over rounds): a completion of a batch of prompts has one object, its first prompt's, beside a usage counting
    every prompt's tokens, and no acceptance is had of them."""
    return spec.accept_length is None or round(spec.accept_length * spec.verify_ct) == completion_tokens


def parse_openai_response(body: bytes | str | Any) -> OpenAIResult:
    """A whole `/v1/chat/completions` or `/v1/completions` response: its output, every choice's (`OpenAIResult.text`),
    and the first choice's finish reason and meta_info."""
    data = decode_json(body, "OpenAI response")
    if not isinstance(data, dict):
        raise ProtocolError("OpenAI response: expected an object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not all(isinstance(choice, dict) for choice in choices):
        raise ProtocolError("OpenAI response: expected a non-empty 'choices' list of objects")
    texts = {choice_index(choice, "OpenAI response"): _choice_text(choice) for choice in choices}
    metas = tuple(parse_meta_info(c["meta_info"]) if c.get("meta_info") is not None else None for c in choices)
    reasons = tuple(parse_finish_reason(choice.get("finish_reason")) for choice in choices)
    return OpenAIResult(
        text=joined_choices(texts),
        finish_reason=reasons[0],
        usage=parse_usage(data.get("usage")),
        meta=metas[0],
        spec=parse_sglext_spec(data.get("sglext")),
        choice_metas=metas,
        finish_reasons=reasons,
    )


def _choice_text(choice: dict[str, Any]) -> str:
    message = choice.get("message")
    return generated_text(message) if isinstance(message, dict) else _string(choice.get("text"))


def generated_text(message: dict[str, Any]) -> str:
    """What a chat message or delta holds of generated text: a reasoning model's thinking (SGLang's
    --reasoning-parser), its answer, then each tool call's function name and arguments (--tool-call-parser): a
    coding agent's turn is often only tool calls, and a drafter that changes their arguments changes the output.
    A call's `id` is left out: SGLang makes it up per request (`call_` and a random suffix)."""
    text = _string(message.get("reasoning_content")) + _string(message.get("content"))
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                text += _string(function.get("name")) + _string(function.get("arguments"))
    return text


def _string(value: object) -> str:
    return value if isinstance(value, str) else ""


def choice_index(choice: dict[str, Any], where: str) -> int:
    index = choice.get("index", 0)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ProtocolError(f"{where}: a choice's index: expected a count, got {index!r}")
    return index


def joined_choices(texts: dict[int, str]) -> str:
    """One answer's output: its choice's text, or with n > 1 every choice's in index order, joined by NUL as a
    native answer's several outputs are."""
    return "\x00".join(texts[index] for index in sorted(texts))


def strip_spec_details(body: bytes) -> bytes:
    """Remove `sglext.spec_tokens_details` from an OpenAI response (asked upstream by a proxy, not by the client),
    and `sglext` with it when nothing else is left in it."""
    data = decode_json(body, "OpenAI response")
    sglext = data.get("sglext") if isinstance(data, dict) else None
    if isinstance(sglext, dict):
        sglext.pop("spec_tokens_details", None)
        if not sglext:
            del data["sglext"]
    return json_bytes(data)


def parse_error_message(body: bytes | str) -> str:
    """The human-readable message of an SGLang/OpenAI error body, or the raw text when it has none."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # ValueError: also an integer of over 4300 digits
        return text.strip()[:500]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(error, str):
            return error
        if isinstance(data.get("message"), str):
            return data["message"]
    return text.strip()[:500]


def error_body(message: str, kind: str, code: int) -> bytes:
    """An OpenAI-style error object, `{"error": {"message", "type", "param", "code"}}`, as SGLang's clients read it."""
    return json_bytes({"error": {"message": message, "type": kind, "param": None, "code": code}})


def stream_error_events(message: str, kind: str, code: int) -> bytes:
    """The well-formed end of a stream that failed after its first byte: an error event, then `[DONE]`."""
    return b"data: " + error_body(message, kind, code) + b"\n\ndata: [DONE]\n\n"


@dataclass(frozen=True)
class ServerInfo:
    """The `/server_info` fields that shape a run's numbers (the whole document is recorded verbatim beside it)."""

    model_path: str | None
    speculative_algorithm: str | None
    draft_model_path: str | None
    max_running_requests: int | None
    version: str | None
    simulated: bool


def parse_server_info(info: dict[str, Any]) -> ServerInfo:
    def text(key: str) -> str | None:
        value = info.get(key)
        return str(value) if value is not None else None

    running = info.get("max_running_requests")
    return ServerInfo(
        model_path=text("model_path"),
        speculative_algorithm=text("speculative_algorithm"),
        draft_model_path=text("speculative_draft_model_path"),
        max_running_requests=running if isinstance(running, int) and not isinstance(running, bool) else None,
        version=text("version"),
        simulated=bool(info.get(SIM_MARKER_KEY, False)),
    )


def first_model_id(models: Any) -> str | None:
    """The first `id` of a `GET /v1/models` list: the name an OpenAI body must carry."""
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
        return str(data[0]["id"])
    return None
