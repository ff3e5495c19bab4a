"""verdict.json: what `dfserve compare` decided, about which arms of which runs, and under which gate.

It is written into a directory of its own (never into the runs it judges) and is what `dfserve promote` reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dfserve.loadtest.config import RunConfig, read_model
from dfserve.loadtest.judge import Gate, Judgement
from dfserve.loadtest.sequential import SequentialReport
from dfserve.runs import Provenance
from dfserve.sglang import parse_server_info

FILENAME = "verdict.json"


class ArmRef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str
    run_dir: str
    arm: str
    url: str
    target: str = Field(description="target model, from /server_info model_path (else the served model name)")
    drafter: str = Field(description="draft model path from /server_info, 'none' without speculation")
    simulated: bool


def arm_ref(config: RunConfig, run_dir: Path, arm: str) -> ArmRef:
    info = config.arm(arm)
    server = parse_server_info(info.server_info) if info.server_info is not None else None
    return ArmRef(
        run_id=config.run_id,
        run_dir=str(run_dir.resolve()),
        arm=arm,
        url=info.url,
        target=(server.model_path if server and server.model_path else info.model),
        drafter=(server.draft_model_path if server and server.draft_model_path else "none"),
        simulated=info.simulated,
    )


class Verdict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    kind: Literal["verdict"] = "verdict"
    verdict: Literal["PASS", "FAIL", "INCONCLUSIVE"]
    baseline: ArmRef
    candidate: ArmRef
    forced: bool = Field(description="compared although the runs differ in what shapes the numbers")
    mismatches: list[str]
    judgement: Judgement
    gate: Gate
    provenance: Provenance
    sequential: SequentialReport | None = Field(None, description="set when the run stopped as soon as its gate was "
                                                "decided: the method, its parameters and where the run stopped")


def read_verdict(path: Path) -> Verdict:
    """A verdict directory or its verdict.json."""
    file = path / FILENAME if path.is_dir() else path
    return read_model(file, Verdict, f"VERDICT: {file} does not exist")
