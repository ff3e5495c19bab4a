"""Clients dfserve does not write, against the simulator and through the gateway: SGLang's own benchmark
(`sglang.benchmark.serving`, native and OpenAI backends, random-ids data, the offline Qwen3 tokenizer) and the
OpenAI SDK. Each is a real client of SGLang 0.5.23; if the simulator or the gateway answered differently from SGLang,
these would fail where dfserve's own client might not."""

from __future__ import annotations

import json
import lzma
import os
import subprocess
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import openai
import pytest

from dfserve.loadtest.records import read_records
from tests import ROOT
from tests.integration.servers import dfserve_argv, gateway_server, sim_server

SGLANG_PYTHON = Path(os.environ.get("DFSERVE_SGLANG_PYTHON", ROOT / ".venv-sglang" / "bin" / "python"))
BENCH = Path(__file__).with_name("sglang_bench.py")
FRONTEND = Path(__file__).with_name("sglang_frontend.py")
MODEL = "Qwen/Qwen3.6-27B"
EVERY_ROUND_EIGHT = {"schema_version": 1, "name": "eight", "block_size": 16,
                     "conditional_accept": [1.0] * 7 + [0.0] * 8}
"""A drafter whose every verify round accepts exactly 7 drafts: 8 tokens per round, bonus included."""


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3 tokenizer the package ships, as a folder `AutoTokenizer` loads offline."""
    folder = tmp_path_factory.mktemp("qwen3-tokenizer")
    packed = resources.files("dfserve.deploy.sim") / "data" / "qwen3-tokenizer.json.xz"
    (folder / "tokenizer.json").write_bytes(lzma.decompress(packed.read_bytes()))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


@pytest.fixture(scope="module")
def sim_and_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    config = tmp_path_factory.mktemp("gw") / "gateway.yaml"
    with sim_server("zlab", 0.01, 0) as sim:
        config.write_text(json.dumps({"arms": {"baseline": {"weight": 1, "replicas": [sim]}},
                                      "scrape": {"enabled": False}}))
        with gateway_server(config) as gw:
            yield sim, gw


def sglang_bench(runs: list[tuple[str, str, Path]], tokenizer: Path, *args: str) -> list[dict[str, Any]]:
    """SGLang's benchmark once per (url, backend, out) of `runs`, all in one process; the result line of each run
    (the JSON it appends to its `out`)."""
    assert SGLANG_PYTHON.is_file(), f"{SGLANG_PYTHON} missing: `make .venv-sglang/.installed` builds it"
    argv = [str(SGLANG_PYTHON), str(BENCH)]
    for url, backend, out in runs:
        argv += ["--then"] if len(argv) > 2 else []
        argv += ["--backend", backend, "--base-url", url, "--model", MODEL, "--dataset-name", "random-ids",
                 "--tokenizer", str(tokenizer), "--random-range-ratio", "1", "--disable-tqdm", "--output-file", str(out),
                 *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180 * len(runs), check=False,
                          cwd=runs[0][2].parent, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return [dict(json.loads(out.read_text().splitlines()[-1])) for _, _, out in runs]


THROUGH = [("gateway", "sglang"), ("gateway", "sglang-oai-chat"), ("sim", "sglang-oai-chat")]


@pytest.fixture(scope="module")
def bench_results(sim_and_gateway: tuple[str, str], tokenizer: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Any]]:
    """SGLang's benchmark through each of THROUGH (where, backend), in one process: its imports are most of a run."""
    urls = dict(zip(("sim", "gateway"), sim_and_gateway, strict=True))
    folder = tmp_path_factory.mktemp("sglang-bench")
    runs = [(urls[through], backend, folder / f"{through}-{backend}.jsonl") for through, backend in THROUGH]
    results = sglang_bench(runs, tokenizer, "--num-prompts", "12", "--random-input-len", "32",
                           "--random-output-len", "24")
    return dict(zip(THROUGH, results, strict=True))


@pytest.mark.parametrize(("through", "backend"), THROUGH)
def test_sglang_benchmark_runs_against_the_simulator_and_through_the_gateway(
        bench_results: dict[tuple[str, str], dict[str, Any]], backend: str, through: str) -> None:
    result = bench_results[through, backend]
    assert result["backend"] == backend
    assert result["completed"] == 12 and result["total_output_tokens"] == 12 * 24
    assert result["server_info"]["dfserve_simulated"] is True  # /server_info reached the engine (one arm: no header)


