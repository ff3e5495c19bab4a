"""dfserve against real SGLang 0.5.23 (its own scheduler, HTTP server and DFLASH worker, on CPU) serving tiny real
weights: a Qwen3 target, a distilled drafter deployed from a trainer's checkpoint.pt, an undertrained one from its
folder, and the target alone as the greedy reference (tests/fixtures/sglang_cpu.py). Each server starts once for
the whole module; every check here is against what SGLang itself answered.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from dfserve import sglang
from dfserve.loadtest.records import RequestRecord
from dfserve.loadtest.tasks import load_tasks
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

MAX_NEW = 40
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
    status = run_dfserve("deploy", "status", "cpu-long", "--root", str(servers.root))
    assert status.returncode == 0 and status.stdout.startswith("cpu-long: healthy"), status.stderr
    assert "version 0.5.23" in status.stdout


def test_check_runs_sglangs_parser_on_the_cpu_profile_and_starts_nothing(world: World, tmp_path: Path) -> None:
    done = run_dfserve("deploy", "--engine", "sglang", "--profile", "cpu", "--target", str(world.target),
                       "--drafter", str(world.short), "--sglang-python", str(SGLANG_CPU_PYTHON), "--port", "1",
                       "--root", str(tmp_path), "--check", "--dry-run", timeout=300)
    assert done.returncode == 0, done.stderr
    assert "SGLang 0.5.23 accepts it: DFLASH, block 8, draft attention torch_native" in done.stderr
    assert "--device cpu" in done.stdout and "SGLANG_USE_CPU_ENGINE=1" in done.stdout
    assert not (tmp_path / "cpu-short").exists()


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


def sglang_counts(url: str, api: str, task_text: str, messages: list[dict[str, str]]) -> tuple[int, int]:
    """(completion tokens, verify rounds) as SGLang reports them for the request, asked directly and whole."""
    if api == "native":
        meta = httpx.post(f"{url}/generate", json=sglang.generate_body(task_text, SAMPLING, stream=False),
                          timeout=600).raise_for_status().json()["meta_info"]
    else:
        body = sglang.chat_body("default", messages, SAMPLING, stream=False, return_meta_info=True)
        meta = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).raise_for_status().json()["choices"][0]["meta_info"]
    return int(meta["completion_tokens"]), int(meta["spec_verify_ct"])


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
    expected = {t.id: sglang_counts(servers.long.url, api, t.as_text(), t.as_messages()) for t in tasks}
    direct = loadtest(world, tmp_path / "runs", f"direct-{api}", api, servers.long.url)
    with gateway_server(gateway_config(tmp_path / "gateway.yaml", {"long": servers.long.url})) as url:
        relayed = loadtest(world, tmp_path / "runs", f"gateway-{api}", api, url)
    for records in (direct, relayed):
        assert len(records) == len(tasks)
        for record in records:
            assert record.ok and record.acceptance == "exact", record
            assert (record.completion_tokens, record.spec_verify_ct) == expected[record.task_id], record.task_id
    assert any(rounds < tokens for tokens, rounds in expected.values())  # the drafter was accepted somewhere


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
    tokens, rounds = sglang_counts(servers.long.url, "chat", task.as_text(), task.as_messages())
    body = sglang.chat_body("default", task.as_messages(), SAMPLING, stream=True)
    with gateway_server(gateway_config(tmp_path / "gateway.yaml", {"long": servers.long.url})) as url:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as reply:
            raw = b"".join(reply.iter_bytes())
        assert sglang.SPEC_DETAILS_KEY not in raw and b'"usage"' not in raw.replace(b'"usage":null', b"")
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert metric_value(metrics, "dfserve_accept_length_count", arm="long", measure="exact") == 1
    assert metric_value(metrics, "dfserve_accept_length_sum", arm="long", measure="exact") == pytest.approx(tokens / rounds)
    estimated = [line for line in metrics.splitlines()
                 if line.startswith("dfserve_accept_length_count") and 'measure="estimated"' in line]
    assert all(float(line.rsplit(" ", 1)[1]) == 0 for line in estimated), estimated
