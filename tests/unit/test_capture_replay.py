"""A capture as a task set, and the trace schedule: pure, no sockets."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from dfserve import sglang
from dfserve.capture import redact as redact_module
from dfserve.capture.format import CapturePolicy
from dfserve.capture.read import read_capture
from dfserve.capture.replay import CaptureTaskSet, ReplayTask, load_capture_tasks
from dfserve.capture.writer import Captured, CaptureWriter
from dfserve.errors import FieldError, UserError, invalid_field
from dfserve.loadtest.client import ArmClient
from dfserve.loadtest.config import RunConfig, Sampling
from dfserve.loadtest.judge import comparability
from dfserve.loadtest.records import RequestRecord
from dfserve.loadtest.report import summarize
from dfserve.loadtest.routes import ROUTE_FOR
from dfserve.loadtest.runner import RunPlan
from dfserve.loadtest.schedule import LoadShape, schedule_fidelity, trace_offsets, trace_sha256
from dfserve.sglang import SamplingParams
from dfserve.tasks import Task, load_tasks
from tests.synthetic import run_config

FLAGS = Sampling(max_new_tokens=128, temperature=0.0, top_p=1.0)


def capture(tmp_path: Path, requests: list[tuple[str, dict[str, object], float]], name: str = "capture",
            **fields: object) -> str:
    writer = CaptureWriter.open(CapturePolicy(dir=tmp_path / name, **fields), clock=lambda: 100.0)  # type: ignore[arg-type]
    for path, body, at in requests:
        writer.observe(Captured(path, json.dumps(body).encode(), [], 0.0, 100.0 + at))
    writer.close()
    return f"capture:{tmp_path / name}"


def native(text: str, **params: object) -> dict[str, object]:
    return {"text": text, "sampling_params": params, "stream": False, "rid": "r-" + text}


def chat(content: str, **fields: object) -> dict[str, object]:
    return {"model": "client-model", "messages": [{"role": "user", "content": content}], **fields}


def test_a_capture_is_a_task_set_in_arrival_order_through_load_tasks(tmp_path: Path) -> None:
    spec = capture(tmp_path, [("/generate", native("b", temperature=0.5), 2.0),
                              ("/generate", native("a", max_new_tokens=7), 1.0)])
    tasks = load_tasks(spec)
    assert isinstance(tasks, CaptureTaskSet) and tasks.routes == {"native": 2}
    assert [t.prompt for t in tasks.tasks] == ["a", "b"]  # the observer saw "b" end first; "a" arrived first
    assert tasks.arrivals_s == (1.0, 2.0)
    assert [t.id.split("-")[0] for t in tasks.tasks] == ["c000001", "c000000"]


def test_each_task_keeps_its_settings_and_unset_ones_come_from_the_flags(tmp_path: Path) -> None:
    tasks, recorded = load_capture_tasks(capture(tmp_path, [
        ("/generate", native("a", max_new_tokens=7, temperature=0.5, seed=3), 0.0),
        ("/generate", native("b"), 1.0)])).for_run(FLAGS)
    first, second = tasks.tasks
    assert isinstance(first, ReplayTask) and isinstance(second, ReplayTask)
    assert first.request("m") == {"text": "a", "stream": True,
                                  "sampling_params": {"max_new_tokens": 7, "temperature": 0.5, "top_p": 1.0, "seed": 3}}
    assert second.request("m")["sampling_params"] == {"max_new_tokens": 128, "temperature": 0.0, "top_p": 1.0}
    assert recorded == Sampling(max_new_tokens=128, temperature=0.5, top_p=1.0, min_temperature=0.0)
    assert recorded.mixes_greedy  # the loosest, and the lowest: a sequential run awaits the greedy pairs


def test_a_setting_a_client_sent_as_null_is_unset_and_comes_from_the_flags(tmp_path: Path) -> None:
    """SGLang reads a null as unset; it must not make the whole capture unreplayable."""
    tasks, recorded = load_capture_tasks(capture(tmp_path, [
        ("/v1/chat/completions", chat("hi", max_tokens=None, temperature=None, max_completion_tokens=None), 0.0),
        ("/generate", native("a", max_new_tokens=None, temperature=0.5), 1.0)])).for_run(FLAGS)
    chat_task, native_task = tasks.tasks
    assert isinstance(chat_task, ReplayTask) and isinstance(native_task, ReplayTask)
    sent = chat_task.request("m")
    assert (sent["max_tokens"], sent["temperature"], sent["max_completion_tokens"]) == (128, 0.0, None)
    assert native_task.request("m")["sampling_params"] == {"max_new_tokens": 128, "temperature": 0.5, "top_p": 1.0}
    assert recorded == Sampling(max_new_tokens=128, temperature=0.5, top_p=1.0, min_temperature=0.0)


def test_a_null_that_hides_a_set_value_or_stands_for_a_whole_field_is_unset_too(tmp_path: Path) -> None:
    """A null `max_tokens` beside `max_completion_tokens`, a null `sampling_params`, a null `text` beside
    `input_ids`: requests SGLang serves, so a replay sends them as they came."""
    tasks, recorded = load_capture_tasks(capture(tmp_path, [
        ("/v1/chat/completions", chat("hi", max_tokens=None, max_completion_tokens=7), 0.0),
        ("/generate", {"text": "a", "sampling_params": None}, 1.0),
        ("/generate", {"text": None, "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5}}, 2.0)],
    )).for_run(FLAGS)
    chat_task, null_params, ids = tasks.tasks
    assert isinstance(chat_task, ReplayTask) and isinstance(null_params, ReplayTask) and isinstance(ids, ReplayTask)
    assert (chat_task.request("m")["max_completion_tokens"], chat_task.request("m")["max_tokens"]) == (7, None)
    assert null_params.request("m")["sampling_params"] == {"max_new_tokens": 128, "temperature": 0.0, "top_p": 1.0}
    assert ids.request("m")["input_ids"] == [1, 2, 3] and ids.prompt == "[1, 2, 3]"
    assert recorded.max_new_tokens == 128
    assert ROUTE_FOR["chat"].settings(chat_task.body)["max_new_tokens"] == 7


def test_a_bad_setting_is_named_with_its_line_in_the_capture(tmp_path: Path) -> None:
    spec = capture(tmp_path, [("/generate", native("a"), 0.0), ("/generate", native("b", max_new_tokens="many"), 1.0)])
    with pytest.raises(FieldError, match=r"capture record 1 \(segment-000001.jsonl:2\): max_new_tokens"):
        load_capture_tasks(spec).for_run(FLAGS)


def test_a_chat_request_streams_to_the_arms_model_with_its_own_settings(tmp_path: Path) -> None:
    tasks, _ = load_capture_tasks(capture(tmp_path, [
        ("/v1/chat/completions", chat("hi", max_completion_tokens=9, top_p=0.5, stream_options={"x": 1},
                                      return_meta_info=True), 0.0)])
    ).for_run(FLAGS)
    task = tasks.tasks[0]
    assert isinstance(task, ReplayTask)
    assert task.request("served") == {"model": "served", "messages": [{"role": "user", "content": "hi"}],
                                      "max_completion_tokens": 9, "top_p": 0.5, "temperature": 0.0, "stream": True,
                                      "stream_options": {"x": 1, "include_usage": True},
                                      "return_spec_tokens_details": True}


def test_the_client_sends_a_replayed_task_as_captured() -> None:
    """Less the client's `rid` on every route: SGLang takes one on its OpenAI routes too, and the same id sent to two
    arms on one server is refused as a duplicate."""
    task = ReplayTask(id="c0", prompt="p", route="native", body={"text": "p", "sampling_params": {"top_k": 5}, "rid": "x"})
    chat = ReplayTask(id="c1", prompt="p", route="chat", body={"messages": [{"role": "user", "content": "p"}],
                                                               "rid": "x", "temperature": 0.5})
    client = ArmClient("a", "http://127.0.0.1:9", "native", SamplingParams(), lambda _: None, t0=0.0,
                       request_timeout_s=1.0)
    try:
        sent = client.request(task)
        assert sent.route.path == "/generate" and sent.request == {"text": "p", "sampling_params": {"top_k": 5},
                                                                   "stream": True}
        assert json.loads(sent.body) == sent.request
        sent = client.request(chat)
        assert sent.route.path == "/v1/chat/completions" and "rid" not in sent.request
        assert sent.request["temperature"] == 0.5 and json.loads(sent.body) == sent.request
    finally:
        client.close()


def test_a_setting_out_of_range_refuses_naming_the_record(tmp_path: Path) -> None:
    tasks = load_capture_tasks(capture(tmp_path, [("/v1/chat/completions", chat("b", temperature=-1), 0.0)]))
    with pytest.raises(FieldError, match=r"^tasks: capture record 0 \(segment-000001.jsonl:1\): temperature: Input "
                       r"should be greater than or equal to 0"):
        tasks.for_run(FLAGS)
    bad = capture(tmp_path, [("/generate", {"text": "a", "sampling_params": "hot"}, 0.0)], "bad")
    with pytest.raises(FieldError, match="has a sampling_params that is not an object"):
        load_capture_tasks(bad)


def test_task_ids_and_the_set_hash_change_with_any_setting(tmp_path: Path) -> None:
    cold = load_capture_tasks(capture(tmp_path, [("/generate", native("a", temperature=0.0), 0.0)], "cold"))
    warm = load_capture_tasks(capture(tmp_path, [("/generate", native("a", temperature=0.1), 0.0)], "warm"))
    assert cold.tasks[0].id != warm.tasks[0].id and cold.sha256 != warm.sha256
    assert cold.for_run(FLAGS)[0].sha256 != cold.for_run(FLAGS.model_copy(update={"top_p": 0.9}))[0].sha256


def test_a_hashed_capture_refuses_in_one_line_naming_the_record(tmp_path: Path) -> None:
    spec = capture(tmp_path, [("/generate", native("a"), 0.0)], redact="hash")
    with pytest.raises(FieldError, match=r"record 0 \(segment-000001.jsonl:1\) cannot be replayed: its user text was "
                       r"hashed \(redact: hash\)") as caught:
        load_capture_tasks(spec)
    assert "\n" not in str(caught.value)


def test_a_dropped_prompt_or_field_that_shapes_the_output_refuses(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    spec = capture(tmp_path, [("/v1/chat/completions", chat("a"), 0.0)], redact="drop", drop_fields=("messages",))
    with pytest.raises(FieldError, match=r"its prompt was dropped \(redact: drop messages\)"):
        load_capture_tasks(spec)
    spec = capture(tmp_path / "t", [("/v1/chat/completions", chat("a", temperature=0.3), 0.0)], redact="drop",
                   drop_fields=("user", "temperature"))
    with pytest.raises(FieldError, match=r"fields it was sent with were dropped \(redact: drop temperature\): without "
                       r"them it is another request than the one captured"):
        load_capture_tasks(spec)
    tools = {**chat("a"), "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
    for route, body, field in (("/v1/chat/completions", tools, "tools"),
                               ("/generate", {**native("a"), "lora_path": "adapter"}, "lora_path"),
                               ("/v1/chat/completions", {**chat("a"), "chat_template_kwargs": {"enable_thinking": False}},
                                "chat_template_kwargs.enable_thinking")):
        spec = capture(tmp_path / field, [(route, body, 0.0)], redact="drop", drop_fields=(field,))
        with pytest.raises(FieldError, match=rf"fields it was sent with were dropped \(redact: drop {field}\)"):
            load_capture_tasks(spec)
    neutral = capture(tmp_path / "user", [("/v1/chat/completions", {**chat("a"), "user": "u1", "metadata": {"k": 1}},
                                           0.0)], redact="drop", drop_fields=("user", "metadata", "rid"))
    assert "user" not in load_capture_tasks(neutral).tasks[0].body  # what SGLang does not generate from
    with monkeypatch.context() as written_before:  # a capture written before this rule: its record says replayable
        written_before.setattr(redact_module, "changes_request", lambda path: False)
        spec = capture(tmp_path / "old", [("/v1/chat/completions", chat("a", temperature=0.3), 0.0)], redact="drop",
                       drop_fields=("temperature",))
    assert read_capture(tmp_path / "old" / "capture")[1][0].replayable
    with pytest.raises(FieldError, match=r"fields it was sent with were dropped \(redact: drop temperature\)"):
        load_capture_tasks(spec)


def retamper(directory: Path, record: dict[str, object] | None = None,
             segment: dict[str, object] | None = None) -> None:
    """Edit every record of the first segment and its manifest entry so size and sha256 still match: tampering the
    integrity checks cannot see."""
    manifest_path = directory / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    entry = manifest["segments"][0]
    path = directory / entry["name"]
    lines = [json.dumps({**json.loads(line), **(record or {})}) for line in path.read_text().splitlines()]
    data = "".join(line + "\n" for line in lines).encode()
    path.write_bytes(data)
    entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), **(segment or {}))
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(("record", "contradiction"), [
    ({"replayable": True}, "replayable is true but redaction is hash: its user text is hashes, not prompts"),
    ({"replayable": True, "redaction": "keep", "redacted": []},
     "redaction is keep but manifest.json's policy is redact: hash"),
])
def test_a_hashed_capture_made_to_look_replayable_refuses_naming_the_record(
        tmp_path: Path, record: dict[str, object], contradiction: str) -> None:
    spec = capture(tmp_path, [("/generate", native("a"), 0.0)], redact="hash")
    retamper(tmp_path / "capture", record)
    with pytest.raises(UserError) as caught:
        load_capture_tasks(spec)
    assert str(caught.value) == f"capture {tmp_path / 'capture'}: segment-000001.jsonl:1: {contradiction} (edited)"


@pytest.mark.parametrize(("edit", "why"), [
    (lambda m: m["counts"].update(dropped_queue_full=0), "is not as its writer left it (its fields' sha256 is not "
     "the one it holds): edited"),  # a lost request counted away: a holed capture would replay as whole
    (lambda m: m.pop("manifest_sha256"), "holds no sha256 of its own fields (written by an older dfserve, or "
     "edited)"),
])
def test_a_manifest_whose_own_fields_were_edited_is_refused(tmp_path: Path, edit: Any, why: str) -> None:
    writer = CaptureWriter.open(CapturePolicy(dir=tmp_path / "capture"), clock=lambda: 100.0)
    for at in (0.0, 1.0):
        writer.observe(Captured("/generate", json.dumps(native(f"{at}")).encode(), [], 0.0, 100.0 + at))
    writer.missed()
    writer.close()
    manifest_path = tmp_path / "capture" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["counts"]["dropped_queue_full"] == 1
    edit(manifest)
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(UserError) as caught:
        load_capture_tasks(f"capture:{tmp_path / 'capture'}")
    assert str(caught.value) == f"capture {tmp_path / 'capture'}: manifest.json {why}"


def test_a_manifest_that_gives_a_key_twice_is_refused(tmp_path: Path) -> None:
    """Its seal is of the fields as parsed: `"complete": false, ..., "complete": true` read as the last, sealed."""
    spec = capture(tmp_path, [("/generate", native("a"), 0.0)])
    manifest_path = tmp_path / "capture" / "manifest.json"
    manifest_path.write_text(manifest_path.read_text().replace('{', '{"complete": false, ', 1))
    with pytest.raises(UserError, match=r"manifest\.json: key 'complete' given twice in one object \(edited\?\)$"):
        load_capture_tasks(spec)


@pytest.mark.parametrize("name", ["../outside/x.jsonl", "{outside}/x.jsonl", "", ".."])
def test_a_segment_name_outside_the_capture_folder_refuses_naming_the_field(tmp_path: Path, name: str) -> None:
    spec = capture(tmp_path, [("/generate", native("a"), 0.0)])
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "capture" / "segment-000001.jsonl").rename(outside / "x.jsonl")
    name = name.format(outside=outside)
    manifest_path = tmp_path / "capture" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["segments"][0]["name"] = name
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(UserError) as caught:
        load_capture_tasks(spec)
    assert str(caught.value) == (f"capture {tmp_path / 'capture'}: manifest.json: segments.0.name: {name!r} is not a "
                                 "file name in the capture folder (edited)")


def completions(prompt: object, **fields: object) -> dict[str, object]:
    return {"model": "client-model", "prompt": prompt, **fields}


MIXED = [("/generate", native("n", max_new_tokens=7), 0.0),
         ("/v1/chat/completions", chat("c", temperature=0.3, return_meta_info=True), 1.0),
         ("/v1/completions", completions("p", max_tokens=5, top_p=0.8, stream=False), 2.0),
         ("/v1/completions", completions([11, 12, 13]), 3.0)]


def test_a_mixed_capture_keeps_each_requests_route_and_settings(tmp_path: Path) -> None:
    captured = load_capture_tasks(capture(tmp_path, MIXED))
    assert captured.routes == {"native": 1, "chat": 1, "completions": 2}
    tasks, loosest = captured.for_run(FLAGS)
    assert loosest == Sampling(max_new_tokens=128, temperature=0.3, top_p=1.0, min_temperature=0.0)
    sent = [(t.route, t.request("served")) for t in tasks.tasks if isinstance(t, ReplayTask)]
    openai = {"stream": True, "return_spec_tokens_details": True, "stream_options": {"include_usage": True},
              "model": "served"}
    assert sent == [
        ("native", {"text": "n", "stream": True,
                    "sampling_params": {"max_new_tokens": 7, "temperature": 0.0, "top_p": 1.0}}),
        ("chat", {**chat("c"), "max_tokens": 128, "temperature": 0.3, "top_p": 1.0, **openai}),
        ("completions", {**completions("p"), "max_tokens": 5, "temperature": 0.0, "top_p": 0.8, **openai}),
        ("completions", {**completions([11, 12, 13]), "max_tokens": 128, "temperature": 0.0, "top_p": 1.0, **openai}),
    ]
    assert [t.prompt for t in tasks.tasks] == ["n", '[{"role": "user", "content": "c"}]', "p", "[11, 12, 13]"]


def test_the_same_body_on_another_route_is_another_task(tmp_path: Path) -> None:
    """A task's id hashes its route with its body: a set replayed on other routes is another task set."""
    body = {"prompt": "p", "messages": [{"role": "user", "content": "p"}]}
    chat_set = load_capture_tasks(capture(tmp_path, [("/v1/chat/completions", body, 0.0)], "chat"))
    completions_set = load_capture_tasks(capture(tmp_path, [("/v1/completions", body, 0.0)], "completions"))
    assert chat_set.tasks[0].id != completions_set.tasks[0].id and chat_set.sha256 != completions_set.sha256


