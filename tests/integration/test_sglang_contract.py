"""SGLang 0.5.23's own models as the contract: every shape the simulator answers (native, chat, completions, stream
chunks, errors) is what SGLang's models write, and every request dfserve sends passes SGLang's gate. The models are
SGLang's, imported by the interpreter of the `.venv-sglang` that `make test` installs (`sglang_contract.py`)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from dfserve import sglang
from tests import ROOT
from tests.integration.servers import sim_server

SGLANG_PYTHON = Path(os.environ.get("DFSERVE_SGLANG_PYTHON", ROOT / ".venv-sglang" / "bin" / "python"))
CHECKER = Path(__file__).with_name("sglang_contract.py")
SAMPLING = sglang.SamplingParams(max_new_tokens=40, stop=("\n\n\n",))
MESSAGES = [{"role": "user", "content": "Write a function that adds two numbers."}]


def sglang_problems(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    assert SGLANG_PYTHON.is_file(), f"{SGLANG_PYTHON} missing: `make .venv-sglang/.installed` builds it"
    done = subprocess.run([str(SGLANG_PYTHON), str(CHECKER)], input=json.dumps(items), capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return list(json.loads(done.stdout))


def events(response: httpx.Response) -> list[dict[str, Any]]:
    decoder = sglang.SSEDecoder()
    return [json.loads(e) for e in decoder.feed(response.content) if e != sglang.DONE]


def openai_kind(event: dict[str, Any]) -> str:
    if "error" in event:
        return "stream_error_response"
    if not event["choices"]:
        return "chat_stream_response" if event["object"] == "chat.completion.chunk" else "completion_chunk"
    return "chat_chunk" if event["object"] == "chat.completion.chunk" else "completion_chunk"


def collect(base: str, aborting: str) -> list[dict[str, Any]]:
    """Bodies of every shape, from simulators that answer as SGLang 0.5.23 does."""
    items: list[dict[str, Any]] = []
    chat = sglang.chat_body("m", MESSAGES, SAMPLING, stream=True, return_spec_tokens_details=True, include_usage=True)
    native = sglang.generate_body("def add(a, b):", SAMPLING, stream=True)
    streamed = sglang.completions_body("m", "def add(", SAMPLING, stream=True, return_spec_tokens_details=True,
                                       include_usage=True)
    items += [{"kind": "generate_request", "body": native}, {"kind": "chat_request", "body": chat},
              {"kind": "completion_request", "body": streamed}]
    items.append({"kind": "native", "body": httpx.post(f"{base}/generate", json={**native, "stream": False}).json()})
    items += [{"kind": "native", "body": e} for e in events(httpx.post(f"{base}/generate", json=native))]
    for url, body in ((base, chat), (aborting, chat), (base, streamed)):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        items += [{"kind": openai_kind(e), "body": e} for e in events(httpx.post(f"{url}{path}", json=body))]
    whole_chat = {**chat, "stream": False, "return_meta_info": True}
    del whole_chat["stream_options"]
    items.append({"kind": "chat", "body": httpx.post(f"{base}/v1/chat/completions", json=whole_chat).json()})
    completion = {"model": "m", "prompt": "def add(", "return_spec_tokens_details": True}
    items.append({"kind": "completion_request", "body": completion})
    items.append({"kind": "completion", "body": httpx.post(f"{base}/v1/completions", json=completion).json()})
    aborted = httpx.post(f"{aborting}/generate", json=native)
    items += [{"kind": "native", "body": e} for e in events(aborted)]
    assert sglang.native_stream_error(aborted.content) is not None
    refused = {**native, "sampling_params": {"max_new_tokens": -1}}
    items += [{"kind": "native_stream_error", "body": e} for e in events(httpx.post(f"{base}/generate", json=refused))]
    items.append({"kind": "native_error", "body": httpx.post(f"{base}/generate", json={**refused, "stream": False}).json()})
    for bad in ({"text": "x", "sampling_params": {"max_tokens": 5}}, {"text": "x", "sampling_params": {"top_k": 0.5}},
                {"text": 7}):
        items.append({"kind": "contract_error", "body": {**httpx.post(f"{base}/generate", json=bad).json(),
                                                          "request": bad}})
    for path, content in (("/generate", b"{not json"), ("/v1/chat/completions", b'{"model": "m"}'),
                          ("/v1/completions", b'{"model": "m", "prompt": "x", "max_tokens": 0}')):
        items.append({"kind": "error_response", "body": httpx.post(f"{base}{path}", content=content).json()})
    for path, text in (("/generate", r'{"text": "\ud800"}'), ("/generate", r'{"text": "a\udc00", "stream": true}'),
                       ("/v1/chat/completions", r'{"model": "m", "messages": [{"role": "user", "content": "\ud800\u0041"}]}')):
        answer = httpx.post(f"{base}{path}", content=text.encode()).json()
        items.append({"kind": "json_invalid", "body": {**answer, "request": text}})
    items.append({"kind": "models", "body": httpx.get(f"{base}/v1/models").json()})
    return items


def tampered(bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Bodies SGLang would not write or take: a key its model does not write, one it writes missing, a reworded
    error, a sampling parameter it does not know."""
    chat = next(item for item in bodies if item["kind"] == "chat")
    invented = {**chat["body"], "dfserve_extra": 1}
    usage_missing = {**chat["body"], "usage": {"prompt_tokens": 1, "total_tokens": 2, "completion_tokens": 1}}
    contract = next(item for item in bodies if item["kind"] == "contract_error")
    reworded = {**contract["body"], "error": "unknown key"}
    return [{"kind": "chat", "body": invented}, {"kind": "chat", "body": usage_missing},
            {"kind": "contract_error", "body": reworded},
            {"kind": "generate_request", "body": {"text": "x", "sampling_params": {"x": 1}}}]


@dataclass(frozen=True)
class Checked:
    bodies: list[dict[str, Any]]
    """What the simulators answered and dfserve sends."""
    tampered: list[dict[str, Any]]
    problems: dict[int, list[dict[str, Any]]]
    """SGLang's checker on `bodies` followed by `tampered`, in one run (its imports take most of it): the problems
    of each item, by its place in that list."""


@pytest.fixture(scope="module")
def checked() -> Checked:
    with sim_server("zlab", 0.01, 0) as base, sim_server("zlab", 0.01, 0, "--abort-fraction", "1") as aborting:
        bodies = collect(base, aborting)
    bad = tampered(bodies)
    problems: dict[int, list[dict[str, Any]]] = {}
    for problem in sglang_problems(bodies + bad):
        problems.setdefault(problem["item"], []).append(problem)
    return Checked(bodies, bad, problems)


def test_every_simulated_shape_is_what_sglangs_own_models_write(checked: Checked) -> None:
    kinds = {item["kind"] for item in checked.bodies}
    assert kinds >= {"native", "native_stream_error", "native_error", "contract_error", "chat", "chat_chunk",
                     "chat_stream_response", "completion", "completion_chunk", "error_response", "json_invalid",
                     "stream_error_response", "models", "generate_request", "chat_request", "completion_request"}
    assert [problems for item, problems in checked.problems.items() if item < len(checked.bodies)] == []


def test_the_checker_finds_what_differs_from_sglang(checked: Checked) -> None:
    """The check can fail: a key SGLang's model does not write, and one it writes that is missing, are both found."""
    first = len(checked.bodies)
    found = [len(checked.problems.get(item, [])) for item in range(first, first + len(checked.tampered))]
    assert found == [1] * len(checked.tampered)
