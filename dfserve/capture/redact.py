"""The redaction policy and what a record keeps of a request: pure functions, tested without a writer.

`hash` replaces the user text by the sha256 of its JSON, so equal prompts stay recognisable as equal while the text
is gone; such a record says it cannot be replayed. User text is what a user sent or is known by: the prompt (native
`text`, `input_ids` and images, audio, video; chat messages' `content`, reasoning, `name` and tool-call arguments,
legacy `function_call`s' too; completions `prompt` and `suffix`), OpenAI's end-user `user` and the request's
`metadata`. What the deployment sends with every request (tools, response formats, stop strings, constraints) is
kept. `drop` removes named fields (dotted paths), and a record that lost that way anything the replay does not set
itself (`REPLAY_NEUTRAL`) cannot be replayed either.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable
from typing import Any

from dfserve.capture.format import CapturePolicy, is_credential
from dfserve.sglang import Api

PROMPT_FIELDS: dict[str, str] = {"native": "text", "chat": "messages", "completions": "prompt"}
"""The field that carries a request's prompt, per route (native may carry `input_ids` instead)."""

OPENAI_SAMPLING = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                   "stop_token_ids", "seed", "frequency_penalty", "presence_penalty", "repetition_penalty", "n",
                   "ignore_eos", "logit_bias", "min_tokens", "regex", "json_schema", "ebnf", "response_format")


def text_hash(value: Any) -> str:
    """A lone surrogate (a client's JSON escape) is hashed as its code point rather than failing the capture."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def kept_headers(headers: Iterable[tuple[bytes | str, bytes | str]], drop: Iterable[str] = ()) -> \
        tuple[tuple[str, str], ...]:
    """Headers as sent (names lower-cased), less credentials (`is_credential`), `drop` and Content-Length (the body
    may change)."""
    refused = {name.lower() for name in drop} | {"content-length"}
    kept = []
    for name, value in headers:
        key = (name.decode("latin-1") if isinstance(name, bytes) else name).lower()
        if key not in refused and not is_credential(key):
            kept.append((key, value.decode("latin-1") if isinstance(value, bytes) else value))
    return tuple(kept)


def sampling_of(route: Api, body: dict[str, Any]) -> dict[str, Any]:
    """The sampling settings a body sets: native `sampling_params`, or the OpenAI body's top-level fields."""
    if route == "native":
        params = body.get("sampling_params")
        return dict(params) if isinstance(params, dict) else {}
    return {key: body[key] for key in OPENAI_SAMPLING if key in body}


def _drop(body: dict[str, Any], path: str) -> bool:
    *parents, leaf = path.split(".")
    node: Any = body
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict) and leaf in node:
        del node[leaf]
        return True
    return False


MESSAGE_TEXT = ("content", "reasoning_content", "reasoning", "name")
"""What a chat message carries of its user's: its text, a model's thinking sent back, the name of who wrote it."""
USER_TEXT: dict[str, tuple[str, ...]] = {"native": ("text", "input_ids", "image_data", "audio_data", "video_data"),
                                         "chat": ("user", "metadata"),
                                         "completions": ("prompt", "suffix", "user", "metadata")}
"""Top-level fields of user text per route (`user`: OpenAI's end-user identifier)."""


def _hash_text(route: Api, body: dict[str, Any]) -> list[str]:
    hashed = []
    messages = body.get("messages") if route == "chat" else None
    if isinstance(messages, list):
        for message in (m for m in messages if isinstance(m, dict)):
            for key in MESSAGE_TEXT:
                if key in message:
                    message[key] = text_hash(message[key])
                    hashed.append(f"messages[].{key}")
            calls = message.get("tool_calls")
            for call in calls if isinstance(calls, list) else ():
                if isinstance(call, dict) and _hash_arguments(call.get("function")):
                    hashed.append("messages[].tool_calls[].function.arguments")
            if _hash_arguments(message.get("function_call")):
                hashed.append("messages[].function_call.arguments")
    for key in USER_TEXT[route]:
        if key in body:
            body[key] = text_hash(body[key])
            hashed.append(key)
    return list(dict.fromkeys(hashed))


def _hash_arguments(function: object) -> bool:
    """A function call's arguments hashed, where it has them."""
    if isinstance(function, dict) and "arguments" in function:
        function["arguments"] = text_hash(function["arguments"])
        return True
    return False


def redact(route: Api, body: dict[str, Any], policy: CapturePolicy) -> tuple[dict[str, Any], tuple[str, ...], bool]:
    """The body as the policy keeps it, the fields it removed or hashed, and whether it can still be replayed."""
    if policy.redact == "keep":
        return body, (), True
    kept = copy.deepcopy(body)
    if policy.redact == "hash":
        return kept, tuple(_hash_text(route, kept)), False
    dropped = tuple(path for path in policy.drop_fields if _drop(kept, path))
    prompt_gone = PROMPT_FIELDS[route] not in kept and not (route == "native" and "input_ids" in kept)
    return kept, dropped, not prompt_gone and not any(changes_request(path) for path in dropped)


REPLAY_NEUTRAL = frozenset({"rid", "stream", "stream_options", "model", "return_meta_info",
                            "return_spec_tokens_details", "user", "metadata"})
"""Top-level fields a dropped copy of which still replays as the request captured: the replay sets each itself (an
id, streaming, the arm's model, what the tester reads) or SGLang does not generate from it (OpenAI's end-user id and
metadata). Any other field dropped (a sampling setting, tools, a chat template's arguments, a LoRA, an image) makes
another request than the one captured."""


def changes_request(path: str) -> bool:
    """Whether dropping a field (a dotted path) makes its record another request than the one captured."""
    return path.split(".")[0] not in REPLAY_NEUTRAL