def test_each_request_goes_on_its_own_route_and_a_task_set_on_the_runs(tmp_path: Path) -> None:
    tasks, _ = load_capture_tasks(capture(tmp_path, MIXED)).for_run(FLAGS)
    client = ArmClient("a", "http://127.0.0.1:9", "chat", SamplingParams(max_new_tokens=9), lambda _: None,
                       model="served", t0=0.0, request_timeout_s=1.0)
    try:
        assert [client.request(t).route.path for t in tasks.tasks] == [
            "/generate", "/v1/chat/completions", "/v1/completions", "/v1/completions"]
        plain = Task(id="t", prompt="def f():")
        sent = client.request(plain)
        assert (sent.route, sent.request) == (ROUTE_FOR["chat"], sglang.chat_body(
            "served", [{"role": "user", "content": "def f():"}], SamplingParams(max_new_tokens=9), stream=True,
            return_spec_tokens_details=True, include_usage=True))
        client.api = "completions"
        sent = client.request(plain)
        assert sent.route.path == "/v1/completions" and sent.request == {
            "model": "served", "prompt": "def f():", "stream": True, "max_tokens": 9, "temperature": 0.0,
            "top_p": 1.0, "return_spec_tokens_details": True, "stream_options": {"include_usage": True}}
    finally:
        client.close()


