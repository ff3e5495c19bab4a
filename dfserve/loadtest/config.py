"""config.json of a run: everything that shapes its numbers, so the judge can refuse apples-to-oranges comparisons."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dfserve.errors import UserError
from dfserve.loadtest.schedule import LoadShape
from dfserve.runs import Provenance, read_model
from dfserve.sglang import ROUTES, Api, SamplingParams
from dfserve.shard import Shard
from dfserve.verdict.design import SequentialDesign


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Sampling(_Model):
    max_new_tokens: int = Field(ge=1)
    temperature: float = Field(ge=0, allow_inf_nan=False)
    top_p: float = Field(gt=0, le=1)
    min_temperature: float | None = Field(None, ge=0, allow_inf_nan=False, description="a replayed capture's lowest temperature "
                                          "(`temperature` is its highest); None: every request at `temperature`")

    def describe(self) -> str:
        low = self.min_temperature
        temperature = f"{self.temperature:g}" if low is None or low == self.temperature else \
            f"{low:g} to {self.temperature:g}"
        return f"at most {self.max_new_tokens} new tokens, temperature {temperature}, top-p {self.top_p:g}"

    @property
    def mixes_greedy(self) -> bool:
        """Greedy requests among sampled ones: a sequential run awaits greedy pairs before losslessness can pass."""
        return self.temperature > 0 and self.min_temperature == 0

    def params(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p)


class TaskSetInfo(_Model):
    name: str
    sha256: str
    size: int
    incomplete: str | None = Field(None, description="why the tasks are not the whole of their source (a capture "
                                   "that lost requests, replayed by force); a verdict on the run says so")


def shared_servers(arms: Sequence[tuple[str, str]]) -> list[list[str]]:
    """The names of arms (name, URL) that reach one server (scheme, host and port), where any do."""
    by_server: dict[tuple[str, str, int | None], list[str]] = {}
    for name, url in arms:
        parts = urlsplit(url)
        by_server.setdefault((parts.scheme, parts.hostname or "", parts.port), []).append(name)
    return [names for names in by_server.values() if len(names) > 1]


MAX_REQUESTS = 10_000_000
"""Of a run's measured requests, and of its warm-up: its schedule is built whole, in memory, before the first is
sent, and a verdict builds it again to check the records against it."""


class ArmInfo(_Model):
    """One arm as found at the start of the run; `server_info`/`model_info` are SGLang's documents, verbatim."""

    name: str
    url: str
    server_info: dict[str, Any] | None = None
    model_info: dict[str, Any] | None = None
    model: str = Field(description="model name sent in OpenAI bodies")
    simulated: bool = False
    arrival_stamps: Literal["kernel", "loop"] = Field("loop", description="what dated each read of a response: "
                                                      "the kernel's receive time (plain http on Linux), or the "
                                                      "tester's loop when it read it (https; runs before this field)")


class RunConfig(_Model):
    schema_version: Literal[1] = 1
    kind: Literal["loadtest-run"] = "loadtest-run"
    run_id: str
    api: Api | Literal["mixed"] = Field(description="the route every request was sent on, or mixed (a replayed "
                                       "capture's requests each on its own: `routes`)")
    routes: dict[Api, int] = Field(description="requests of the schedule (warm-up included) on each route")
    arms: tuple[ArmInfo, ...]
    tasks: TaskSetInfo
    num_requests: int = Field(ge=1, le=MAX_REQUESTS, description="measured requests per arm, warm-up not included")
    warmup: int = Field(ge=0, le=MAX_REQUESTS)
    sampling: Sampling
    load: LoadShape
    duration_s: float | None
    request_timeout_s: float
    pin_arms: bool = Field(default=False, description="requests carried x-dfserve-arm: NAME (arms behind one gateway)")
    sequential: SequentialDesign | None = Field(None, description="set when the run stopped as soon as its gate "
                                                "was decided; num_requests is then the maximum")
    shard: Shard | None = Field(default=None, description="the part of the schedule this run sent "
                                "(`dfserve loadtest run --shard`); None for a whole run")
    merged_from: tuple[str, ...] = Field(default=(), description="run ids of the shards `dfserve loadtest merge` "
                                         "built this run from")
    header_names: tuple[str, ...] = Field(default=(), description="headers sent with every request "
                                          "(`--header`, `--api-key`); their values are not kept")
    t0_unix_s: float = Field(description="wall clock at the run's time zero; record times are offsets from it")
    provenance: Provenance

    @model_validator(mode="before")
    @classmethod
    def _routes_of_older_runs(cls, data: Any) -> Any:
        """A run written before `routes` was recorded sent every request on its `api`."""
        if isinstance(data, dict) and "routes" not in data and data.get("api") in ("native", "chat"):
            return {**data, "routes": {data["api"]: data.get("warmup", 0) + data.get("num_requests", 0)}}
        return data

    @field_validator("arms")
    @classmethod
    def _arms_named_once(cls, arms: tuple[ArmInfo, ...]) -> tuple[ArmInfo, ...]:
        """Records name their arm: two arms of one name could not be told apart."""
        names = [arm.name for arm in arms]
        if twice := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"arm {twice[0]!r} named more than once")
        return arms

    def describe_routes(self) -> str:
        """Where the schedule's requests went: one route, or each route with its count."""
        if len(self.routes) == 1:
            return f"on {ROUTES[next(iter(self.routes))]}"
        return "on " + ", ".join(f"{ROUTES[route]} ({count})" for route, count in self.routes.items())

    def shape(self) -> dict[str, Any]:
        """The fields two runs must share to be compared."""
        return {
            "api": self.api,
            "routes": dict(sorted(self.routes.items())),
            "tasks": self.tasks.sha256,
            "num_requests": self.num_requests,
            "sampling": self.sampling.model_dump(),
            "load": self.load.model_dump(),
            "duration_s": self.duration_s,
            "sequential": self.sequential.model_dump() if self.sequential else None,
        }

    def arm(self, name: str) -> ArmInfo:
        for arm in self.arms:
            if arm.name == name:
                return arm
        raise UserError(f"run {self.run_id}: no arm named {name!r} (arms: {', '.join(a.name for a in self.arms)})")


def read_config(run_dir: Path) -> RunConfig:
    return read_model(run_dir / "config.json", RunConfig, f"{run_dir}: not a run directory (no config.json)")
