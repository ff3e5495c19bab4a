"""Synthetic load-test records and run configs with known answers, for the tests of statistics, the judge and the
report: paired by index, task difficulty shared across arms, round noise each arm's own."""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dfserve.deploy.hashes import file_sha256
from dfserve.loadtest.config import ArmInfo, RunConfig, Sampling, TaskSetInfo
from dfserve.loadtest.records import RequestRecord
from dfserve.loadtest.report import summarize
from dfserve.loadtest.schedule import LoadShape
from dfserve.runs import JsonlAppender, Provenance, create_run_dir, write_model

PASSING = 400
"""Requests per arm for the default gates to PASS an arm like its baseline: without an error on either side the
error rule's interval is about ±3.8 / n (Newcombe's), inside its 1 point from here on."""


def synthetic(arm: str, n: int, tau: float, *, seed: int, tasks: int = 40, tokens: int = 256, tpot: float = 0.01,
              lossy: float = 0.0, errors: float = 0.0, noise: float = 0.15) -> list[RequestRecord]:
    """Paired-by-index records: task difficulty is shared across arms (seeded by index), round noise is the arm's."""
    shared = np.random.default_rng(1000)
    difficulty = shared.uniform(0.8, 1.2, size=tasks)
    own = np.random.default_rng(seed)
    records = []
    for index in range(n):
        task = index % tasks
        if own.random() < errors:
            records.append(RequestRecord(arm=arm, index=index, task_id=f"T{task}", dispatched_s=0.0, sent_s=0.0,
                                         end_s=0.1, error_kind="http_status", http_status=503, error_message="busy"))
            continue
        rate = tau * difficulty[task] * math.exp(own.normal(0, noise))
        verify = min(tokens - 1, max(1, round(tokens / rate)))
        step = tpot * math.exp(own.normal(0, 0.1))
        # the prefill token, then one chunk per verify round, as SGLang streams them: rounds split the rest evenly
        rounds = [(tokens - 1) * (k + 1) // verify - (tokens - 1) * k // verify for k in range(verify)]
        chunk_tokens = [1, *rounds]
        times = [0.05 + step * (sum(chunk_tokens[:i + 1]) - 1) for i in range(len(chunk_tokens))]
        text = f"out-{task}" + ("-lossy" if own.random() < lossy else "")
        records.append(RequestRecord(
            arm=arm, index=index, task_id=f"T{task}", dispatched_s=0.0, sent_s=0.0, first_token_s=times[0],
            end_s=times[-1] + 0.001, chunk_times_s=times, chunk_tokens=chunk_tokens, completion_tokens=tokens,
            spec_verify_ct=verify, acceptance="exact", finish_reason="length", output_sha256=text, http_status=200,
        ))
    return records


def twin(records: list[RequestRecord], arm: str) -> list[RequestRecord]:
    """The same answers from another arm, each 3 µs later than the baseline's to come (two servers' answers never
    take the same times, and a candidate whose records time out as the baseline's is refused as a copy)."""
    def later(at: float | None) -> float | None:
        return at + 3e-6 if at is not None else None

    return [r.model_copy(update={"arm": arm, "first_token_s": later(r.first_token_s), "end_s": later(r.end_s),
                                 "chunk_times_s": [t + 3e-6 for t in r.chunk_times_s]})
            for r in records]


def run_config(run_id: str, num_requests: int = 100, max_running: int = 48) -> RunConfig:
    """A run's config with two arms, zlab and inhouse, each its drafter on the same target; started at an instant of
    its own."""
    info = {"model_path": "Qwen/Qwen3.6-27B", "max_running_requests": max_running,
            "speculative_draft_model_path": "z-lab/Qwen3.6-27B-DFlash"}
    inhouse = {**info, "speculative_draft_model_path": "/models/dflash-inhouse"}
    return RunConfig(
        run_id=run_id, api="native",
        arms=(ArmInfo(name="zlab", url="http://127.0.0.1:1", server_info=info, model="m"),
              ArmInfo(name="inhouse", url="http://127.0.0.1:2", server_info=inhouse, model="m")),
        tasks=TaskSetInfo(name="humaneval", sha256="abc", size=164), num_requests=num_requests, warmup=0,
        sampling=Sampling(max_new_tokens=256, temperature=0.0, top_p=1.0), load=LoadShape(kind="closed", concurrency=8),
        duration_s=None, request_timeout_s=60.0, t0_unix_s=1.8e9 + zlib.crc32(run_id.encode()) / 1e3,
        provenance=Provenance.here(),
    )


def write_run(out: Path, config: RunConfig, records: Sequence[RequestRecord], *, interrupted: bool = False,
              summary: bool = True) -> Path:
    """A run folder as `dfserve loadtest run` leaves it: config.json, requests.jsonl and (unless killed)
    summary.json."""
    run_dir = create_run_dir(out, config.run_id)
    write_model(run_dir / "config.json", config)
    with JsonlAppender(run_dir / "requests.jsonl") as appender:
        for r in records:
            appender.append(r)
    if summary:
        write_model(run_dir / "summary.json", summarize(config, records, interrupted, {}).model_copy(
            update={"records_sha256": file_sha256(run_dir / "requests.jsonl"),
                    "config_sha256": file_sha256(run_dir / "config.json")}).sealed())
    return run_dir