@pytest.mark.parametrize(("path", "body", "refusal"), [
    ("/v1/completions", completions(["a", "b"]), "is a batch (prompt is a list of prompts)"),
    ("/v1/completions", completions([[1, 2], [3]]), "is a batch (prompt is a list of prompts)"),
    ("/v1/completions", completions([]), "has no prompt"),
    ("/v1/completions", completions(None), "has no prompt"),
    ("/generate", {"input_ids": [[1, 2], [3]]}, "is a batch (text or input_ids is a list of prompts)"),
    ("/v1/chat/completions", {"model": "m"}, "has no messages"),
    ("/generate", {"text": ["a", "b"]}, "is a batch (text or input_ids is a list of prompts)"),
    ("/v1/chat/completions", chat("a", stream_options="x"), "has a stream_options that is not an object"),
    ("/v1/completions", {**completions("a"), "stream_options": [1]}, "has a stream_options that is not an object"),
])
def test_a_request_that_cannot_be_replayed_as_one_is_left_out_as_a_hole_naming_the_record(
        tmp_path: Path, path: str, body: dict[str, object], refusal: str) -> None:
    """One batch among thousands of requests does not make a capture unreplayable: the replay leaves it out, which
    makes the capture's replay incomplete (refused unless forced, and stamped); a capture of nothing else is
    refused outright."""
    spec = capture(tmp_path, [("/generate", native("a"), 0.0), (path, body, 1.0)])
    task_set = load_capture_tasks(spec)
    assert [task.id[:7] for task in task_set.tasks] == ["c000000"] and task_set.incomplete is not None
    assert task_set.incomplete.startswith("1 of the 2 requests it would replay cannot be replayed as one and are left "
                                          "out "
                                          "(record 1 (segment-000001.jsonl:2) ") and refusal in task_set.incomplete
    with pytest.raises(FieldError, match=r"^tasks: capture .*: nothing in it can be replayed: 1 of the 1 requests it "
                       r"would replay cannot be replayed as one and are left out \(record 0 \(segment-000001.jsonl:1\) ") as caught:
        load_capture_tasks(capture(tmp_path / "alone", [(path, body, 0.0)]))
    assert refusal in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("prompt", [["def f():"], [[1, 2, 3]]])
