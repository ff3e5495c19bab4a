"""dfserve against real SGLang 0.5.23 (its own scheduler, HTTP server and DFLASH worker, on CPU) serving tiny real
weights: a Qwen3 target, a distilled drafter deployed from a trainer's checkpoint.pt, an undertrained one from its
folder, and the target alone as the greedy reference (tests/fixtures/sglang_cpu.py). Each server starts once for
the whole module; every check here is against what SGLang itself answered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fnmatch
import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from dfserve import sglang
from dfserve.gateway.relay import NativeStream, OpenAIStream, measure_whole
from dfserve.loadtest.client import read_stream
from dfserve.loadtest.records import RequestRecord
from dfserve.tasks import load_tasks
from tests.fixtures.sglang_cpu import (
    REPO,
    SGLANG_CPU_PYTHON,
    Servers,
    World,
    build_world,
    deployment_record,
    sglang_servers,
)
from tests.integration.servers import dfserve_argv, gateway_server

pytestmark = [pytest.mark.heavy, pytest.mark.slow]

MAX_NEW = 32
SAMPLING = sglang.SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return build_world(tmp_path_factory.mktemp("sglang-cpu"))


@pytest.fixture(scope="module")
def servers(world: World) -> Iterator[Servers]:
    with sglang_servers(world, world.root) as started:
        yield started


def prompts(world: World) -> list[str]:
    return [task.as_text() for task in load_tasks(str(world.tasks)).tasks]


def generate(url: str, texts: list[str]) -> list[dict[str, Any]]:
    """One native request per text, all in flight at once (SGLang batches them)."""
    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=600) as client:
            replies = await asyncio.gather(*(
                client.post(f"{url}/generate", json=sglang.generate_body(text, SAMPLING, stream=False)) for text in texts))
        return [reply.raise_for_status().json() for reply in replies]
    return asyncio.run(run())


def run_dfserve(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(dfserve_argv(*args), capture_output=True, text=True, env=ENV, timeout=timeout, check=False)


# ---------------------------------------------------------------------------------------------------------------
# deploy


def test_check_runs_sglangs_parser_on_the_cpu_profile_and_starts_nothing(world: World, tmp_path: Path) -> None:
    """Before the module's servers start: their schedulers poll without pause, and starved the parser's import past
    its limit on two cores."""
    done = run_dfserve("deploy", "--engine", "sglang", "--profile", "cpu", "--target", str(world.target),
                       "--drafter", str(world.short), "--sglang-python", str(SGLANG_CPU_PYTHON), "--port", "1",
                       "--root", str(tmp_path), "--check", "--dry-run", timeout=600)
    assert done.returncode == 0, done.stderr
    assert "SGLang 0.5.23 accepts it: DFLASH, block 8, draft attention torch_native" in done.stderr
    assert "--device cpu" in done.stdout and "SGLANG_USE_CPU_ENGINE=1" in done.stdout
    assert not (tmp_path / "cpu-short").exists()


def test_deploy_started_real_sglang_with_dflash_from_a_converted_checkpoint(servers: Servers) -> None:
    record = deployment_record(servers.root, "cpu-long")
    assert record["simulated"] is False and record["engine_version"] == "0.5.23"
    assert record["argv"][:3] == [str(SGLANG_CPU_PYTHON), "-m", "sglang.launch_server"]
    info = record["server_info"]
    assert info["speculative_algorithm"] == "DFLASH" and info["device"] == "cpu"
    assert info["speculative_draft_attention_backend"] == "torch_native" and info["dtype"] == "bfloat16"
    assert record["spec"]["drafter"]["kind"] == "checkpoint"
    assert info["speculative_draft_model_path"] == record["spec"]["drafter"]["model_path"]
    assert Path(info["speculative_draft_model_path"]).is_relative_to(servers.root / "drafters")
    for _ in range(3):  # `status` allows /health 5 s; two cores shared by three SGLang servers may take longer
        status = run_dfserve("deploy", "status", "cpu-long", "--root", str(servers.root))
        if status.stdout.startswith("cpu-long: healthy"):
            break
    assert status.returncode == 0 and status.stdout.startswith("cpu-long: healthy"), status.stdout + status.stderr
    assert "version 0.5.23" in status.stdout


# ---------------------------------------------------------------------------------------------------------------
# 1. lossless


def test_each_drafter_reproduces_the_targets_greedy_output_one_request_at_a_time(world: World, servers: Servers) -> None:
    for text in prompts(world)[:3]:
        (reference,) = generate(servers.plain.url, [text])
        assert "spec_verify_ct" not in reference["meta_info"]
        for server in (servers.long, servers.short):
            (reply,) = generate(server.url, [text])
            assert reply["output_ids"] == reference["output_ids"], (server.name, text)
            assert reply["meta_info"]["spec_verify_ct"] >= 1


def test_each_drafter_reproduces_the_targets_greedy_output_in_a_batch(world: World, servers: Servers) -> None:
    texts = prompts(world)
    references = [reply["output_ids"] for reply in generate(servers.plain.url, texts)]
    for server in (servers.long, servers.short):
        replies = generate(server.url, texts)
        assert [reply["output_ids"] for reply in replies] == references, server.name
    assert len({tuple(ids) for ids in references}) == len(texts)  # distinct answers: a mixed-up batch would show


# ---------------------------------------------------------------------------------------------------------------
# 2. exact acceptance


def loadtest(world: World, out: Path, name: str, api: str, arm_url: str, *extra: str) -> list[RequestRecord]:
    done = run_dfserve("loadtest", "run", "--arm", f"long={arm_url}", "--api", api, "--tasks", str(world.tasks),
                       "--num-requests", str(len(prompts(world))), "--warmup", "0", "--max-new-tokens", str(MAX_NEW),
                       "--concurrency", "1", "--out", str(out), "--name", name, "--quiet", *extra)
    assert done.returncode == 0, done.stderr
    lines = (out / name / "requests.jsonl").read_text().splitlines()
    return [RequestRecord.model_validate_json(line) for line in lines]


def sglang_answer(url: str, api: str, task_text: str, messages: list[dict[str, str]]) -> tuple[int, int, str]:
    """(completion tokens, verify rounds, sha256 of the output) as SGLang reports them for the request, asked
    directly and whole."""
    if api == "native":
        reply = httpx.post(f"{url}/generate", json=sglang.generate_body(task_text, SAMPLING, stream=False),
                           timeout=600).raise_for_status().json()
        meta, text = reply["meta_info"], reply["text"]
    else:
        body = sglang.chat_body("default", messages, SAMPLING, stream=False, return_meta_info=True)
        choice = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).raise_for_status().json()["choices"][0]
        meta, text = choice["meta_info"], choice["message"]["content"]
    return int(meta["completion_tokens"]), int(meta["spec_verify_ct"]), hashlib.sha256(text.encode()).hexdigest()


def gateway_config(path: Path, arms: dict[str, str]) -> Path:
    config = {
        "arms": {name: {"weight": 1.0 / len(arms), "replicas": [url]} for name, url in arms.items()},
        "health": {"interval_s": 1.0, "eject_after_failures": 5},
        "scrape": {"interval_s": 1.0, "window_s": 60},
        "seed": 3,
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("api", ["native", "chat"])
def test_loadtest_records_the_verify_rounds_sglang_reports_direct_and_through_the_gateway(
        world: World, servers: Servers, tmp_path: Path, api: str) -> None:
    tasks = load_tasks(str(world.tasks)).tasks
    expected = {t.id: sglang_answer(servers.long.url, api, t.as_text(), t.as_messages()) for t in tasks}
    direct = loadtest(world, tmp_path / "runs", f"direct-{api}", api, servers.long.url)
    with gateway_server(gateway_config(tmp_path / "gateway.yaml", {"long": servers.long.url})) as url:
        relayed = loadtest(world, tmp_path / "runs", f"gateway-{api}", api, url)
    for records in (direct, relayed):
        assert len(records) == len(tasks)
        for record in records:
            assert record.ok and record.acceptance == "exact", record
            # the output read from the stream is the whole answer's: a native stream's events are not taken for
            # deltas (each holds all its output_ids), nor a chat stream's deltas for anything but deltas
            assert (record.completion_tokens, record.spec_verify_ct, record.output_sha256) == expected[record.task_id]
    assert any(rounds < tokens for tokens, rounds, _ in expected.values())  # the drafter was accepted somewhere


def test_a_native_stream_of_deltas_is_read_whole(world: World, servers: Servers, tmp_path: Path) -> None:
    """The reference server streams deltas: each native event holds only its new output_ids and text. The load
    tester's output is still the whole answer's, and its token counts SGLang's."""
    tasks = load_tasks(str(world.tasks)).tasks
    whole = {t.id: reply for t, reply in zip(tasks, generate(servers.plain.url, [t.as_text() for t in tasks]),
                                             strict=True)}
    records = loadtest(world, tmp_path / "runs", "deltas", "native", servers.plain.url)
    assert len(records) == len(tasks)
    for record in records:
        reply = whole[record.task_id]
        assert record.ok and record.completion_tokens == reply["meta_info"]["completion_tokens"], record
        assert record.output_sha256 == hashlib.sha256(reply["text"].encode()).hexdigest(), record.task_id
    with httpx.stream("POST", f"{servers.plain.url}/generate", timeout=600,
                      json=sglang.generate_body(tasks[0].as_text(), SAMPLING, stream=True)) as response:
        raw = response.read()
    events = sglang.SSEDecoder().feed(raw)
    ids = [len(json.loads(data)["output_ids"]) for data in events if data != sglang.DONE]
    assert len(ids) > 1 and sum(ids) == whole[tasks[0].id]["meta_info"]["completion_tokens"]  # deltas, not totals
    assert sglang.native_stream_end(raw).incremental  # a shadow record's end reading tells deltas too


