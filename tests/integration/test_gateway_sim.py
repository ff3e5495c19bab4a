"""The gateway in front of simulated SGLang engines on loopback: the split, stickiness, shadowing, replica loss and
the per-arm metrics, each under a bounded load."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import yaml

from tests.integration.servers import gateway_server, refusing_port, serve, sim_argv, sim_server, url_of

pytestmark = pytest.mark.slow


@dataclass
class Reply:
    status: int
    arm: str
    body: bytes
    started: bool


async def _send(session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]) -> Reply:
    started = False
    chunks = []
    try:
        async with session.post(url, json=body, headers=headers) as response:
            async for data in response.content.iter_any():
                started = True
                chunks.append(data)
            return Reply(response.status, response.headers.get("x-dfserve-arm", ""), b"".join(chunks), started)
    except aiohttp.ClientError:
        return Reply(0, "", b"".join(chunks), started)


def load(url: str, bodies: Sequence[dict[str, Any]], concurrency: int = 16,
         headers: Sequence[dict[str, str]] | None = None, on_reply: Callable[[int], None] | None = None) -> list[Reply]:
    """Send every body, `concurrency` at a time; replies in the order of `bodies`. `on_reply(done)` after each."""

    async def run() -> list[Reply]:
        gate = asyncio.Semaphore(concurrency)
        done = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async def one(i: int) -> Reply:
                nonlocal done
                async with gate:
                    reply = await _send(session, url, bodies[i], headers[i] if headers else {})
                done += 1
                if on_reply is not None:
                    on_reply(done)
                return reply
            return await asyncio.gather(*(one(i) for i in range(len(bodies))))

    return asyncio.run(run())


def write_config(tmp_path: Path, arms: dict[str, list[str]], weights: dict[str, float], **extra: Any) -> Path:
    config = {
        "arms": {name: {"weight": weights[name], "replicas": urls} for name, urls in arms.items()},
        "health": {"interval_s": 0.2, "eject_after_failures": 2},
        "scrape": {"interval_s": 0.3, "window_s": 60},
        "seed": 11,
        **extra,
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def undated(body: bytes) -> bytes:
    """An OpenAI answer without its `created` (the second its request came): two requests may straddle one."""
    return CREATED.sub(b'"created":0', body)


CREATED = re.compile(rb'"created":\d+')


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            series, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in series for k, v in labels.items()):
                total += float(value)
    return total


def wait_metric(url: str, name: str, expected: float, timeout_s: float = 10, **labels: str) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(url + "/metrics").text
        if metric(text, name, **labels) >= expected or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def native(i: int, tokens: int = 2, stream: bool = False) -> dict[str, Any]:
    return {"text": f"def task_{i}():", "sampling_params": {"max_new_tokens": tokens, "temperature": 0},
            "stream": stream}


def chat(i: int, tokens: int = 4, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model": "qwen", "messages": [{"role": "user", "content": f"write task {i}"}], "max_tokens": tokens,
            "temperature": 0, "stream": stream, **extra}


@pytest.fixture(scope="module")
def sims() -> Iterator[tuple[str, str]]:
    with sim_server("zlab", 0.01, 1) as baseline, sim_server("inhouse", 0.01, 2) as candidate:
        yield baseline, candidate


def test_split_90_10_within_binomial_bounds_and_per_arm_metrics(sims: tuple[str, str], tmp_path: Path) -> None:
    baseline, candidate = sims
    config = write_config(tmp_path, {"baseline": [baseline], "candidate": [candidate]},
                          {"baseline": 90, "candidate": 10})
    n = 2000
    with gateway_server(config) as gw:
        replies = load(gw + "/generate", [native(i) for i in range(n)], concurrency=32)
        assert all(r.status == 200 for r in replies)
        arms = Counter(r.arm for r in replies)
        assert abs(arms["candidate"] - n * 0.1) <= 4 * math.sqrt(n * 0.1 * 0.9), arms
        assert arms["baseline"] + arms["candidate"] == n
        text = wait_metric(gw, "dfserve_arm_windowed_accept_length", 1, arm="candidate")
    for arm in ("baseline", "candidate"):
        assert metric(text, "dfserve_requests_total", arm=arm, route="native", status="2xx") == arms[arm]
        assert metric(text, "dfserve_accept_length_count", arm=arm, route="native", measure="exact") == arms[arm]
        windowed = metric(text, "dfserve_arm_windowed_accept_length", arm=arm)
        assert 1 <= windowed <= 16, (arm, windowed)
    assert metric(text, "dfserve_arm_weight", arm="candidate") == 10


def test_sticky_keys_never_change_arm(sims: tuple[str, str], tmp_path: Path) -> None:
    baseline, candidate = sims
    config = write_config(tmp_path, {"baseline": [baseline], "candidate": [candidate]},
                          {"baseline": 50, "candidate": 50}, mode="sticky")
    keys = [f"user-{i}" for i in range(60)] * 4
    with gateway_server(config) as gw:
        by_field = load(gw + "/v1/chat/completions", [chat(i, 1, user=key) for i, key in enumerate(keys)])
        by_header = load(gw + "/v1/chat/completions", [chat(i, 1) for i in range(len(keys))],
                         headers=[{"x-dfserve-route-key": key} for key in keys])
    for replies in (by_field, by_header):
        assert all(r.status == 200 for r in replies)
        seen: dict[str, set[str]] = {}
        for key, reply in zip(keys, replies, strict=True):
            seen.setdefault(key, set()).add(reply.arm)
        assert all(len(arms) == 1 for arms in seen.values()), seen
        assert {arm for arms in seen.values() for arm in arms} == {"baseline", "candidate"}


def test_pinned_requests_reach_their_arm_whatever_the_split(sims: tuple[str, str], tmp_path: Path) -> None:
    baseline, candidate = sims
    config = write_config(tmp_path, {"baseline": [baseline], "candidate": [candidate]},
                          {"baseline": 100, "candidate": 0})
    with gateway_server(config) as gw:
        pinned = load(gw + "/generate", [native(i) for i in range(20)], headers=[{"x-dfserve-arm": "candidate"}] * 20)
        unpinned = load(gw + "/generate", [native(i) for i in range(20)])
        unknown = load(gw + "/generate", [native(0)], headers=[{"x-dfserve-arm": "nope"}])
    assert [r.arm for r in pinned] == ["candidate"] * 20
    assert [r.arm for r in unpinned] == ["baseline"] * 20
    assert unknown[0].status == 400


def test_server_info_answers_for_the_arm_that_serves_unpinned_traffic_and_refuses_a_split(
        sims: tuple[str, str], tmp_path: Path) -> None:
    """SGLang's own benchmark reads acceptance from /server_info without an arm header: through a split it must not
    get the baseline's figure as if it were the run's."""
    baseline, candidate = sims
    drafter = "speculative_draft_model_path"
    split = write_config(tmp_path, {"baseline": [baseline], "candidate": [candidate]}, {"baseline": 50, "candidate": 50})
    with gateway_server(split) as gw:
        refused = httpx.get(gw + "/server_info")
        refused_by_its_old_name = httpx.get(gw + "/get_server_info")
        pinned = httpx.get(gw + "/server_info", headers={"x-dfserve-arm": "candidate"})
        models = httpx.get(gw + "/v1/models")
        health = httpx.get(gw + "/health_generate")
    assert refused.status_code == 409 and "x-dfserve-arm" in refused.json()["error"]["message"]
    assert refused_by_its_old_name.status_code == 409
    assert health.status_code == 200 and health.headers["x-dfserve-arm"] in ("baseline", "candidate")
    assert pinned.status_code == 200 and pinned.json()[drafter] == "inhouse/Qwen3.6-27B-DFlash"
    assert models.status_code == 200  # the same model behind every arm: any arm's list answers
    test_only = write_config(tmp_path, {"baseline": [baseline], "candidate": [candidate]},
                             {"baseline": 100, "candidate": 0})
    with gateway_server(test_only) as gw:
        assert all(httpx.get(gw + "/server_info").json()[drafter] == "z-lab/Qwen3.6-27B-DFlash" for _ in range(5))


def stream_text(body: bytes) -> str:
    parts = []
    for event in body.split(b"\n\n"):
        if event.startswith(b"data: {"):
            for choice in json.loads(event[6:]).get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts)


def test_shadow_returns_baseline_answers_while_candidate_is_measured(sims: tuple[str, str], tmp_path: Path) -> None:
    baseline, candidate = sims
    config = write_config(tmp_path, {"baseline": [baseline], "candidate": [candidate]},
                          {"baseline": 1, "candidate": 1}, mode="shadow", primary="baseline")
    n = 40
    bodies = [chat(i, 8, stream=True) for i in range(n)]
    direct = load(baseline + "/v1/chat/completions", bodies)
    with gateway_server(config) as gw:
        replies = load(gw + "/v1/chat/completions", bodies)
        text = wait_metric(gw, "dfserve_shadow_requests_total", n, arm="candidate", outcome="ok")
    assert all(r.status == 200 and r.arm == "baseline" for r in replies)
    assert [stream_text(r.body) for r in replies] == [stream_text(d.body) for d in direct]
    assert metric(text, "dfserve_shadow_requests_total", arm="candidate", outcome="ok") == n
    assert metric(text, "dfserve_requests_total", arm="candidate", route="chat", status="2xx") == n
    assert metric(text, "dfserve_time_to_first_token_seconds_count", arm="candidate", route="chat") == n


def test_streams_read_as_without_the_gateway_while_it_measures_them_exactly(sims: tuple[str, str],
                                                                           tmp_path: Path) -> None:
    """The gateway asks the engine for spec details on streams whose client did not, and cuts them out again: the
    client reads the very bytes the engine sends it directly (the same `rid`, so the same ids; `created` aside, the
    second each request came), and the gateway's acceptance is exact. A client that asked gets them untouched."""
    baseline, _ = sims
    config = write_config(tmp_path, {"baseline": [baseline]}, {"baseline": 1})
    usage = {"stream_options": {"include_usage": True}}
    cases = [("/v1/chat/completions", chat(0, 40, stream=True, **usage)), ("/v1/chat/completions", chat(1, 40, stream=True)),
             ("/v1/completions", {"model": "qwen", "prompt": "def task_2():", "max_tokens": 40, "temperature": 0,
                                  "stream": True, **usage})]
    with gateway_server(config) as gw:
        for n, (path, body) in enumerate(cases):
            for asked in (False, True):
                sent = {**body, "rid": f"stream-{n}-{asked}", **({"return_spec_tokens_details": True} if asked else {})}
                direct = httpx.post(baseline + path, json=sent, timeout=30).content
                via = httpx.post(gw + path, json=sent, timeout=30).content
                assert undated(via) == undated(direct) and via.endswith(b"data: [DONE]\n\n"), (path, asked)
                assert (b'"sglext":{"spec_tokens_details":{' in via) is asked, (path, asked)
        text = httpx.get(gw + "/metrics").text
    assert metric(text, "dfserve_accept_length_count", arm="baseline", measure="exact") == 2 * len(cases)
    assert metric(text, "dfserve_accept_length_count", arm="baseline", measure="estimated") == 0
    assert metric(text, "dfserve_spec_verify_rounds_total", arm="baseline", route="completions") > 0