def test_a_completions_prompt_listed_alone_is_one_prompt_and_replays_as_captured(tmp_path: Path,
                                                                                 prompt: list[object]) -> None:
    tasks, _ = load_capture_tasks(capture(tmp_path, [("/v1/completions", completions(prompt), 0.0)])).for_run(FLAGS)
    [task] = tasks.tasks
    assert task.request("served")["prompt"] == prompt


def test_an_api_other_than_a_captured_route_refuses_and_none_replays_each_on_its_own(tmp_path: Path) -> None:
    tasks = load_capture_tasks(capture(tmp_path, MIXED))
    with pytest.raises(FieldError, match=r"^api: capture:capture holds requests of other routes than chat \(1 to "
                       r"/generate, 2 to /v1/completions\); bodies are not converted between APIs \(without it, "
                       r"each is replayed on its own route\)$"):
        tasks.check("chat", trace=False, count=4)
    tasks.check(None, trace=True, count=4)
    native_only = load_capture_tasks(capture(tmp_path, MIXED[:1], "native"))
    native_only.check("native", trace=False, count=4)  # the captured route, named


def test_a_trace_fits_the_capture(tmp_path: Path) -> None:
    tasks = load_capture_tasks(capture(tmp_path, [("/generate", native("a"), 0.0), ("/generate", native("b"), 1.0)]))
    with pytest.raises(FieldError, match=r"^num_requests: a trace replays each of the capture's 2 requests once, "
                       r"in order; 3 asked for \(warmup included\)$"):
        tasks.check(None, trace=True, count=3)
    tasks.check(None, trace=False, count=300)  # other arrivals repeat the set, as for any task set
    order, arrivals = tasks.trace(2)
    assert [t.prompt for t in order] == ["a", "b"] and arrivals == [0.0, 1.0]


