"""`dfserve dashboards`: write the Grafana dashboards, Prometheus rules and their Kubernetes objects."""

from __future__ import annotations

from pathlib import Path

import click

from dfserve.errors import UserError
from dfserve.flags import FiniteFloat
from dfserve.metrics import ARM_NAME, ARM_NAME_RULE

from .engine import NAME_STYLES
from .render import Settings, render, write
from .rules import RuleSettings

DEFAULT_OUT = Path("dashboards/generated")


@click.command("dashboards")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_OUT, show_default=True,
              help="Folder to write grafana/, prometheus/ and k8s/ into.")
@click.option("--sglang-names", type=click.Choice(NAME_STYLES), default="colon", show_default=True,
              help="How the Prometheus queried stores SGLang's metric names: as emitted (sglang:...) or rewritten "
                   "to sglang_...")
@click.option("--baseline-arm", default="baseline", show_default=True, help="Arm the ratios and alerts treat as baseline.")
@click.option("--candidate-arm", default="candidate", show_default=True, help="Arm compared against the baseline.")
@click.option("--accept-tolerance", type=FiniteFloat(0, 1, min_open=True), default=0.95, show_default=True,
              help="Alert when the candidate's acceptance length is below this share of the baseline's.")
@click.option("--error-ratio", type=FiniteFloat(0, 1, min_open=True), default=0.05, show_default=True,
              help="Error ratio over 5 minutes above which a jump alerts.")
@click.option("--ttft-p99-seconds", type=FiniteFloat(0, min_open=True), default=2.0, show_default=True,
              help="Alert when an arm's TTFT p99 over 5 minutes exceeds this.")
def dashboards(out: Path, sglang_names: str, baseline_arm: str, candidate_arm: str, accept_tolerance: float,
               error_ratio: float, ttft_p99_seconds: float) -> None:
    """Write the "dfserve A/B", "dfserve engine" and "dfserve training" dashboards, the alert rules, and their k8s
    objects."""
    for flag, arm in (("--baseline-arm", baseline_arm), ("--candidate-arm", candidate_arm)):
        if not ARM_NAME.fullmatch(arm):
            raise UserError(f"{flag}: {arm!r} is not an arm name ({ARM_NAME_RULE}, as the gateway takes them)")
    if baseline_arm == candidate_arm:
        raise UserError(f"--candidate-arm: must differ from --baseline-arm ({baseline_arm!r})")
    settings = Settings(
        rules=RuleSettings(baseline_arm=baseline_arm, candidate_arm=candidate_arm, accept_tolerance=accept_tolerance,
                           error_ratio=error_ratio, ttft_p99_s=ttft_p99_seconds),
        sglang_names="underscore" if sglang_names == "underscore" else "colon",
    )
    for path in write(out, render(settings)):
        click.echo(path)
