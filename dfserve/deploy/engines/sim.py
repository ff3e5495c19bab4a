"""dfserve's simulator as an engine kind: `python -m dfserve sim` serving the spec's target, drafter, name and limits,
checked by the simulator's own command-line parser; it runs on this machine only, so it has no Kubernetes form."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from dfserve.deploy.engines.base import Container, EngineKind
from dfserve.deploy.sim.cli import build_config, sim
from dfserve.deploy.sim.profiles import load_profile
from dfserve.errors import FieldError, UserError, command_flags, flags_for

if TYPE_CHECKING:
    from dfserve.deploy.deployment import DeploymentSpec


def sim_argv(spec: DeploymentSpec, python: str = sys.executable) -> list[str]:
    """The simulated engine serving the same target, drafter, name and limits as the SGLang form."""
    return [python, "-m", "dfserve", "sim", *sim_args(spec)]


def sim_args(spec: DeploymentSpec) -> list[str]:
    """What follows `dfserve sim`."""
    return [
        "--host", spec.host, "--port", str(spec.port),
        "--profile", spec.sim.profile,
        "--time-scale", str(spec.sim.time_scale),
        "--seed", str(spec.sim.seed),
        "--served-model-name", spec.served_model_name,
        "--model-path", spec.target,
        "--draft-model-path", spec.drafter.model_path,
        "--max-running-requests", str(spec.sglang.max_running_requests),
        "--context-length", str(spec.sglang.context_length),
        "--block-size", str(spec.drafter.block_size),
    ]


def _read_profile(spec: DeploymentSpec) -> None:
    try:
        load_profile(spec.sim.profile)
    except FieldError as exc:
        raise FieldError("sim_profile", exc.message) from None


@EngineKind.register("sim")
class Simulator(EngineKind):
    simulated = True

    def argv(self, spec: DeploymentSpec, python: str) -> list[str]:
        """The simulator runs under dfserve's own interpreter, whatever SGLang's is; its profile is read first, so
        that a bad one is refused before a dry run prints it or a start spawns it (whose error named its own
        `--profile`, the deploy's host profile)."""
        _read_profile(spec)
        return sim_argv(spec)

    def check(self, spec: DeploymentSpec, python: str) -> str:
        _read_profile(spec)
        try:
            with flags_for(command_flags(sim)):
                build_config(**sim.make_context("sim", sim_args(spec)).params)
        except (click.UsageError, UserError) as exc:
            raise FieldError("check", f"the simulator rejects the argv: {exc}") from None
        return f"the simulator accepts it: profile {spec.sim.profile}, block {spec.drafter.block_size}"

    def container(self, spec: DeploymentSpec, host: str) -> Container:
        raise FieldError("engine", "sim runs on this machine only and has no Kubernetes form; emit the sglang engine")
