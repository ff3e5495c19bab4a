"""The generation routes the load tester sends, one entry per API (`ROUTE_FOR`): the body a task of a task set
becomes; for a captured request, what its body must hold, where its sampling settings live, which the run's flags
fill in, and what the tester changes before sending it (it streams, and asks the OpenAI routes for usage and spec
details, which it measures with); and how the answer's stream is read into a record. A run may send every route at
once (a capture that mixes them): each request is built by its own route's entry, and its record derived by the
same entry (`client.derive`, in the writer process).

    body = ROUTE_FOR[task.route].streamed(task.body, model)
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from dfserve import sglang
from dfserve.errors import ProtocolError
from dfserve.loadtest.stream import StreamRead
from dfserve.tasks import Task


@dataclass(frozen=True)
class Route(ABC):
    """One of SGLang's generation routes as the load tester speaks it."""

    api: sglang.Api
    asks_model: ClassVar[bool] = False
    """The body names the served model (the run asks each arm for it)."""
    token_counts: ClassVar[bool] = False
    """Each event of the stream says the tokens so far, so each chunk's tokens are known."""

    @property
    def path(self) -> str:
        return sglang.ROUTES[self.api]

    @abstractmethod
    def body(self, task: Task, sampling: sglang.SamplingParams, model: str) -> dict[str, Any]:
        """The streamed body of a task of a task set."""

    @abstractmethod
    def refusal(self, body: dict[str, Any]) -> str | None:
        """Why a captured body cannot be replayed as one request, or None."""

    @abstractmethod
    def settings(self, body: dict[str, Any]) -> dict[str, Any]:
        """The captured body's sampling settings, by the names `loadtest.config.Sampling` gives them."""

    @abstractmethod
    def with_defaults(self, body: dict[str, Any], defaults: sglang.SamplingParams) -> dict[str, Any]:
        """The captured body with the settings it did not set taken from `defaults`."""

    @abstractmethod
    def streamed(self, body: dict[str, Any], model: str) -> dict[str, Any]:
        """The captured body as the tester sends it to an arm serving `model`."""

    @abstractmethod
    def read(self, stream: StreamRead, events: list[str], times: list[float], decode_all: bool) -> None:
        """Read the answer's events (each with its arrival) into `stream`; `decode_all`: as `client.read_stream`'s."""

    @abstractmethod
    def sequences(self, body: dict[str, Any]) -> object:
        """How many outputs the body asks for (`n`), as it gives it."""

    def output_budget(self, body: dict[str, Any]) -> int | None:
        """The most tokens an answer to `body` may count: SGLang stops each output at its max new tokens (a
        speculative round that crosses it is cut there), and counts the outputs asked for together. None where the
        body leaves either to the server."""
        limit, outputs = self.settings(body)["max_new_tokens"], self.sequences(body)
        outputs = 1 if outputs is None else outputs
        if not isinstance(limit, int) or not isinstance(outputs, int) or isinstance(limit, bool) or isinstance(
                outputs, bool) or limit < 0:
            return None
        return limit * max(outputs, 1)


class Native(Route):
    token_counts = True

    def body(self, task: Task, sampling: sglang.SamplingParams, model: str) -> dict[str, Any]:
        return sglang.generate_body(task.as_text(), sampling, stream=True)

    def refusal(self, body: dict[str, Any]) -> str | None:
        prompt = first_set(body, "text", "input_ids")
        if not isinstance(prompt, str | list):
            return "has no prompt (text or input_ids)"
        if isinstance(body.get("text"), list) or _batch(body.get("input_ids")):
            return "is a batch (text or input_ids is a list of prompts); a replayed request carries one prompt"
        if not isinstance(body.get("sampling_params", {}), dict | None):
            return "has a sampling_params that is not an object"
        return None

    def settings(self, body: dict[str, Any]) -> dict[str, Any]:
        params = body.get("sampling_params") or {}
        return {"max_new_tokens": params.get("max_new_tokens"), "temperature": params.get("temperature"),
                "top_p": params.get("top_p")}

    def with_defaults(self, body: dict[str, Any], defaults: sglang.SamplingParams) -> dict[str, Any]:
        fill = defaults.native()
        return {**body, "sampling_params": {**fill, **_set(body.get("sampling_params") or {}, fill)}}

    def streamed(self, body: dict[str, Any], model: str) -> dict[str, Any]:
        """Streamed, less the client's `rid` (one id sent to every arm would collide)."""
        sent = {**copy.deepcopy(body), "stream": True}
        sent.pop("rid", None)
        return sent

    def sequences(self, body: dict[str, Any]) -> object:
        return (body.get("sampling_params") or {}).get("n")

    def read(self, stream: StreamRead, events: list[str], times: list[float], decode_all: bool) -> None:
        """Each event carries `meta_info` with the counts so far."""
        for data, now in zip(events, times, strict=True):
            if stream.done:
                raise ProtocolError("an event after [DONE]")
            if data == sglang.DONE:
                stream.done = True
            else:
                stream.native_event(data, now)