def test_an_engine_without_spec_details_leaves_streams_to_an_estimate(tmp_path: Path) -> None:
    """An engine before SGLang 0.5.23 ignores `return_spec_tokens_details`: the gateway's request for them changes
    nothing the client reads, and streamed chat is measured by usage tokens over content chunks."""
    with sim_server("zlab", 0.01, 1, "--no-spec-details") as old:
        config = write_config(tmp_path, {"baseline": [old]}, {"baseline": 1})
        body = chat(0, 40, stream=True, stream_options={"include_usage": True}, rid="old-0")
        with gateway_server(config) as gw:
            direct = httpx.post(old + "/v1/chat/completions", json={**body, "return_spec_tokens_details": True},
                                timeout=30).content
            via = httpx.post(gw + "/v1/chat/completions", json=body, timeout=30).content
            whole = httpx.post(old + "/v1/chat/completions", json={**chat(1, 40), "return_spec_tokens_details": True},
                               timeout=30).json()
            text = httpx.get(gw + "/metrics").text
    assert undated(via) == undated(direct) and b"sglext" not in via and "sglext" not in whole
    assert metric(text, "dfserve_accept_length_count", arm="baseline", route="chat", measure="estimated") == 1
    assert metric(text, "dfserve_accept_length_count", arm="baseline", measure="exact") == 0


