"""Greedy reference completions of the target, by token id: generated here by the target, or by a running SGLang
(native `/generate` with `input_ids`, `output_ids` read back), and cached by everything that shapes them.

A reference is what online greedy decoding would produce, so the offline trajectory can follow it. It ends with
the end-of-sequence token (as SGLang's `output_ids` do) or after `max_new_tokens` tokens. The cache file is named
by the hash of its key (target content, tasks, prompt tokens, template and thinking setting, `max_new_tokens`,
source), so another run under the same settings reuses it and a run under other settings never does::

    key = ReferenceKey(...)
    references = load_or_make(cache, key, lambda: generate_local(target, prompts, ...))
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dfserve import sglang
from dfserve.errors import FieldError, ProtocolError, UserError, describe_invalid
from dfserve.eval.records import Finish, PromptSettings
from dfserve.runs import write_atomic

SGLANG_CONCURRENCY = 8


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReferenceKey(_Model):
    """Everything a greedy reference depends on."""

    target_sha256: str
    tasks_sha256: str
    task_ids: tuple[str, ...]
    prompt: PromptSettings
    prompts_sha256: str = Field(description="hash of every task's prompt token ids")
    max_new_tokens: int
    stop_ids: tuple[int, ...] = Field(description="end-of-sequence ids of a local reference; a server uses its own")
    source: Literal["local", "sglang"]
    server_model: str | None = Field(description="the SGLang server's model_path")

    def digest(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()


class Reference(_Model):
    task: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    finish: Finish


class ReferenceSet(_Model):
    schema_version: Literal[1] = 1
    kind: Literal["eval-references"] = "eval-references"
    key: ReferenceKey
    source: str = Field(description="'local' or the server's URL")
    created_at: str
    references: tuple[Reference, ...]
    tokens_sha256: str | None = Field(None, description="`digest()` as stored: a file whose tokens were edited or "
                                      "damaged since is refused, not scored (a run builds features on them)")

    def digest(self) -> str:
        """Hash of the reference tokens themselves: the feature cache is keyed by what the target read."""
        return hashlib.sha256(json.dumps([[r.prompt_ids, r.output_ids] for r in self.references]).encode()).hexdigest()

    def of_its_tasks(self) -> bool:
        """Each reference labelled with its key's task, in order: the seal (`digest`) covers the tokens, not the
        labels by which a run pairs its records."""
        return tuple(r.task for r in self.references) == self.key.task_ids


def prompts_sha256(prompts: Sequence[Sequence[int]]) -> str:
    return hashlib.sha256(json.dumps([list(p) for p in prompts]).encode()).hexdigest()


def reference_path(cache: Path, key: ReferenceKey) -> Path:
    return cache / "references" / f"references-{key.digest()[:16]}.json"


def cached_references(cache: Path, key: ReferenceKey) -> ReferenceSet | None:
    """The references made earlier under exactly this key, if any; a file that does not hold them is refused."""
    path = reference_path(cache, key)
    if not path.exists():
        return None
    if not path.is_file():
        raise UserError(f"reference cache {path}: not a file; remove it and a run makes the references again")
    try:
        found = ReferenceSet.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise UserError(describe_invalid(exc, f"reference cache {path}")) from None
    if found.key != key:
        raise UserError(f"reference cache {path}: holds references for another key; remove the file")
    if found.tokens_sha256 is None:
        raise UserError(f"reference cache {path}: holds no hash of its tokens (stored by an earlier dfserve); remove "
                        "the file and a run makes the references again")
    if found.tokens_sha256 != found.digest():
        raise UserError(f"reference cache {path}: its tokens no longer match their hash (tokens_sha256): edited or "
                        "damaged since they were stored; remove the file and a run makes the references again")
    if not found.of_its_tasks():
        raise UserError(f"reference cache {path}: its references are not labelled with its key's tasks in order "
                        "(task edited); remove the file and a run makes the references again")
    return found


def store_references(cache: Path, references: ReferenceSet) -> Path:
    path = reference_path(cache, references.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, references.model_copy(update={"tokens_sha256": references.digest()}).model_dump_json(indent=1)
                 + "\n")
    return path


def keep_references(cache: Path, references: ReferenceSet) -> tuple[ReferenceSet, bool]:
    """`references` stored in the cache, sealed; or, where a run sharing the cache stored its own under the same key
    while these were made, those (and True): every later run reads them, so this one scores on them too."""
    sealed = references.model_copy(update={"tokens_sha256": references.digest()})
    try:
        store_references(cache, sealed)
    except FileExistsError:
        stored = cached_references(cache, references.key)
        if stored is None:
            raise
        return stored, True
    return sealed, False


def check_vocabulary(references: ReferenceSet, vocab_size: int, where: str) -> None:
    """Every token must be one the target knows: an id beyond its vocabulary means the server or cache served
    another model's tokens."""
    for ref in references.references:
        if bad := [t for t in (*ref.prompt_ids, *ref.output_ids) if not 0 <= t < vocab_size]:
            raise FieldError("reference", f"{where}: task {ref.task} holds token id {bad[0]}, outside the target's "
                             f"vocabulary of {vocab_size}: the references are another model's")