def first_set(body: dict[str, Any], *keys: str) -> Any:
    """The value of the first of `keys` that `body` sets to other than null (SGLang reads a null as unset)."""
    return next((value for key in keys if (value := body.get(key)) is not None), None)


def _set(settings: dict[str, Any], fill: dict[str, Any]) -> dict[str, Any]:
    """`settings` less those of `fill`'s names it sets to null: a client's null leaves a setting to the server, as
    one it did not send does (SGLang reads both as unset)."""
    return {key: value for key, value in settings.items() if value is not None or key not in fill}


class OpenAI(Route):
    asks_model = True

    def refusal(self, body: dict[str, Any]) -> str | None:
        if not isinstance(body.get("stream_options", {}), dict | None):
            return "has a stream_options that is not an object (the tester adds include_usage to it)"
        return self.prompt_refusal(body)

    @abstractmethod
    def prompt_refusal(self, body: dict[str, Any]) -> str | None:
        """Why the body's prompt is not one prompt the route can send, or None."""

    def settings(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"max_new_tokens": first_set(body, "max_tokens", "max_completion_tokens"),
                "temperature": body.get("temperature"), "top_p": body.get("top_p")}

    def with_defaults(self, body: dict[str, Any], defaults: sglang.SamplingParams) -> dict[str, Any]:
        fill = defaults.openai()
        if body.get("max_completion_tokens") is not None:
            fill.pop("max_tokens")
        return {**fill, **_set(body, fill)}

    def streamed(self, body: dict[str, Any], model: str) -> dict[str, Any]:
        """Streamed to the arm's model with usage and spec details, less `return_meta_info` (SGLang refuses it on
        a stream) and the client's `rid` (SGLang's OpenAI routes take one too: sent to every arm, it collides)."""
        sent = {**copy.deepcopy(body), "model": model, "stream": True, sglang.RETURN_SPEC_DETAILS: True,
                "stream_options": {**(body.get("stream_options") or {}), "include_usage": True}}
        sent.pop(sglang.RETURN_META_INFO, None)
        sent.pop("rid", None)
        return sent

    def sequences(self, body: dict[str, Any]) -> object:
        return body.get("n")

    def read(self, stream: StreamRead, events: list[str], times: list[float], decode_all: bool) -> None:
        """Content chunks, then the spec details and usage the tester asked for."""
        stream.chat_events(events, times, None if decode_all else sglang.ChunkTemplate())


class Chat(OpenAI):
    def body(self, task: Task, sampling: sglang.SamplingParams, model: str) -> dict[str, Any]:
        return sglang.chat_body(model, task.as_messages(), sampling, stream=True, return_spec_tokens_details=True,
                                include_usage=True)

    def prompt_refusal(self, body: dict[str, Any]) -> str | None:
        return None if isinstance(body.get("messages"), list) else "has no messages"


class Completions(OpenAI):
    def body(self, task: Task, sampling: sglang.SamplingParams, model: str) -> dict[str, Any]:
        return sglang.completions_body(model, task.as_text(), sampling, stream=True, return_spec_tokens_details=True,
                                       include_usage=True)

    def prompt_refusal(self, body: dict[str, Any]) -> str | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) > 1 and _batch(prompt):  # one listed: a batch of one, one choice
            return "is a batch (prompt is a list of prompts); a replayed request carries one prompt"
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt):
            return None  # text or token ids
        return "has no prompt"


def _batch(prompt: object) -> bool:
    """A list of prompts (texts or token id lists), as SGLang batches them, rather than one prompt's token ids."""
    return isinstance(prompt, list) and any(isinstance(item, str | list) for item in prompt)


ROUTE_FOR: Mapping[sglang.Api, Route] = {
    "native": Native("native"),
    "chat": Chat("chat"),
    "completions": Completions("completions"),
}
"""Every route the load tester sends, by API name (`--api`, a captured request's route)."""
