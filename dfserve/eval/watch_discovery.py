"""Which checkpoints a trainer has finished writing, and which of them the watch scores next: pure decisions over
what each poll of the checkpoint folder saw, tested without a file system or a clock.

A trainer writes `step_1000/checkpoint.pt`, `checkpoint-1000/` (a Hugging Face folder), `model_step1000.pt`,
`epoch=0-step=1000.ckpt` (PyTorch Lightning) or `*.safetensors`; the step comes from the name when it carries one. A name that says it is unfinished (`.tmp`,
`.partial`, a leading dot) is never a candidate, nor is anything beneath such a folder. A candidate is complete
when two polls in a row saw the same size and modification time (and it then loads, which the caller checks)::

    stability = Stability()
    ready = stability.observe(poll())          # complete since the previous poll
    chosen, skipped = choose(ready_with_steps, done, every=False)
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")
TEMPORARY_SUFFIXES = (".tmp", ".temp", ".partial", ".part", ".incomplete", ".lock", "~")
_STEP = re.compile(r"(?:^|[/_.-])(?:global_?)?(?:step|checkpoint|ckpt|iter)[_=-]?(\d+)(?=$|[/_.-])", re.IGNORECASE)


def step_from_name(relative: str) -> int | None:
    """The step a trainer put in the path (`step_1000/checkpoint.pt`, `checkpoint-1000`, `model_step1000.pt`);
    the innermost mention wins. None when the path names no step."""
    found = _STEP.findall(relative)
    return int(found[-1]) if found else None


def is_temporary(relative: str) -> bool:
    """A path a trainer is still writing or has not published: a temporary suffix or a hidden part anywhere."""
    return any(part.startswith((".", "tmp")) or part.lower().endswith(TEMPORARY_SUFFIXES)
               for part in relative.split("/"))


TRAINER_STATE = re.compile(r"^(optimizer|scheduler|scaler|rng_state|training_args)|optim_states", re.IGNORECASE)
"""What a trainer saves beside its weights (Hugging Face's `optimizer.pt`, `rng_state.pth`, DeepSpeed's
`*_optim_states.pt`): never a drafter, and an optimizer's state is twice the model's bytes to load and stage."""


def is_weights(name: str) -> bool:
    return name.lower().endswith(WEIGHT_SUFFIXES) and not TRAINER_STATE.search(name)


@dataclass(frozen=True)
class Seen:
    """One candidate as one poll saw it: a weights file, or a folder holding a config and weights."""

    key: str
    """Its path relative to the checkpoint folder: the identity the watch state keeps."""
    folder: bool
    size: int
    """Bytes (a folder: of every file in it)."""
    mtime_ns: int
    """The latest modification (a folder: of any file in it)."""

    @property
    def fingerprint(self) -> tuple[int, int]:
        return self.size, self.mtime_ns


@dataclass
class Stability:
    """Each candidate's fingerprint at the previous poll; complete means unchanged between two polls."""

    previous: dict[str, tuple[int, int]] = field(default_factory=dict)

    def observe(self, seen: Iterable[Seen]) -> list[Seen]:
        """The candidates this poll found unchanged since the last one (never on their first sighting)."""
        current = {s.key: s for s in seen}
        ready = [s for key, s in sorted(current.items())
                 if s.size > 0 and self.previous.get(key) == s.fingerprint]
        self.previous = {key: s.fingerprint for key, s in current.items()}
        return ready


@dataclass(frozen=True)
class Ready:
    """A complete candidate with its step (from the name, else from the checkpoint)."""

    key: str
    step: int


def choose(ready: Sequence[Ready], done: set[str], every: bool) -> tuple[list[Ready], list[Ready]]:
    """What to score now, in order, and what is skipped for good.

    `every`: all pending, oldest step first. Otherwise the newest step's only: when checkpoints land faster than
    they are scored, the trend follows the run's head and the older pending ones are listed as skipped. Files of one
    step are all tried (a model beside its optimizer's state: which one is the drafter shows when it is loaded)."""
    pending = sorted((r for r in ready if r.key not in done), key=lambda r: (r.step, r.key))
    if every or not pending:
        return pending, []
    newest = pending[-1].step
    return [r for r in pending if r.step == newest], [r for r in pending if r.step < newest]