def greedy(step: Callable[[list[int], Any], tuple[int, Any]], prompt: Sequence[int], max_new_tokens: int,
           stop_ids: Sequence[int]) -> tuple[list[int], Finish]:
    """Greedy decoding: `step(new_tokens, state) -> (argmax, state)` is the target's forward with its cache; the
    end-of-sequence token is kept, as SGLang's `output_ids` keep it."""
    output: list[int] = []
    token, state = step(list(prompt), None)
    while True:
        output.append(token)
        if token in stop_ids:
            return output, "eos"
        if len(output) == max_new_tokens:
            return output, "length"
        token, state = step([token], state)


async def server_info(client: httpx.AsyncClient, url: str) -> sglang.ServerInfo:
    try:
        response = await client.get(url.rstrip("/") + "/server_info")
        response.raise_for_status()
        return sglang.parse_server_info(response.json())
    except (httpx.HTTPError, ValueError, RecursionError, AttributeError) as exc:
        raise FieldError("reference", f"{url}: /server_info did not answer as SGLang does ({exc})") from None


async def fetch_sglang(
    client: httpx.AsyncClient, url: str, prompts: Sequence[Sequence[int]], max_new_tokens: int,
    on_done: Callable[[int], None] | None = None,
) -> list[tuple[list[int], Finish]]:
    """Greedy completions from a running SGLang, a few requests at a time, in prompt order."""
    sampling = sglang.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    limit = asyncio.Semaphore(SGLANG_CONCURRENCY)

    async def one(prompt: Sequence[int]) -> tuple[list[int], Finish]:
        async with limit:
            try:
                response = await client.post(url.rstrip("/") + "/generate",
                                             json=sglang.generate_ids_body(prompt, sampling))
                response.raise_for_status()
                result = sglang.parse_generate_response(response.content)[0]
            except (httpx.HTTPError, ProtocolError) as exc:
                raise FieldError("reference", f"{url}/generate: {exc}") from None
        if on_done is not None:
            on_done(1)
        return _finished(result, max_new_tokens, url)

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def _finished(result: sglang.GenerateResult, max_new_tokens: int, url: str) -> tuple[list[int], Finish]:
    finish = result.meta.finish_reason
    if result.output_ids is None:
        raise FieldError("reference", f"{url}/generate: the answer carries no output_ids")
    output = list(result.output_ids)
    if finish is not None and finish.kind == "stop" and isinstance(finish.matched, int) and output:
        return output, "eos"
    if finish is not None and finish.kind == "length" and len(output) == max_new_tokens:
        return output, "length"
    raise FieldError("reference", f"{url}/generate: finished with {finish} after {len(output)} tokens; a greedy "
                     "reference must end at an end-of-sequence token or at max_new_tokens")