def test_failing_candidate_never_fails_a_client_request(sims: tuple[str, str], tmp_path: Path) -> None:
    baseline, _ = sims
    with refusing_port() as dead_sock, sim_server("inhouse", 0.01, 3, "--error-rate", "1.0") as erroring:
        dead = url_of(dead_sock)
        config = write_config(tmp_path, {"baseline": [baseline], "erroring": [erroring], "dead": [dead]},
                              {"baseline": 1, "erroring": 1, "dead": 1}, mode="shadow", primary="baseline")
        with gateway_server(config) as gw:
            replies = load(gw + "/v1/chat/completions", [chat(i, 4, stream=i % 2 == 0) for i in range(30)])
            text = wait_metric(gw, "dfserve_shadow_requests_total", 30, arm="erroring")
    assert all(r.status == 200 and r.arm == "baseline" for r in replies)
    # Mirrors go out while the replica is admitted and are skipped (and counted) while it is ejected.
    assert metric(text, "dfserve_shadow_requests_total", arm="erroring", outcome="error") >= 2
    assert metric(text, "dfserve_shadow_requests_total", arm="erroring") == 30
    assert metric(text, "dfserve_shadow_requests_total", arm="dead", outcome="ok") == 0
    assert metric(text, "dfserve_shadow_requests_total", arm="baseline") == 0


