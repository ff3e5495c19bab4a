"""The bodies an SGLang server answers with: native `meta_info` and `/generate` answers (whole and streamed),
OpenAI chat and completions (whole and chunked), `/v1/models`, `/model_info`, `/server_info`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dfserve.sglang.client.acceptance import accept_length
from dfserve.sglang.client.meta import FinishReason, SpecStats
from dfserve.sglang.simulated import SIM_MARKER_KEY
from dfserve.sglang.wire import json_bytes


def finish_reason_body(finish: FinishReason | None) -> dict[str, Any] | None:
    """Native `finish_reason` (``BaseFinishReason.to_json`` and its subclasses in ``managers/schedule_batch.py``):
    `{"type": "stop", "matched": ...}`, `{"type": "length", "length": N}`,
    `{"type": "abort", "message", "status_code", "err_type"}`."""
    if finish is None:
        return None
    body: dict[str, Any] = {"type": finish.kind}
    if finish.kind == "length":
        body["length"] = finish.length
    elif finish.kind == "abort":
        body.update(message=finish.message, status_code=finish.status_code, err_type=finish.err_type)
    else:
        body["matched"] = finish.matched
    return body


def spec_details_body(completion_tokens: int, spec: SpecStats) -> dict[str, Any]:
    """The spec fields SGLang adds to a finished request that ran verify rounds, in its order
    (``TokenizerManager._calculate_spec_decoding_metrics``); also the fields of `sglext.spec_tokens_details`. The
    histogram (one count per number of correct drafts, as long as the largest seen) is left out while empty."""
    body: dict[str, Any] = {
        "spec_accept_rate": spec.accept_rate or 0.0,
        "spec_accept_length": accept_length(completion_tokens, spec.verify_ct),
        "spec_num_correct_drafts": spec.num_correct_drafts,
        "spec_num_proposed_drafts": spec.num_proposed_drafts,
        "spec_verify_ct": spec.verify_ct,
    }
    if spec.correct_drafts_histogram:
        body["spec_correct_drafts_histogram"] = list(spec.correct_drafts_histogram)
    return body


def meta_info_body(
    *,
    rid: str,
    finish: FinishReason | None,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    weight_version: str = "default",
    queue_time_s: float | None = None,
    e2e_latency_s: float | None = None,
    spec: SpecStats | None = None,
    simulated: bool = False,
) -> dict[str, Any]:
    """A native `meta_info` in SGLang 0.5.23's order (``TokenizerManager._handle_batch_output``); `e2e_latency_s`
    and `spec` belong on the final chunk only, and spec fields only where a verify round ran."""
    meta: dict[str, Any] = {
        "id": rid, "finish_reason": finish_reason_body(finish), "prompt_tokens": prompt_tokens,
        "weight_version": weight_version, "num_retractions": 0,
    }
    if queue_time_s is not None:
        meta["queue_time"] = queue_time_s
    meta.update(reasoning_tokens=0, completion_tokens=completion_tokens, cached_tokens=cached_tokens)
    if e2e_latency_s is not None:
        meta["e2e_latency"] = e2e_latency_s
    if spec is not None and spec.verify_ct > 0:
        meta.update(spec_details_body(completion_tokens, spec))
    if simulated:
        meta[SIM_MARKER_KEY] = True
    return meta


def sse_event(obj: Any) -> bytes:
    """One server-sent event carrying a JSON object, as SGLang frames it."""
    return b"data: " + json_bytes(obj) + b"\n\n"


def generate_response_body(text: str, output_ids: Sequence[int], meta: dict[str, Any]) -> dict[str, Any]:
    """Native `/generate` answer for one prompt; also the shape of each streamed chunk."""
    return {"text": text, "output_ids": list(output_ids), "meta_info": meta}


class NativeStreamEncoder:
    """The events of one native `/generate` stream, byte for byte what `sse_event(generate_response_body(...))` gives.

    SGLang's chunks repeat the whole text and ids so far unless `--incremental-streaming-output` is set; this
    encoder escapes and encodes each delta once and extends the bytes it sent before, instead of re-encoding the
    whole text per chunk. It only appends: a final chunk whose text was trimmed (a stop string) uses the builder.
    """

    def __init__(self, incremental: bool) -> None:
        self._incremental = incremental
        self._text = b""
        self._ids = b""

    def event(self, text_delta: str, new_ids: Sequence[int], meta: dict[str, Any]) -> bytes:
        text = json.dumps(text_delta, ensure_ascii=False)[1:-1].encode()
        ids = ",".join(map(str, new_ids)).encode()
        if not self._incremental:
            self._text += text
            self._ids = self._ids + b"," + ids if self._ids and ids else self._ids or ids
            text, ids = self._text, self._ids
        return b"".join((b'data: {"text":"', text, b'","output_ids":[', ids, b'],"meta_info":', json_bytes(meta),
                         b"}\n\n"))



def openai_finish_reason(finish: FinishReason | None) -> tuple[str | None, str | int | None]:
    """OpenAI `finish_reason` and SGLang's `matched_stop` for a native finish reason."""
    if finish is None:
        return None, None
    return finish.kind, finish.matched


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """``UsageInfo`` as ``UsageProcessor.calculate_token_usage`` fills it (no cache report, no reasoning parser)."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None, "reasoning_tokens": 0,
            "completion_tokens_details": None}


@dataclass(frozen=True)
class ResponseHead:
    """The fields every OpenAI response and chunk of one request repeats."""

    id: str
    created: int
    model: str

    def fields(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def _sglext(completion_tokens: int, spec: SpecStats | None) -> dict[str, Any]:
    """`sglext` with `spec_tokens_details` (``SpecTokensDetails``, all fields), when there is anything to say."""
    if spec is None or spec.verify_ct <= 0:
        return {}
    details = {"spec_cap_length": 0.0, "spec_block_accept_length": 0.0, "spec_cap_lens_histogram": [],
               "spec_correct_drafts_histogram": [], **spec_details_body(completion_tokens, spec)}
    order = ("spec_accept_rate", "spec_accept_length", "spec_cap_length", "spec_block_accept_length",
             "spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_verify_ct", "spec_correct_drafts_histogram",
             "spec_cap_lens_histogram")
    return {"sglext": {"spec_tokens_details": {key: details[key] for key in order}}}


def chat_completion_body(
    head: ResponseHead, *, text: str, finish: FinishReason | None, prompt_tokens: int,
    completion_tokens: int, meta: dict[str, Any] | None = None, spec: SpecStats | None = None,
    weight_version: str = "default",
) -> dict[str, Any]:
    """Whole `/v1/chat/completions` answer (``ChatCompletionResponse``); `meta` (the native meta_info) only when the
    client set return_meta_info, `spec` only with return_spec_tokens_details."""
    reason, matched = openai_finish_reason(finish)
    choice: dict[str, Any] = {
        "index": 0, "message": {"role": "assistant", "content": text, "reasoning_content": None},
        "logprobs": None, "finish_reason": reason, "matched_stop": matched,
    }
    if meta is not None:
        choice["meta_info"] = meta
    return {**head.fields("chat.completion"), "choices": [choice], "usage": usage_body(prompt_tokens, completion_tokens),
            "metadata": {"weight_version": weight_version}, **_sglext(completion_tokens, spec)}


def chat_chunk_body(
    head: ResponseHead, *, content: str | None, finish: FinishReason | None = None, first: bool = False,
) -> dict[str, Any]:
    """One streamed chat chunk as ``sse_utils.build_sse_content`` encodes it (defaults left out, `reasoning_content`
    always there): the first carries the role, the last only the finish reason."""
    reason, matched = openai_finish_reason(finish)
    delta: dict[str, Any] = {"reasoning_content": None}
    if first:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason, "matched_stop": matched}
    return {**head.fields("chat.completion.chunk"), "choices": [choice]}


def completion_body(
    head: ResponseHead, *, text: str, finish: FinishReason | None, prompt_tokens: int,
    completion_tokens: int, spec: SpecStats | None = None,
) -> dict[str, Any]:
    """Whole `/v1/completions` answer (``CompletionResponse``)."""
    reason, matched = openai_finish_reason(finish)
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "matched_stop": matched}
    return {**head.fields("text_completion"), "choices": [choice], "usage": usage_body(prompt_tokens, completion_tokens),
            "metadata": None, **_sglext(completion_tokens, spec)}


def completion_chunk_body(head: ResponseHead, *, text: str, finish: FinishReason | None = None) -> dict[str, Any]:
    """One streamed `/v1/completions` chunk (``CompletionStreamResponse``): the last carries the finish reason."""
    reason, matched = openai_finish_reason(finish)
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "matched_stop": matched}
    return {**head.fields("text_completion"), "choices": [choice], "usage": None}


def stream_end_chunks(head: ResponseHead, *, obj: str, prompt_tokens: int, completion_tokens: int,
                      spec: SpecStats | None, include_usage: bool) -> list[dict[str, Any]]:
    """The chunks with `choices: []` that end an OpenAI stream before `[DONE]`: `sglext` with the spec details
    (return_spec_tokens_details), then usage (include_usage), as ``_generate_chat_stream`` sends them."""
    chunks = []
    sglext = _sglext(completion_tokens, spec)
    if sglext:
        chunks.append({**head.fields(obj), "choices": [], "usage": None, **sglext})
    if include_usage:
        chunks.append({**head.fields(obj), "choices": [], "usage": usage_body(prompt_tokens, completion_tokens)})
    return chunks


def models_body(served_model_name: str, model_path: str, created: int, max_model_len: int) -> dict[str, Any]:
    """`GET /v1/models` (``ModelList``)."""
    card = {"id": served_model_name, "object": "model", "created": created, "owned_by": "sglang",
            "root": model_path, "parent": None, "max_model_len": max_model_len}
    return {"object": "list", "data": [card]}


def model_info_body(model_path: str, model_type: str, architectures: Sequence[str]) -> dict[str, Any]:
    """`GET /model_info`."""
    return {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": model_type, "architectures": list(architectures)}


def server_info_body(
    server_args: dict[str, Any], *, avg_spec_accept_length: float | None, last_gen_throughput: float,
    version: str, simulated: bool = False,
) -> dict[str, Any]:
    """`GET /server_info` (``http_server.get_server_info``): resolved server args, one `internal_states` entry
    (DP rank 0), the version. `avg_spec_accept_length` is there once the first decode-log interval has passed."""
    state: dict[str, Any] = {"last_gen_throughput": last_gen_throughput}
    if avg_spec_accept_length is not None:
        state["avg_spec_accept_length"] = avg_spec_accept_length
    info = {**server_args, "internal_states": [state], "version": version, "frontend": "python"}
    if simulated:
        info[SIM_MARKER_KEY] = True
    return info