@pytest.mark.parametrize(("load", "field"), [
    (LoadShape(kind="trace", speed=5e-324), "speed"), (LoadShape(kind="trace", speed=1e-9), "speed"),
    (LoadShape(kind="constant", rate=5e-324), "rate"), (LoadShape(kind="poisson", rate=1e-9), "rate")])
def test_a_schedule_that_would_never_end_refuses_naming_its_flag(tmp_path: Path, load: LoadShape, field: str) -> None:
    """A near-zero speed or rate put requests at infinity: the run sent one, then ended as if complete."""
    tasks = load_capture_tasks(capture(tmp_path, [("/generate", native("a"), 0.0), ("/generate", native("b"), 1.0)]))
    with pytest.raises(FieldError, match=r"puts the last request .* s after the start, past 30 days$") as caught:
        RunPlan(arms=(("a", "http://x"),), api=None, task_set=tasks, num_requests=2, warmup=0, sampling=FLAGS,
                load=load, out=tmp_path)
    assert caught.value.field == field
    RunPlan(arms=(("a", "http://x"),), api=None, task_set=tasks, num_requests=2, warmup=0, sampling=FLAGS,
            load=LoadShape(kind="trace", speed=1e-6), out=tmp_path)  # a 12-day replay of a 1 s gap: slow, not absurd
    if load.kind != "trace" and load.rate != 5e-324:  # a ceiling of requests, the duration the bound
        RunPlan(arms=(("a", "http://x"),), api=None, task_set=tasks, num_requests=2, warmup=0, sampling=FLAGS,
                load=load, out=tmp_path, duration_s=60.0)


