"""`dfserve compare FOLDER` on a shadow record folder: judged, printed with its noise floor, exit as any verdict."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

import click

from dfserve.errors import FieldError, Untrusted, UserError, flags_for
from dfserve.shadow.verdict import compare_shadow
from dfserve.terminal import Output
from dfserve.verdict.printer import metrics_table, print_verdict
from dfserve.verdict.report import REPORT
from dfserve.verdict.verdict import EXIT


def compare_shadow_folder(run: Path, baseline: str | None, candidate: str | None, gate: Path | None, force: bool,
                          out: Path | None, flags: Mapping[str, str]) -> NoReturn:
    """A shadow record folder: its primary is the baseline; the noise floor printed beside the verdict."""
    try:
        with flags_for(flags):
            if baseline is not None:
                raise FieldError("baseline", "a shadow folder's baseline is its primary arm; name only {other}",
                                 other="candidate")
            judged = compare_shadow(run, candidate, gate, force, out)
    except Untrusted as exc:
        raise UserError(f"{exc}; --force judges anyway, stamped in the verdict") from None
    console = Output()
    print_verdict(console, judged.verdict)
    if judged.noise_floor is not None:
        floor = judged.noise_floor.judgement
        console.print(metrics_table(floor, f"noise floor: {floor.baseline} vs {floor.candidate} (same drafter)"))
        click.echo(f"noise floor {floor.baseline} vs {floor.candidate}: {floor.verdict} under the same gate")
    for note in judged.notes:
        click.echo(note)
    click.echo(f"verdict: {judged.path}")
    click.echo(f"report:  {judged.path.parent / REPORT}")
    sys.exit(EXIT[judged.verdict.verdict])