def test_sglang_benchmarks_acceptance_is_the_testers_less_the_prefill_token(tokenizer: Path, tmp_path: Path) -> None:
    """SGLang's benchmark (native backend, against the simulator) prints `/server_info`'s `avg_spec_accept_length`:
    decode rounds only, as the scheduler logs them every 40 rounds. dfserve's tester divides each request's `completion_tokens`, which include the token
    sampled at prefill, by its verify rounds. With a drafter that accepts exactly 8 tokens per round and requests of
    1 + 4 x 8 tokens, the benchmark must print 8 and the tester 33 / 4: the difference is one prefill token per
    request over its rounds, and nothing else."""
    profile = tmp_path / "eight.json"
    profile.write_text(json.dumps(EVERY_ROUND_EIGHT))
    with sim_server(str(profile), 0.01, 0) as sim:
        subprocess.run(dfserve_argv("loadtest", "run", "--arm", f"eight={sim}", "--num-requests", "40", "--warmup",
                                    "0", "--concurrency", "4", "--max-new-tokens", "33", "--out", str(tmp_path),
                                    "--name", "r", "--quiet"), check=True, timeout=120, capture_output=True)
        [result] = sglang_bench([(sim, "sglang", tmp_path / "bench.jsonl")], tokenizer, "--num-prompts", "4",
                                "--random-input-len", "16", "--random-output-len", "33")
    records = [r for r in read_records(tmp_path / "r" / "requests.jsonl") if r.ok]
    tokens = sum(r.completion_tokens or 0 for r in records)
    rounds = sum(r.spec_verify_ct or 0 for r in records)
    assert len(records) == 40 and tokens / rounds == pytest.approx(33 / 4, abs=0.02)
    assert result["accept_length"] == pytest.approx((tokens - len(records)) / rounds, abs=0.05)
    assert result["accept_length"] == pytest.approx(8.0, abs=0.05)


def test_sglangs_frontend_language_runs_through_the_gateway_as_against_the_engine(
        sim_and_gateway: tuple[str, str]) -> None:
    """`sglang.RuntimeEndpoint` reads SGLang's deprecated /get_model_info when it starts: the gateway relays it."""
    sim, gw = sim_and_gateway
    done = subprocess.run([str(SGLANG_PYTHON), str(FRONTEND), sim, gw], capture_output=True, text=True, timeout=300,
                          check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    direct, through = (json.loads(line) for line in done.stdout.splitlines())
    assert direct == through and direct["model"] == MODEL and direct["text"]


def test_the_openai_sdk_reads_the_simulator_and_the_gateway_alike(sim_and_gateway: tuple[str, str]) -> None:
    """Streamed chat with usage, with and without spec details, a whole chat and a completion, through the SDK's own
    parsing."""
    for url in sim_and_gateway:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=40, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"return_spec_tokens_details": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        [finish] = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert text and finish in ("stop", "length") and chunks[-1].usage is not None
        [details] = [c.model_extra["sglext"]["spec_tokens_details"] for c in chunks
                     if c.model_extra and "sglext" in c.model_extra]
        assert details["spec_verify_ct"] > 0 and chunks[-1].usage.completion_tokens > details["spec_verify_ct"]
        plain = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=40, temperature=0,
            stream=True, stream_options={"include_usage": True}))
        assert [c.choices[0].delta.content for c in plain if c.choices] == [c.choices[0].delta.content for c in chunks
                                                                           if c.choices]
        assert not any(c.model_extra and "sglext" in c.model_extra for c in plain)  # the gateway's own, cut out
        whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=16, temperature=0)
        assert whole.choices[0].message.content and whole.usage is not None and whole.usage.completion_tokens <= 16
        assert not (whole.model_extra or {}).get("sglext")  # the gateway strips what it asked for itself
        completion = client.completions.create(model=MODEL, prompt="def add(a, b):", temperature=0)
        assert completion.usage is not None and completion.usage.completion_tokens <= 16  # SGLang's default


def test_the_openai_sdk_raises_on_an_error_in_band(tmp_path: Path) -> None:
    """An abort after the stream started reaches the SDK as SGLang sends it: an error event, which the SDK raises."""
    with sim_server("zlab", 0.01, 0, "--abort-fraction", "1") as sim:
        client = openai.OpenAI(base_url=f"{sim}/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                max_tokens=64, stream=True)
        with pytest.raises(openai.APIError, match="Retracted"):
            list(stream)