def test_config_records_the_routes_and_two_runs_compare_only_with_the_same(tmp_path: Path) -> None:
    base = run_config("r1")
    assert base.routes == {"native": 100}  # a run before routes were recorded sent all on its api
    mixed = base.model_copy(update={"run_id": "r2", "api": "mixed", "routes": {"native": 60, "chat": 40}})
    assert comparability(base, "zlab", mixed, "inhouse") == ["api: native vs mixed", "routes.native: 100 vs 60",
                                                             "routes.chat: not set vs 40"]
    assert comparability(mixed, "zlab", mixed.model_copy(update={"run_id": "r3"}), "inhouse") == []


def test_two_traces_of_the_same_requests_at_other_times_do_not_compare(tmp_path: Path) -> None:
    """The same bodies captured 50 ms and 1 s apart: one task set, two loads 20 times apart, which a trace's
    other fields (kind, speed) do not tell apart; the same gaps from a later start are the same schedule."""
    def recorded(name: str, gap_s: float, start_s: float = 0.0) -> RunConfig:
        requests = [("/generate", native(str(n)), start_s + n * gap_s) for n in range(4)]
        tasks = load_capture_tasks(capture(tmp_path, requests, name))
        plan = RunPlan(arms=(("a", "http://x"),), api=None, task_set=tasks, num_requests=4, warmup=0, sampling=FLAGS,
                       load=LoadShape(kind="trace", speed=1.0), out=tmp_path)
        return run_config(name).model_copy(update={"tasks": run_config(name).tasks.model_copy(
            update={"sha256": tasks.sha256}), "load": plan.recorded_load})

    fast, slow, later = recorded("fast", 0.05), recorded("slow", 1.0), recorded("later", 0.05, start_s=30.0)
    assert fast.tasks.sha256 == slow.tasks.sha256 and fast.load.trace_sha256 is not None
    assert fast.load.trace_sha256 == trace_sha256([7.0, 7.05, 7.1, 7.15])
    [line] = comparability(fast, "zlab", slow, "inhouse")
    assert line.startswith("load.trace_sha256: ") and " vs " in line
    assert comparability(fast, "zlab", later, "inhouse") == []
    closed = LoadShape(kind="closed", concurrency=2)  # the capture's tasks, not its times
    tasks = load_capture_tasks(capture(tmp_path, [("/generate", native("a"), 0.0)], "closed"))
    assert RunPlan(arms=(("a", "http://x"),), api=None, task_set=tasks, num_requests=1, warmup=0, sampling=FLAGS,
                   load=closed, out=tmp_path).recorded_load == closed


