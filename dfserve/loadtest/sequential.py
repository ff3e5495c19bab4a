"""A load test that stops once its gate is decided: the runner's records fed to the verdict core's sequential
monitor as they are written, and the verdict of such a run replayed from requests.jsonl.

The method, what each rule's interval assumes and why looks see only the schedule's complete prefix are told in
`dfserve.verdict.sequential`; here are only which records count (measured ones of the two arms; a request the
tester cancelled at its stop is no pair) and the run's settings (temperatures, task set, warm-up).

    monitor = SequentialMonitor(design, "zlab", "inhouse", temperature=0.0, task_count=164, warmup=8)
    runner observers: [monitor.observe]; stop sending when monitor.stopped
"""

from __future__ import annotations

from collections.abc import Sequence

from dfserve.errors import FieldError
from dfserve.loadtest.config import RunConfig
from dfserve.loadtest.judge import METRICS, greedy_pair, pairs_of
from dfserve.loadtest.records import RequestRecord
from dfserve.verdict.design import Outcome, SequentialDesign
from dfserve.verdict.gate import Gate
from dfserve.verdict.sequential import Monitor, Sequential


class SequentialMonitor(Monitor[RequestRecord]):
    """The monitor of one run's baseline and candidate arms."""

    def __init__(self, design: SequentialDesign, baseline: str, candidate: str, temperature: float, task_count: int,
                 warmup: int = 0, mixes_greedy: bool = False) -> None:
        """`temperature`: the run's (the loosest, for a replayed capture); `mixes_greedy`: its requests mix greedy
        and sampled ones (`Sampling.mixes_greedy`)."""
        super().__init__(design, METRICS, temperature == 0, task_count, warmup, greedy_pair(temperature),
                         mixes_greedy)
        self.arms = (baseline, candidate)

    def observe(self, record: RequestRecord) -> None:
        if record.arm in self.arms and not record.warmup and not record.cancelled:
            self.offer(self.arms.index(record.arm), record.index, record.task_id, record)


def design_of(config: RunConfig) -> Sequential:
    """The sequential design a run was run with."""
    if config.sequential is None:
        raise FieldError("sequential", f"run {config.run_id} has no sequential design (a fixed-size run)")
    return Sequential(config.sequential, config.tasks.size, config.warmup, greedy_pair(config.sampling.temperature),
                      awaits_greedy=config.sampling.mixes_greedy)


def judge_sequential(records: Sequence[RequestRecord], baseline: str, candidate: str, gate: Gate,
                     config: RunConfig) -> Outcome:
    """The verdict of a sequential run under `gate`, its looks replayed from its records."""
    design = design_of(config)
    pairs = pairs_of([r for r in records if r.arm == baseline], [r for r in records if r.arm == candidate],
                     config.sampling.temperature)
    return design.judge(pairs, METRICS, gate)
