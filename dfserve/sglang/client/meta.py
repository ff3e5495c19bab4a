"""SGLang's per-request `meta_info`, typed: finish reasons, speculative-decoding fields, and the in-band error an
abort is."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any, cast

from dfserve.errors import ProtocolError
from dfserve.sglang.client.acceptance import accept_length
from dfserve.sglang.simulated import SIM_CHUNK_DUE_KEY, SIM_CHUNK_SENT_KEY, SIM_MARKER_KEY
from dfserve.sglang.wire import MAX_GENERATED, float_field, int_field, times_field


@dataclass(frozen=True)
class FinishReason:
    """SGLang's `finish_reason`: `{"type": "stop"|"length"|"abort", "matched"|"length"|"message": ...}`.

    An abort by the scheduler also carries `status_code` and `err_type` (``FINISH_ABORT.to_json`` in
    ``managers/schedule_batch.py``): one with a status of 400 or more (a retraction without a KV backup, a timeout)
    is an error that SGLang reports in band in a native stream, as the stream's last chunk
    (``TokenizerManager._handle_abort_finish_reason``). One without a status (`POST /abort_request`, an abort of
    every request) ends the answer as a finish reason would, HTTP 200 and a final chunk or whole body: its output
    is cut short all the same. OpenAI routes say only `"abort"`."""

    kind: str
    matched: str | int | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None

    @property
    def error(self) -> StreamError | None:
        """The in-band error this finish reason is, if it is one: any abort, with the status it carried, if any."""
        if self.kind != "abort":
            return None
        return StreamError(self.message or "Aborted", code=self.status_code, kind=self.err_type)


@dataclass(frozen=True)
class StreamError:
    """An error SGLang reports inside a 200 answer: an error event (native `{"error": {"message", "type", "code",
    "retryable"}}`; OpenAI routes `{"error": {"object": "error", "message", "type", "param", "code"}}`), or a finish
    reason that is an abort (`FinishReason.error`)."""

    message: str
    code: int | None = None
    """The HTTP status SGLang would have answered (400 for validation, 503 for a retraction without backup, ...);
    None for an abort without a status (`/abort_request`)."""
    kind: str | None = None
    retryable: bool | None = None


def stream_error(obj: dict[str, Any]) -> StreamError | None:
    error = obj.get("error")
    if isinstance(error, str):
        return StreamError(error)
    if not isinstance(error, dict):
        if obj.get("object") != "error":
            return None
        error = obj
    message, code, kind, retryable = (error.get(k) for k in ("message", "code", "type", "retryable"))
    return StreamError(
        message=message if isinstance(message, str) else json.dumps(error),
        code=code if isinstance(code, int) and not isinstance(code, bool) else None,
        kind=kind if isinstance(kind, str) else None,
        retryable=retryable if isinstance(retryable, bool) else None,
    )


@dataclass(frozen=True)
class SpecStats:
    """Speculative-decoding fields of a finished request: its native `meta_info`, or the OpenAI routes'
    `sglext.spec_tokens_details` (the same names). SGLang sends them only when the request ran at least one verify
    round (``TokenizerManager._calculate_spec_decoding_metrics``), so `verify_ct` is positive."""

    verify_ct: int
    num_correct_drafts: int | None = None
    num_proposed_drafts: int | None = None
    accept_rate: float | None = None
    correct_drafts_histogram: tuple[int, ...] | None = None
    accept_length: float | None = None
    """SGLang's own `spec_accept_length`: completion tokens over verify rounds."""


@dataclass(frozen=True)
class MetaInfo:
    """SGLang's per-request `meta_info`, typed. Spec fields and `e2e_latency` exist only once finished."""

    id: str | None
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    e2e_latency_s: float | None = None
    queue_time_s: float | None = None
    weight_version: str | None = None
    spec: SpecStats | None = None
    simulated: bool = False
    sim_chunk_sent_unix_s: tuple[float, ...] | None = None
    sim_chunk_due_unix_s: tuple[float, ...] | None = None

    @property
    def accept_length(self) -> float | None:
        """Tokens per verify round (bonus included); None when the server ran without speculation."""
        if self.spec is None:
            return None
        return accept_length(self.completion_tokens, self.spec.verify_ct)


