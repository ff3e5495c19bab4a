"""The verdict file: what was decided, about which sides of which runs, under which gate, and on what data.

It is written into a folder of its own (never into the runs it judges). An online verdict (`verdict.json`, from a
load test) is what `dfserve promote` reads; an offline one (`eval-verdict.json`) screens drafters and promotes
nothing. `forced` says the data was judged although it should not have been trusted as it is: the runs differ in
what shapes their numbers (`mismatches`), or a run is incomplete (`incomplete`); such a verdict never promotes
unless told.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dfserve.runs import Provenance, create_run_dir, read_model, write_model
from dfserve.verdict.design import SequentialReport
from dfserve.verdict.gate import Gate
from dfserve.verdict.results import Judgement, Status

Source = Literal["loadtest", "eval"]
FILENAMES: dict[Source, str] = {"loadtest": "verdict.json", "eval": "eval-verdict.json"}
EXIT: dict[Status, int] = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}
"""Exit code of every command that judges (2 is left to usage errors)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Side(_Model):
    run_id: str
    run_dir: str
    name: str = Field(description="the arm of a load test, the drafter label of an evaluation")
    target: str = Field(description="target model: /server_info model_path (else the served model name), or the "
                        "evaluation's target")
    drafter: str = Field(description="the drafter's identity: draft model path from /server_info ('none' without "
                         "speculation), or the name the baseline registry knows an evaluated drafter by")
    url: str | None = None
    simulated: bool = False


class Verdict(_Model):
    schema_version: Literal[2] = 2
    kind: Literal["verdict"] = "verdict"
    source: Source
    verdict: Status
    baseline: Side
    candidate: Side
    forced: bool = Field(description="judged although the runs differ in what shapes the numbers, or a run is "
                         "incomplete (--force)")
    mismatches: list[str] = Field(default_factory=list)
    incomplete: list[str] = Field(default_factory=list, description="why a run's data is not whole: interrupted, "
                                  "killed, records missing")
    features: str | None = Field(None, description="offline: the feature cache both sides were scored on")
    judgement: Judgement
    gate: Gate
    provenance: Provenance
    sequential: SequentialReport | None = Field(None, description="set when the run stopped as soon as its gate was "
                                                "decided: the method, its parameters and where the run stopped")


def write_verdict(verdict: Verdict, out: Path) -> Path:
    """A new folder under `out` holding the verdict; returns the file."""
    name = FILENAMES[verdict.source]
    folder = create_run_dir(out, prefix=name.removesuffix(".json"))
    write_model(folder / name, verdict)
    return folder / name


def verdict_file(path: Path) -> Path:
    """A verdict folder's file, or the file itself."""
    if not path.is_dir():
        return path
    return next((path / name for name in FILENAMES.values() if (path / name).exists()), path / FILENAMES["loadtest"])


def read_verdict(path: Path) -> Verdict:
    """A verdict folder or its file."""
    file = verdict_file(path)
    return read_model(file, Verdict, f"{file} does not exist")
