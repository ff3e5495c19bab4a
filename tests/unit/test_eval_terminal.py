"""What `dfserve eval run` prints: its results table reads at 80 columns, numbers whole, however many methods."""

from __future__ import annotations

import io

from rich.console import Console

from dfserve.eval.cli import results_table
from dfserve.eval.records import DrafterSummary, EvalSummary, MethodSummary, PositionCurve
from dfserve.verdict.results import Figure

METHODS = ("vanilla", "ddtree4", "ddtree8", "ddtree16")


def drafter(label: str, tau: float) -> DrafterSummary:
    methods = tuple(MethodSummary(method=m, tau=Figure(estimate=tau + i, low=tau + i - 0.25, high=tau + i + 0.25, n=900),
                                  accepted_drafts=tau + i - 1, tau_task_mean=tau + i, tau_as_sglang=tau + i + 0.1,
                                  tokens=9000, rounds=900, capped_rounds=3, per_task={}, histogram=[])
                    for i, m in enumerate(METHODS))
    positions = PositionCurve(accuracy=[0.91, 0.8, None, 0.5], n=[900, 800, 0, 400],
                              accuracy_after_hits=[0.91, 0.85, None, 0.6], n_after_hits=[900, 700, 0, 300])
    return DrafterSummary(drafter=label, anchors=900, methods=methods, positions=positions)


def test_the_results_table_fits_80_columns_with_every_number_on_one_line() -> None:
    summary = EvalSummary(run_id="eval-20260101-000000-abcd", interrupted=False,
                          drafters=(drafter("zlab", 6.0), drafter("step-004000-ema", 5.5)), judgements=())
    out = io.StringIO()
    Console(file=out, width=80).print(results_table("offline evaluation eval-20260101-000000-abcd: 164 tasks", summary))
    lines = out.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    rows = [line.split() for line in lines if line.split() and line.split()[0] in {"zlab", "step-004000-ema", *METHODS}]
    assert len(rows) == 2 * len(METHODS)  # one line per drafter and method: no cell wrapped
    assert rows[0] == ["zlab", "vanilla", "6.00", "[5.75,", "6.25]", "6.10", "5.00", "0.91/0.80/-"]
    assert rows[len(METHODS) + 3] == ["ddtree16", "8.50", "[8.25,", "8.75]", "8.60", "7.50"]
