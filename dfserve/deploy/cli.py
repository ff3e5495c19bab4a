"""`dfserve deploy`: put a drafter behind SGLang (or the simulator, or Kubernetes objects), and `status`/`stop` it.

    dfserve deploy --drafter zlab --dry-run --check
    dfserve deploy --drafter /ckpt/step-4000/checkpoint.pt --port 30001
    dfserve deploy --drafter zlab --emit k8s --out k8s-zlab/
    dfserve deploy manifests
    dfserve deploy status pro6000-zlab
    dfserve deploy stop pro6000-zlab
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Collection
from pathlib import Path

import click
from click.core import ParameterSource

from dfserve.deploy import k8s
from dfserve.deploy.deployment import DeploymentSpec
from dfserve.deploy.drafters import Drafter, resolve_drafter, resolve_target
from dfserve.deploy.engines import EngineKind, engine_kind, engine_names
from dfserve.deploy.profiles import load_profile
from dfserve.deploy.spec import build_spec, check_name
from dfserve.deploy.supervise import running, start, status, stop
from dfserve.errors import FieldError, UserError, command_flags, flags_for
from dfserve.flags import FINITE, FiniteFloat
from dfserve.listen import ensure_free
from dfserve.runs import link_input

DEFAULT_ROOT = "deployments"
MAX_HEALTH_TIMEOUT_S = 86400.0
"""A day: far past any engine's start, and a startup probe's failure count stays a small integer (an int32 there)."""
EMIT_ONLY = ("out", "image", "namespace", "model_cache", "node_selector")
"""Options only `--emit k8s` reads."""
SIM_ONLY = ("sim_profile", "time_scale", "seed")
"""Options only a simulated engine reads."""


def _root_option(f):
    return click.option(
        "--root", type=click.Path(path_type=Path), envvar="DFSERVE_DEPLOY_ROOT", default=DEFAULT_ROOT, show_default=True,
        help="Folder holding deployments and converted drafters.",
    )(f)


def _print_command(spec: DeploymentSpec, kind: EngineKind, python: str) -> None:
    env = kind.env(spec)
    prefix = ["env", *(f"{key}={value}" for key, value in sorted(env.items()))] if env else []
    argv = kind.argv(spec, python)
    click.echo(f"# {spec.name}: engine {spec.engine}, drafter {spec.drafter.label}, target {spec.target}", err=True)
    if spec.port == 0:
        click.echo("# --port 0: a start picks a free port and puts it in place of 0", err=True)
    click.echo(shlex.join([*prefix, *argv]))


@click.group(invoke_without_command=True, context_settings={"show_default": True})
@click.option("--drafter", help="zlab, a checkpoint (.pt/.safetensors), a Hugging Face DFlash folder, baseline, or "
              "sim:PROFILE (a drafter that exists only as a simulator profile; --engine sim).")
@click.option("--engine", type=click.Choice(engine_names()), default="sglang")
@click.option("--profile", "profile_name", default="pro6000", help="Host profile name or YAML file.")
@click.option("--target", help="Target model id or local folder (default: the profile's).")
@click.option("--target-config", type=click.Path(path_type=Path), help="The target's config.json, if not beside it.")
@click.option("--drafter-config", type=click.Path(path_type=Path), help="config.json for a converted checkpoint (default: z-lab's architecture).")
@click.option("--registry", type=click.Path(path_type=Path, file_okay=False), default=Path("runs"),
              help="Baseline registry folder, for --drafter baseline.")
@click.option("--name", help="Deployment name (default: PROFILE-DRAFTER).")
@click.option("--host", default="127.0.0.1")
@click.option("--port", type=int, default=30000, help="Listen port; 0 takes a free one (the record and `deploy status` say which).")
@_root_option
@click.option("--tp-size", type=int, help="Overrides the profile's value.")
@click.option("--mem-fraction-static", type=FINITE, help="Overrides the profile's value.")
@click.option("--context-length", type=int, help="Overrides the profile's value.")
@click.option("--max-running-requests", type=int, help="Overrides the profile's value.")
@click.option("--attention-backend", help="Target attention backend; overrides the profile's.")
@click.option("--draft-attention-backend", help="flashinfer, fa3, fa4 or triton; overrides the profile's.")
@click.option("--served-model-name", help="Template; {drafter} becomes the drafter's label.")
@click.option("--sglang-arg", "sglang_args", multiple=True, help="Extra argument for SGLang, repeatable: --sglang-arg=--log-level=debug")
@click.option("--sglang-python", envvar="DFSERVE_SGLANG_PYTHON", default=sys.executable, help="Interpreter SGLang is installed in.")
@click.option("--sim-profile", help="Simulator acceptance profile (default: zlab or inhouse by drafter).")
@click.option("--time-scale", type=FINITE, default=1.0, help="Simulator time scale.")
@click.option("--seed", type=int, default=0, help="Simulator seed.")
@click.option("--dry-run", is_flag=True, help="Print the exact command and environment, start nothing (a checkpoint "
              "is still converted: the command reads its folder).")
@click.option("--check", is_flag=True, help="Validate the argv with the engine's own parser (SGLang: and its DFLASH "
              "rules); starts nothing.")
@click.option("--emit", type=click.Choice(["k8s"]), help="Write Kubernetes objects instead of starting an engine.")
@click.option("--out", type=click.Path(path_type=Path), help="Folder for --emit output (default: stdout).")
@click.option("--image", default=k8s.DEFAULT_IMAGE, help="Container image for --emit k8s.")
@click.option("--namespace", help="Namespace for --emit k8s.")
@click.option("--model-cache", type=click.Path(path_type=Path, file_okay=False),
              help="--emit k8s: the local folder whose contents the model-cache volume (/models in the pod) holds; "
                   "local model folders must lie under it. [default: --root]")
@click.option("--node-selector", "node_selector", multiple=True, metavar="KEY=VALUE",
              help="--emit k8s: a node label the engine pod requires, repeatable.")
@click.option("--health-timeout", type=FINITE, default=1800.0,
              help="Seconds the engine may take to answer /health_generate (--emit k8s: the startup probe's allowance).")
@click.pass_context
def deploy(ctx: click.Context, **opts: object) -> None:
    """Put a drafter behind SGLang for the profile's target, verified first; or print, check or emit it."""
    if ctx.invoked_subcommand is not None:
        return
    if not opts["drafter"]:
        raise UserError("--drafter: required (zlab, a checkpoint, a model folder, or baseline)")
    given = {name for name in opts if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT}
    with flags_for(command_flags(ctx.command)):
        run_deploy(given=given, **opts)  # type: ignore[arg-type]