# --- the trace schedule and its fidelity ---------------------------------------------------------------------------

def test_trace_offsets_start_at_zero_and_divide_gaps_by_speed() -> None:
    assert trace_offsets([5.0, 5.5, 9.0], 1.0) == [0.0, 0.5, 4.0]
    assert trace_offsets([5.0, 5.5, 9.0], 2.0) == [0.0, 0.25, 2.0]
    assert trace_offsets([5.0, 5.5, 9.0], 0.5) == [0.0, 1.0, 8.0]
    with pytest.raises(ValueError, match="not in order"):
        trace_offsets([1.0, 0.5], 1.0)


def test_a_trace_load_shape_takes_its_offsets_from_the_capture() -> None:
    load = LoadShape(kind="trace", speed=4.0)
    assert load.offsets(2, [3.0, 7.0, 11.0]) == [0.0, 1.0]
    assert load.describe() == "captured arrival times at 4x speed"
    with pytest.raises(ValueError, match="needs as many arrival times"):
        load.offsets(3, [0.0])


@pytest.mark.parametrize(("fields", "field", "message"), [
    ({"kind": "trace"}, "speed", "trace arrivals need > 0"), ({"kind": "trace", "speed": 0}, "speed", "need > 0"),
    ({"kind": "trace", "speed": 1, "rate": 2}, "rate", "trace arrivals take none"),
    ({"kind": "poisson", "rate": 2, "speed": 2}, "speed", "only with trace arrivals"),
    ({"kind": "trace", "speed": 1, "concurrency": 0}, "concurrency", "must be >= 1"),
    ({"kind": "closed", "concurrency": 1, "trace_sha256": "ab"}, "trace_sha256", "only with trace arrivals"),
    ({"kind": "trace", "speed": float("inf")}, "speed", "finite number"),
    ({"kind": "poisson", "rate": float("nan")}, "rate", "finite number"),
    ({"kind": "constant", "rate": float("inf")}, "rate", "finite number"),
])
def test_trace_load_shape_refuses_naming_the_field(fields: dict[str, object], field: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as refused:
        LoadShape(**fields)  # type: ignore[arg-type]
    error = invalid_field(refused.value)
    assert error.field == field and message in error.message and not error.message.startswith("Value error")


def test_fidelity_is_lateness_of_each_send_in_ms() -> None:
    sends = [(float(i), i + late / 1e3) for i, late in enumerate([1.0] * 98 + [5.0, 40.0])]
    fidelity = schedule_fidelity(sends)
    assert fidelity is not None
    assert (fidelity.n, fidelity.late_p50_ms, fidelity.late_p99_ms, fidelity.late_max_ms) == pytest.approx(
        (100, 1.0, 5.0, 40.0))
    early = schedule_fidelity([(1.0, 0.999)])
    assert early is not None and early.late_max_ms == pytest.approx(-1.0)
    assert schedule_fidelity([]) is None


def test_the_summary_reports_fidelity_per_arm_from_measured_records() -> None:
    def record(arm: str, index: int, late_s: float, warmup: bool = False) -> RequestRecord:
        return RequestRecord(arm=arm, index=index, task_id="t", warmup=warmup, scheduled_s=index, dispatched_s=index,
                             sent_s=index + late_s, end_s=index + 1.0)

    records = [record("zlab", 0, 5.0, warmup=True), record("zlab", 1, 0.002), record("zlab", 2, 0.004),
               record("inhouse", 1, 0.010)]
    fidelity = summarize(run_config("r"), records, False, {}).schedule_fidelity
    assert set(fidelity) == {"zlab", "inhouse"}
    assert (fidelity["zlab"].n, fidelity["zlab"].late_max_ms) == (2, pytest.approx(4.0))
    assert fidelity["inhouse"].late_p50_ms == pytest.approx(10.0)
    closed = [r.model_copy(update={"scheduled_s": None}) for r in records]
    assert summarize(run_config("r"), closed, False, {}).schedule_fidelity == {}
