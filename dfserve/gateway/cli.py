"""`dfserve gateway`: parse the flags, build the config, and serve it (`gateway.entrypoint.serve`) on uvloop."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from dfserve.errors import UserError, command_flags, describe_invalid, flags_for
from dfserve.flags import FINITE
from dfserve.gateway.config import ArmConfig, GatewayConfig, load_config


def parse_arm_flag(text: str) -> tuple[str, ArmConfig]:
    """`--arm NAME=WEIGHT@URL[,URL...]`, e.g. `baseline=90@http://127.0.0.1:30000`."""
    name, sep, rest = text.partition("=")
    weight, sep2, urls = rest.partition("@")
    if not sep or not sep2 or not name or not urls.strip(","):
        raise UserError(f"--arm {text!r}: expected NAME=WEIGHT@URL[,URL...]")
    try:
        return name, ArmConfig(weight=float(weight), replicas=tuple(u for u in urls.split(",") if u))
    except (ValueError, ValidationError) as exc:
        detail = describe_invalid(exc, "--arm") if isinstance(exc, ValidationError) else f"--arm {text!r}: {exc}"
        raise UserError(detail) from None



@click.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Gateway YAML (arms, mode, limits, health, scrape, admin); flags override it.")
@click.option("--host", help="Listen address [127.0.0.1].")
@click.option("--port", type=int, help="Listen port [8080]; 0 takes a free one (the log line says which).")
@click.option("--arm", "arms", multiple=True, metavar="NAME=WEIGHT@URL[,URL...]",
              help="An arm and its replicas; repeat per arm. Replaces the config file's arms.")
@click.option("--mode", type=click.Choice(["split", "sticky", "shadow"]), help="Routing mode [split].")
@click.option("--primary", help="shadow mode: the arm whose answers clients get.")
@click.option("--shed/--no-shed", default=None, help="Send a down arm's share to the others instead of 503.")
@click.option("--admin-host", help="Admin listener address [127.0.0.1].")
@click.option("--admin-port", type=int, help="Admin listener port (0: a free one); the token comes from $DFSERVE_ADMIN_TOKEN.")
@click.option("--seed", type=int, help="Seed of the weighted split.")
@click.option("--health-interval", type=FINITE, help="Seconds between active health checks [2].")
@click.option("--scrape-interval", type=FINITE, help="Seconds between replica /metrics scrapes [15].")
@click.option("--capture", "capture_dir", type=click.Path(path_type=Path, file_okay=False),
              help="Capture clients' requests into this new folder, for replay (the config's capture: block).")
@click.option("--record", "record_dir", type=click.Path(path_type=Path, file_okay=False),
              help="shadow mode: write each mirrored request's answers from every arm into record folders here, "
              "for dfserve compare (the config's shadow: block).")
@click.option("--secondary", help="shadow mode with --record: the arm running the baseline's drafter (noise floor).")
@click.option("--until-decided", is_flag=True, default=False,
              help="shadow mode with --record: decide the gate on the mirrored pairs as they are recorded "
              "(sequential design) and stop mirroring once the verdict is decided (the shadow: block's until_decided).")
@click.option("--gate", type=click.Path(path_type=Path, dir_okay=False),
              help="with --until-decided: the gate's YAML file (default: the shadow gate).")
@click.option("--look-every", type=int, help="with --until-decided: mirrored pairs between looks [16].")
@click.option("--watch-interval", type=FINITE,
              help="Check --config this often and apply its routing when it changes; the admin API turns read-only.")
def gateway(config_path: Path | None, arms: tuple[str, ...], **flags: Any) -> None:
    """Split, stick or mirror OpenAI/SGLang traffic between drafter arms and measure each arm."""
    keys = {"host": "host", "port": "port", "mode": "routing.mode", "primary": "routing.primary",
            "shed": "routing.shed", "admin_host": "admin.host", "admin_port": "admin.port", "seed": "seed",
            "health_interval": "health.interval_s", "scrape_interval": "scrape.interval_s",
            "watch_interval": "watch_interval_s", "capture_dir": "capture.dir", "record_dir": "shadow.dir",
            "secondary": "shadow.secondary"}
    deciding = {field: value for field, value in (("shadow.until_decided", flags.pop("until_decided") or None),
                                                  ("shadow.gate", flags.pop("gate")),
                                                  ("shadow.look_every", flags.pop("look_every")))
                if value is not None}
    overrides = {keys[name]: value for name, value in flags.items() if value is not None}
    if not arms and config_path is None:
        raise UserError("give the arms: --arm NAME=WEIGHT@URL for each, or --config FILE")
    if arms:
        parsed = [parse_arm_flag(text) for text in arms]
        names = [name for name, _ in parsed]
        if len(set(names)) != len(names):
            raise UserError(f"--arm: each arm needs its own name (given: {', '.join(names)})")
        overrides["routing.arms"] = dict(parsed)
    named = {keys[name]: flag for name, flag in command_flags(gateway).items() if name in keys} | {
        "routing.arms": "--arm"}
    config = load_config(config_path, overrides, named)
    if deciding:
        _check_deciding(config, deciding)
        overrides |= deciding
        config = load_config(config_path, overrides, named | DECIDING_FLAGS)
    config.admin_token()
    if config.watch_interval_s is not None and config_path is None:
        raise UserError("--watch-interval: there is no file to watch; give --config")
    import uvloop

    from dfserve.gateway.entrypoint import serve

    logging.basicConfig(format="dfserve gateway: %(levelname)s %(message)s")
    with flags_for({field: flag for field, flag in DECIDING_FLAGS.items() if field in deciding}):
        uvloop.run(serve(config, (lambda: load_config(config_path, overrides)) if config_path else None, config_path))


DECIDING_FLAGS = {"shadow.until_decided": "--until-decided", "shadow.gate": "--gate", "shadow.look_every": "--look-every"}


def _check_deciding(config: GatewayConfig, deciding: dict[str, Any]) -> None:
    """`--until-decided` decides on recorded mirrored pairs; `--gate` and `--look-every` are its parameters."""
    if "shadow.until_decided" not in deciding and not (config.shadow is not None and config.shadow.until_decided):
        raise UserError("--gate, --look-every: only with --until-decided")
    if config.routing.mode != "shadow":
        raise UserError("--until-decided: the gate is decided on mirrored requests; give --mode shadow")
    if config.shadow is None:
        raise UserError("--until-decided: the gate is decided on the recorded pairs; give --record DIR")