def run_deploy(
    *, drafter: str, engine: str, profile_name: str, target: str | None, target_config: Path | None,
    drafter_config: Path | None, registry: Path, name: str | None, host: str, port: int, root: Path, sglang_args: tuple[str, ...],
    sglang_python: str, sim_profile: str | None, time_scale: float, seed: int, dry_run: bool, check: bool,
    emit: str | None, out: Path | None, image: str, namespace: str | None, model_cache: Path | None,
    node_selector: tuple[str, ...], health_timeout: float, given: Collection[str] = (), **overrides: object,
) -> None:
    """`given`: the options the user set (not left at their defaults), each refused where it has no effect."""
    if not 0 < health_timeout <= MAX_HEALTH_TIMEOUT_S:
        raise FieldError("health_timeout", f"must be a finite number of seconds > 0, at most {MAX_HEALTH_TIMEOUT_S:.0f}")
    _refuse_unused(given, emit=emit, simulated=engine_kind(engine).simulated, baseline=drafter == "baseline")
    profile = load_profile(profile_name)
    resolved_target = resolve_target(target, profile, target_config)
    starts_engine = not (dry_run or check) and emit is None
    if starts_engine:
        ensure_free(host, port)
    resolved = resolve_drafter(drafter, profile, resolved_target, root / "drafters", drafter_config, registry)
    if "drafter_config" in given and resolved.kind != "checkpoint":
        raise FieldError("drafter_config", f"only with a checkpoint {{other}} (the config it is converted with), "
                         f"not {drafter}", other="drafter")
    if resolved.kind == "checkpoint":
        done = "converted" if resolved.converted else "already converted"
        click.echo(f"# {resolved.source}: {done} to {resolved.model_path} (sha256 {resolved.sha256})", err=True)
    spec = build_spec(
        profile, resolved_target, resolved, engine=engine, port=port, host=host, name=name,
        overrides=dict(overrides), sglang_args=list(sglang_args), sim_profile=sim_profile, time_scale=time_scale,
        seed=seed,
    )
    kind = engine_kind(spec.engine)
    if check:
        click.echo(f"# check: {kind.check(spec, sglang_python)}", err=True)
    if emit == "k8s":
        pod = k8s.Pod(model_cache=model_cache or root, image=image, namespace=namespace,
                      node_selector=_node_selector(node_selector), startup_s=health_timeout)
        objects = k8s.render(spec, pod)
        for local, in_pod in k8s.staged_folders(spec, pod).items():
            click.echo(f"# the pod reads {in_pod}: copy {local} to that place on the {k8s.MODEL_CACHE_CLAIM} volume", err=True)
        for path in k8s.write(objects, out):
            click.echo(str(path))
        return
    if dry_run:
        _print_command(spec, kind, sglang_python)
    if starts_engine:
        _start(spec, resolved, sglang_python, root / spec.name, health_timeout)