def test_a_native_streams_end_holds_the_whole_answer(world: World, servers: Servers) -> None:
    """What a shadow record reads of a native stream, its last event alone (`sglang.native_stream_end`), is real
    SGLang's whole answer: a drafter server repeats the output so far in every event."""
    task = load_tasks(str(world.tasks)).tasks[0]
    [reply] = generate(servers.long.url, [task.as_text()])
    with httpx.stream("POST", f"{servers.long.url}/generate", timeout=600,
                      json=sglang.generate_body(task.as_text(), SAMPLING, stream=True)) as response:
        raw = response.read()
    end = sglang.native_stream_end(b"\n\n".join(raw.split(b"\n\n")[-3:]))  # the last event, then [DONE]
    assert (end.text, end.incremental, end.error, end.done) == (reply["text"], False, None, True)
    assert end.finish_reason is not None and end.finish_reason.kind == reply["meta_info"]["finish_reason"]["type"]


def metric_value(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in metrics")


def test_a_plain_clients_streamed_chat_through_the_gateway_is_measured_exactly(world: World, servers: Servers,
                                                                                 tmp_path: Path) -> None:
    """A client asking neither spec details nor usage: SGLang sends the details the gateway asked for in a chunk of
    their own (`choices: []`), and no usage chunk follows; the gateway's figure must still be exact."""
    (task,) = load_tasks(str(world.tasks)).tasks[:1]
    tokens, rounds, _ = sglang_answer(servers.long.url, "chat", task.as_text(), task.as_messages())
    body = sglang.chat_body("default", task.as_messages(), SAMPLING, stream=True)
    with gateway_server(gateway_config(tmp_path / "gateway.yaml", {"long": servers.long.url})) as url:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as reply:
            raw = b"".join(reply.iter_bytes())
        assert sglang.SPEC_DETAILS_KEY not in raw and b'"usage"' not in raw.replace(b'"usage":null', b"")
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert metric_value(metrics, "dfserve_accept_length_count", arm="long", route="chat", measure="exact") == 1
    assert metric_value(metrics, "dfserve_accept_length_sum", arm="long", route="chat", measure="exact") == pytest.approx(tokens / rounds)
    estimated = [line for line in metrics.splitlines()
                 if line.startswith("dfserve_accept_length_count") and 'measure="estimated"' in line]
    assert all(float(line.rsplit(" ", 1)[1]) == 0 for line in estimated), estimated


# ---------------------------------------------------------------------------------------------------------------
# 4. a verdict


def test_the_undertrained_drafter_fails_on_acceptance_through_the_gateway_and_is_not_promoted(
        world: World, servers: Servers, tmp_path: Path) -> None:
    config = gateway_config(tmp_path / "gateway.yaml", {"baseline": servers.long.url, "candidate": servers.short.url})
    with gateway_server(config) as url:
        run = run_dfserve("loadtest", "run", "--arm", f"baseline={url}", "--arm", f"candidate={url}", "--pin-arms",
                          "--until-decided", "--api", "native", "--tasks", str(world.verdict_tasks), "--num-requests", "64",
                          "--warmup", "0", "--max-new-tokens", str(MAX_NEW), "--concurrency", "2",
                          "--out", str(tmp_path / "runs"), "--name", "ab", "--quiet")
    assert run.returncode == 0, run.stderr
    assert "until decided: FAIL" in run.stdout, run.stdout
    records = [RequestRecord.model_validate_json(line) for line in (tmp_path / "runs" / "ab" / "requests.jsonl").read_text().splitlines()]
    assert {r.arm for r in records} == {"baseline", "candidate"} and all(r.ok and r.acceptance == "exact" for r in records)
    judged = run_dfserve("compare", str(tmp_path / "runs" / "ab"))
    assert judged.returncode == 1, judged.stdout + judged.stderr
    (verdict_file,) = (tmp_path / "runs").glob("verdict-*/verdict.json")
    verdict = json.loads(verdict_file.read_text())
    assert verdict["verdict"] == "FAIL"
    accept = next(r for r in verdict["judgement"]["rules"] if r["metric"] == "accept_length")
    assert accept["status"] == "FAIL"
    refused = run_dfserve("promote", str(verdict_file))
    assert refused.returncode != 0 and "FAIL" in refused.stderr, refused.stdout + refused.stderr
    assert not (tmp_path / "runs" / "baselines.json").exists()


# ---------------------------------------------------------------------------------------------------------------
# 3. offline = online

AGREEMENT = "sglang-cpu-agreement.json"
"""Written by the offline-online test beside the run (per task, per drafter), for bench/RESULTS.md."""


def offline_online(world: World, servers: Servers, out: Path) -> dict[str, dict[str, tuple[int, int]]]:
    """Per drafter and task: (rounds `dfserve eval` predicts, verify rounds SGLang made), on the same weights, tasks,
    raw prompts, bfloat16, and SGLang's own greedy references (the target alone)."""
    args = ["eval", "run", "--target", str(world.target), "--drafter", f"long={world.long}",
            "--drafter", f"short={world.short}", "--tasks", str(world.tasks), "--num-tasks", str(len(prompts(world))),
            "--max-new-tokens", str(MAX_NEW), "--prompt-format", "raw", "--dtype", "bfloat16",
            "--reference", servers.plain.url, "--ddtree-budgets", "", "--cache", str(out / "cache"),
            "--drafter-store", str(out / "store"), "--registry", str(out / "runs"), "--out", str(out / "runs"),
            "--name", "offline", "--threads", "1", "--quiet"]
    done = run_dfserve(*args)
    assert done.returncode in (0, 1), done.stderr
    anchors = [json.loads(line) for line in (out / "runs" / "offline" / "anchors.jsonl").read_text().splitlines()]
    tasks = load_tasks(str(world.tasks)).tasks
    table: dict[str, dict[str, tuple[int, int]]] = {}
    for label, server in (("long", servers.long), ("short", servers.short)):
        online = generate(server.url, [t.as_text() for t in tasks])
        table[label] = {
            task.id: (sum(1 for a in anchors if a["drafter"] == label and a["task"] == task.id and "vanilla" in a["rounds"]),
                      int(reply["meta_info"]["spec_verify_ct"]))
            for task, reply in zip(tasks, online, strict=True)
        }
    return table


def test_offline_eval_predicts_each_tasks_online_verify_rounds(world: World, servers: Servers, tmp_path: Path) -> None:
    table = offline_online(world, servers, tmp_path)
    (world.root / AGREEMENT).write_text(json.dumps(table, indent=1))
    for label, tasks in table.items():
        offline = sum(rounds for rounds, _ in tasks.values())
        online = sum(rounds for _, rounds in tasks.values())
        exact = sum(a == b for a, b in tasks.values())
        assert exact >= len(tasks) // 2, (label, tasks)
        assert abs(offline - online) <= max(2, online // 10), (label, tasks)
    long_rounds = sum(r for _, r in table["long"].values())
    short_rounds = sum(r for _, r in table["short"].values())
    assert long_rounds < short_rounds  # the distilled drafter needs fewer rounds online, as offline predicts


# ---------------------------------------------------------------------------------------------------------------
# 5. the simulator against real SGLang

SIM_DIFFERENCES = REPO / "tests" / "fixtures" / "sglang_cpu_sim_differences.yaml"
"""Every difference the simulator shows against real SGLang 0.5.23 on the same requests, each with its reason."""
LONG_PROMPT = "def f(x):\n    return x\n" * 200  # well over the cpu profile's 1024-token context


def keys(value: Any, prefix: str = "") -> set[str]:
    """Dotted paths of every object member (list items under `[]`), so two bodies compare by field set."""
    found: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            found.add(prefix + key)
            found |= keys(item, prefix + key + ".")
    elif isinstance(value, list):
        for item in value:
            found |= keys(item, prefix + "[].")
    return found


def events(raw: bytes) -> list[Any]:
    out: list[Any] = []
    for block in raw.decode().split("\n\n"):
        data = [line.removeprefix("data: ") for line in block.splitlines() if line.startswith("data: ")]
        if data:
            out.append("[DONE]" if data[0] == "[DONE]" else json.loads(data[0]))
    return out


def shape_of_stream(raw: bytes) -> list[str]:
    """The stream as the kinds of its events, repeats collapsed: what a client's parser depends on."""
    kinds: list[str] = []
    for event in events(raw):
        if event == "[DONE]":
            kind = "done"
        elif "error" in event:
            kind = "error"
        elif event.get("choices") == []:
            kind = "usage" if event.get("usage") else "sglext" if event.get("sglext") else "empty-choices"
        elif "meta_info" in event:
            finish = event["meta_info"].get("finish_reason")
            kind = f"native-final {finish_kind(finish)}" if finish else "native"
        else:
            finish = event["choices"][0].get("finish_reason")
            kind = f"final {finish}" if finish else "content"
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    return kinds


def finish_kind(finish: dict[str, Any]) -> str:
    """A native finish reason as a client tells them apart: its type, and the status an abort carries."""
    status = finish.get("status_code")
    return f"{finish['type']} {status}" if status is not None else str(finish["type"])


ABORT_MAX_NEW = 512
"""Long enough that an abort sent after the first event lands mid-generation, on SGLang and the simulator alike."""
SIM_TIME_SCALE = 0.1
"""The simulator's time scale for the probes: 512 tokens then take about 0.2 s, time for an abort to land (at 0.02,
40 ms); the other probes ask for 16 tokens, a few rounds."""


Probed = tuple[int, list[str], set[str]]


def dfserve_reading(api: sglang.Api, raw: bytes, streamed: bool) -> Probed:
    """How dfserve classifies an answer: the load tester's failure kind (it streams only) and the gateway's in-band
    error, whole or streamed."""
    if not streamed:
        return 200, [f"gateway {'stream_error' if measure_whole(api, raw)[1] else 'ok'}"], set()
    failure = read_stream(api, [(0.0, raw)], 0.0).failure
    _, error = (NativeStream() if api == "native" else OpenAIStream()).read_end(None, raw)
    return 200, [f"tester {failure[0] if failure else 'ok'}", f"gateway {'stream_error' if error else 'ok'}"], set()


def aborted_stream(url: str, path: str, body: dict[str, Any], rid: str) -> tuple[Probed, Probed, int]:
    """A stream aborted through SGLang's `POST /abort_request {"rid"}` once its first event has arrived: its status,
    shape and field set, as `probe` records streams, how dfserve reads it, and the requests aborted (one)."""
    with httpx.Client(base_url=url, timeout=600) as client, httpx.Client(base_url=url, timeout=60) as admin:
        with client.stream("POST", path, json={**body, "rid": rid, "stream": True}) as reply:
            raw = b""
            pieces = reply.iter_raw()
            while b"\n\n" not in raw:
                raw += next(pieces)
            admin.post("/abort_request", json={"rid": rid}).raise_for_status()
            raw += b"".join(pieces)
    seen = (reply.status_code, shape_of_stream(raw), set().union(*(keys(e) for e in events(raw) if e != "[DONE]")))
    return seen, dfserve_reading("native" if path == "/generate" else "chat", raw, streamed=True), 1


def aborted_whole(url: str, path: str, body: dict[str, Any], rid: str) -> tuple[Probed, Probed, int]:
    """A whole request aborted through `/abort_request` while it runs: its status, finish reason and field set, how
    dfserve reads it, and the requests aborted. SGLang ignores an abort of a rid it does not hold yet, so the abort
    is repeated until the answer arrives; one that finds the request still queued (a thinner answer, "Abort in
    waiting queue"), or one that finished before an abort landed (a slow machine), is tried again with a new
    request. `body` asks for the native meta_info."""
    aborts = 0
    with httpx.Client(base_url=url, timeout=600) as client, httpx.Client(base_url=url, timeout=60) as admin:
        for attempt in range(1, 6):
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                answer = pool.submit(client.post, path, json={**body, "rid": f"{rid}-{attempt}"})
                while True:
                    admin.post("/abort_request", json={"rid": f"{rid}-{attempt}"}).raise_for_status()
                    try:
                        reply = answer.result(timeout=0.02)
                        break
                    except concurrent.futures.TimeoutError:
                        continue
            obj = reply.json()
            meta = obj["meta_info"] if "meta_info" in obj else obj["choices"][0]["meta_info"]
            aborted = meta["finish_reason"].get("type") == "abort"
            aborts += aborted
            if aborted and meta["finish_reason"].get("message") != "Abort in waiting queue":
                break
    finish = obj["meta_info"]["finish_reason"] if "meta_info" in obj else obj["choices"][0]["finish_reason"]
    seen = (reply.status_code, [finish_kind(finish) if isinstance(finish, dict) else str(finish)], keys(obj))
    return seen, dfserve_reading("native" if path == "/generate" else "chat", reply.content, streamed=False), aborts


def aborted_count(client: httpx.Client) -> float:
    """`sglang:num_aborted_requests_total`, 0 while SGLang has not created its sample (before a first abort)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in client.get("/metrics").text.splitlines()
               if line.startswith("sglang:num_aborted_requests_total"))


def probe(url: str, model: str) -> dict[str, Any]:
    """The same requests to one server: field sets of whole answers, the shapes and field sets of streams, error
    shapes, and the names on its informational routes."""
    chat = {"model": model, "messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 16,
            "temperature": 0}
    completion = {"model": model, "prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0}
    native = {"text": "def add(a, b):", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    seen: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=600) as client:
        seen["native"] = keys(client.post("/generate", json=native).json())
        seen["chat"] = keys(client.post("/v1/chat/completions", json={**chat, "return_spec_tokens_details": True}).json())
        seen["completions"] = keys(client.post("/v1/completions", json=completion).json())
        for name, path, body in (
            ("native stream", "/generate", {**native, "stream": True}),
            ("chat stream", "/v1/chat/completions", {**chat, "stream": True, "return_spec_tokens_details": True,
                                                      "stream_options": {"include_usage": True}}),
            ("completions stream", "/v1/completions", {**completion, "stream": True,
                                                        "stream_options": {"include_usage": True}}),
            ("native stream over context", "/generate", {**native, "text": LONG_PROMPT, "stream": True}),
            ("chat stream over context", "/v1/chat/completions",
             {**chat, "messages": [{"role": "user", "content": LONG_PROMPT}], "stream": True}),
        ):
            reply = client.post(path, json=body)
            seen[name] = (reply.status_code, shape_of_stream(reply.content),
                          set().union(*(keys(e) for e in events(reply.content) if e != "[DONE]")))
        for name, path, body in (("native over context", "/generate", {**native, "text": LONG_PROMPT}),
                                 ("chat over context", "/v1/chat/completions",
                                  {**chat, "messages": [{"role": "user", "content": LONG_PROMPT}]})):
            reply = client.post(path, json=body)
            seen[name] = (reply.status_code, keys(reply.json()))
        long_native = {**native, "sampling_params": {"max_new_tokens": ABORT_MAX_NEW, "temperature": 0,
                                                     "ignore_eos": True}}
        long_chat = {**chat, "max_tokens": ABORT_MAX_NEW, "ignore_eos": True}
        before, aborted = aborted_count(client), 0
        for name, abort, route, request in (
            ("native stream aborted", aborted_stream, "/generate", long_native),
            ("chat stream aborted", aborted_stream, "/v1/chat/completions",
             {**long_chat, "return_spec_tokens_details": True, "stream_options": {"include_usage": True}}),
            ("native aborted", aborted_whole, "/generate", long_native),
            ("chat aborted", aborted_whole, "/v1/chat/completions", {**long_chat, "return_meta_info": True}),
        ):
            seen[name], seen[f"{name}, as dfserve reads it"], requests = abort(
                url, route, request, f"dfserve-{name.replace(' ', '-')}")
            aborted += requests
        counted = aborted_count(client) - before
        seen["/metrics after the aborts"] = (200, [f"{counted - aborted:+g} aborts counted beside one per request"],
                                             set())
        seen["/server_info"] = set(client.get("/server_info").json())
        seen["/model_info"] = set(client.get("/model_info").json())
        seen["/metrics"] = {line.split("{")[0].split(" ")[0] for line in client.get("/metrics").text.splitlines()
                            if line.startswith("sglang:")}
    return seen


def differences(real: dict[str, Any], sim: dict[str, Any]) -> set[tuple[str, str]]:
    """(where, what) for every way the simulator's answers differ from SGLang's."""
    found: set[tuple[str, str]] = set()
    for where, ours in sim.items():
        theirs = real[where]
        if isinstance(theirs, set):
            found |= {(where, f"missing {k}") for k in theirs - ours} | {(where, f"extra {k}") for k in ours - theirs}
            continue
        if theirs[0] != ours[0]:
            found.add((where, f"status {ours[0]}, SGLang {theirs[0]}"))
        if len(theirs) == 3 and theirs[1] != ours[1]:
            found.add((where, f"events {' '.join(ours[1])}, SGLang {' '.join(theirs[1])}"))
        fields_real, fields_sim = theirs[-1], ours[-1]
        found |= ({(where, f"missing {k}") for k in fields_real - fields_sim}
                  | {(where, f"extra {k}") for k in fields_sim - fields_real})
    return found


def test_every_difference_between_the_simulator_and_real_sglang_is_listed_with_its_reason(servers: Servers) -> None:
    from tests.integration.servers import sim_server

    model = deployment_record(servers.root, "cpu-long")["spec"]["served_model_name"]
    real = probe(servers.long.url, model)
    aborted = {where: reading[1] for where, reading in real.items() if where.endswith("as dfserve reads it")}
    assert aborted == {  # an answer cut short by /abort_request is a failure to the tester and the gateway
        "native stream aborted, as dfserve reads it": ["tester stream_error", "gateway stream_error"],
        "chat stream aborted, as dfserve reads it": ["tester stream_error", "gateway stream_error"],
        "native aborted, as dfserve reads it": ["gateway stream_error"],
        "chat aborted, as dfserve reads it": ["gateway stream_error"],
    }
    with sim_server("zlab", SIM_TIME_SCALE, 0, "--context-length", "1024", "--block-size", "8",
                    "--served-model-name", model) as url:
        sim = probe(url, model)
    found = differences(real, sim)
    listed = yaml.safe_load(SIM_DIFFERENCES.read_text())["differences"]
    assert all(entry["reason"].strip() for entry in listed)

    def matches(entry: dict[str, str], difference: tuple[str, str]) -> bool:
        return fnmatch.fnmatchcase(difference[0], entry["where"]) and fnmatch.fnmatchcase(difference[1], entry["what"])

    unlisted = sorted(d for d in found if not any(matches(entry, d) for entry in listed))
    assert not unlisted, f"differences not listed in {SIM_DIFFERENCES.name}: {unlisted}"
    stale = [entry for entry in listed if not any(matches(entry, d) for d in found)]
    assert not stale, f"listed in {SIM_DIFFERENCES.name} but no longer seen: {stale}"