def parse_finish_reason(raw: Any) -> FinishReason | None:
    """Native finish_reason is a dict; OpenAI's is a plain string. Both map to one type."""
    if raw is None:
        return None
    if isinstance(raw, str):
        return FinishReason(kind=raw)
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise ProtocolError(f"finish_reason: expected an object with a 'type', got {raw!r}")
    length = raw.get("length")
    message = raw.get("message")
    status = raw.get("status_code")
    err_type = raw.get("err_type")
    return FinishReason(
        kind=raw["type"],
        matched=raw.get("matched"),
        length=length if isinstance(length, int) else None,
        message=message if isinstance(message, str) else None,
        status_code=status if isinstance(status, int) and not isinstance(status, bool) else None,
        err_type=err_type if isinstance(err_type, str) else None,
    )


def parse_spec(meta: dict[str, Any], where: str = "meta_info") -> SpecStats | None:
    """Spec fields, old and new names alike; None without a verify round (SGLang then sends none)."""
    if not meta.get("spec_verify_ct"):
        return None
    verify_ct = int_field(meta, "spec_verify_ct", where=where, most=MAX_GENERATED)
    correct = meta.get("spec_num_correct_drafts", meta.get("spec_accepted_drafts"))
    proposed = meta.get("spec_num_proposed_drafts", meta.get("spec_proposed_drafts"))
    histogram = meta.get("spec_correct_drafts_histogram", meta.get("spec_accept_histogram"))
    if histogram is not None and not (
        isinstance(histogram, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in histogram)
    ):
        raise ProtocolError(f"{where}.spec_correct_drafts_histogram: expected a list of integers, got {histogram!r}")
    return SpecStats(
        verify_ct=verify_ct,
        num_correct_drafts=correct if isinstance(correct, int) else None,
        num_proposed_drafts=proposed if isinstance(proposed, int) else None,
        accept_rate=float_field(meta, "spec_accept_rate", where),
        correct_drafts_histogram=tuple(histogram) if histogram is not None else None,
        accept_length=float_field(meta, "spec_accept_length", where),
    )


def pooled_spec(choices: Sequence[SpecStats]) -> SpecStats:
    """One request's spec fields over its choices: with `n` > 1 SGLang reports each choice's, and its usage counts
    the tokens of all. Rounds, drafts and histograms add up; the accept length and rate are taken over the totals
    (`spec_accept_rate` is correct over proposed drafts, as SGLang has it); a field some choice lacks is None."""
    if len(choices) == 1:
        return choices[0]
    verify_ct = sum(c.verify_ct for c in choices)
    correct = _total([c.num_correct_drafts for c in choices])
    proposed = _total([c.num_proposed_drafts for c in choices])
    lengths = [c.accept_length for c in choices]
    histograms = [c.correct_drafts_histogram for c in choices]
    histogram = None
    if all(h is not None for h in histograms):
        histogram = tuple(map(sum, zip_longest(*cast(list[tuple[int, ...]], histograms), fillvalue=0)))
    return SpecStats(
        verify_ct=verify_ct, num_correct_drafts=correct, num_proposed_drafts=proposed,
        accept_rate=correct / proposed if correct is not None and proposed else None,
        correct_drafts_histogram=histogram,
        accept_length=(None if any(x is None for x in lengths)
                       else sum(cast(float, x) * c.verify_ct for x, c in zip(lengths, choices, strict=True)) / verify_ct),
    )


def _total(values: Sequence[int | None]) -> int | None:
    return None if any(v is None for v in values) else sum(cast(list[int], values))


def parse_meta_info(meta: Any) -> MetaInfo:
    """Type one `meta_info` object, old and new spec field names alike."""
    if not isinstance(meta, dict):
        raise ProtocolError(f"meta_info: expected an object, got {type(meta).__name__}")
    sent = meta.get(SIM_CHUNK_SENT_KEY)
    due = meta.get(SIM_CHUNK_DUE_KEY)
    raw_id = meta.get("id")
    weight_version = meta.get("weight_version")
    return MetaInfo(
        id=str(raw_id) if raw_id is not None else None,
        finish_reason=parse_finish_reason(meta.get("finish_reason")),
        prompt_tokens=int_field(meta, "prompt_tokens"),
        completion_tokens=int_field(meta, "completion_tokens", most=MAX_GENERATED),
        cached_tokens=int_field(meta, "cached_tokens", 0),
        e2e_latency_s=float_field(meta, "e2e_latency"),
        queue_time_s=float_field(meta, "queue_time"),
        weight_version=str(weight_version) if weight_version is not None else None,
        spec=parse_spec(meta),
        simulated=bool(meta.get(SIM_MARKER_KEY, False)),
        sim_chunk_sent_unix_s=times_field(sent, SIM_CHUNK_SENT_KEY),
        sim_chunk_due_unix_s=times_field(due, SIM_CHUNK_DUE_KEY),
    )