def test_killing_a_replica_loses_no_request_that_had_not_started(tmp_path: Path) -> None:
    with serve(sim_argv("zlab", 0.3, 1)) as kept, serve(sim_argv("zlab", 0.3, 2)) as doomed, \
            gateway_server(write_config(tmp_path, {"a": [kept.url, doomed.url]}, {"a": 1})) as gw:
        urls = [kept.url, doomed.url]
        bodies = [native(i, 48, stream=True) for i in range(240)]

        def kill_at_a_third(done: int) -> None:
            if done == len(bodies) // 3:
                os.killpg(doomed.process.pid, signal.SIGKILL)

        replies = load(gw + "/generate", bodies, 24, on_reply=kill_at_a_third)
        text = wait_metric(gw, "dfserve_requests_total", len(bodies))
    complete = [r for r in replies if r.status == 200 and r.body.endswith(b"data: [DONE]\n\n") and b'"error"' not in r.body]
    cut = [r for r in replies if r not in complete]
    assert all(r.started and r.status == 200 and b'"error"' in r.body for r in cut), "a request failed before streaming"
    assert 1 <= len(cut) <= 24, "only streams in flight on the killed replica end early"
    assert metric(text, "dfserve_replica_ejections_total", arm="a", replica=urls[1]) >= 1
    assert metric(text, "dfserve_requests_total", arm="a", replica=urls[0], status="2xx") > 0
    assert metric(text, "dfserve_requests_total", arm="a", status="error") == len(cut), "a cut stream is a failure"