def _refuse_unused(given: Collection[str], *, emit: str | None, simulated: bool, baseline: bool) -> None:
    """An option the chosen output, engine or drafter never reads is a mistake to say, not a value to drop."""
    for name in EMIT_ONLY:
        if name in given and emit is None:
            raise FieldError(name, "only with {other} k8s", other="emit")
    for name in SIM_ONLY:
        if name in given and not simulated:
            raise FieldError(name, "only with a simulated engine ({other} sim)", other="engine")
    if "registry" in given and not baseline:
        raise FieldError("registry", "only with {other} baseline", other="drafter")
    if "host" in given and emit is not None:
        raise FieldError("host", "not with {other} k8s: the pod listens on all its addresses", other="emit")


def _node_selector(pairs: tuple[str, ...]) -> dict[str, str]:
    selector: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise FieldError("node_selector", f"{pair!r} is not KEY=VALUE")
        if key in selector:
            raise FieldError("node_selector", f"{key!r} given twice ({selector[key]!r} and {value!r})")
        selector[key] = value
    return selector


def _start(spec: DeploymentSpec, drafter: Drafter, python: str, deployment_dir: Path, health_timeout: float) -> None:
    if running(deployment_dir) is not None:
        raise FieldError("name", f"deployment {spec.name} is running; `dfserve deploy stop {spec.name}` first")
    created = not deployment_dir.exists()
    deployment_dir.mkdir(parents=True, exist_ok=True)
    try:
        if drafter.kind == "checkpoint" and drafter.source:  # a deployment keeps the bytes it was started with
            checkpoint = Path(drafter.source)
            link_input(checkpoint, deployment_dir / f"checkpoint{checkpoint.suffix}", "root")
    except UserError:
        if created:
            deployment_dir.rmdir()
        raise
    record = start(spec, python, deployment_dir, health_timeout_s=health_timeout)
    click.echo(
        f"{spec.name}: healthy at {record.spec.base_url} after {record.startup_s:.1f} s "
        f"(pid {record.pid}, served as {spec.served_model_name}"
        f"{', simulated' if record.simulated else ''}); record in {deployment_dir}"
    )


@deploy.command("manifests")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=Path("k8s/overlays"), show_default=True,
              help="The overlays folder; writes zlab/ and inhouse/ deployment.yaml and service.yaml in it.")
def manifests_command(out: Path) -> None:
    """Regenerate the engine objects of the kustomize overlays from the pro6000 profile (deploy/k8s.py fleet)."""
    for path in k8s.write_fleet(out):
        click.echo(str(path))


@deploy.command("status")
@click.argument("name")
@_root_option
def status_command(name: str, root: Path) -> None:
    """Show a deployment's last start and whether its engine answers."""
    record, state = status(root / check_name(name))
    click.echo(f"{name}: {state}")
    click.echo(f"  engine: {record.spec.engine}{' (simulated)' if record.simulated else ''}, version {record.engine_version}")
    click.echo(f"  url: {record.spec.base_url}  pid: {record.pid}")
    click.echo(f"  drafter: {record.spec.drafter.label} ({record.spec.drafter.model_path}), {record.spec.drafter.identity}")
    click.echo(f"  served model name: {record.spec.served_model_name}")
    click.echo(f"  started: {record.started_at}, healthy after {record.startup_s:.1f} s")
    if state == "exited":
        raise UserError(f"deployment {name}: its engine (pid {record.pid}) is gone; see {record.log}")


@deploy.command("stop")
@click.argument("name")
@_root_option
@click.option("--grace", type=FiniteFloat(min=0), default=30.0, show_default=True, help="Seconds between SIGTERM and SIGKILL.")
def stop_command(name: str, root: Path, grace: float) -> None:
    """Stop a deployment's engine: gracefully, then forced after --grace seconds."""
    result, now = stop(root / check_name(name), grace_s=grace)
    how = "forced" if result.forced else "graceful" if result.was_running else "had already exited"
    click.echo(f"{name}: {'stopped' if now else 'already stopped'} ({how}) at {result.stopped_at}")
