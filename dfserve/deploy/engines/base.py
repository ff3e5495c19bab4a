"""The engine seam: one registry of engine kinds, each owning how a `DeploymentSpec` runs as that engine.

An entry says what command starts the engine and with which environment, how its arguments are validated before
anything starts (`--check`), which paths answer once it is ready and while it lives, and what container runs it on
Kubernetes. A new engine is a module with one decorated class; a host that runs an existing engine with other values
(SGLang on CPU) is a host profile, not an entry::

    @EngineKind.register("sglang")
    class SGLang(EngineKind): ...

    engine_kind("sglang").argv(spec, python="python3")
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeVar

from dfserve.errors import FieldError

if TYPE_CHECKING:
    from dfserve.deploy.deployment import DeploymentSpec

_Kind = TypeVar("_Kind", bound="type[EngineKind]")


@dataclass(frozen=True)
class Container:
    """What an engine kind says about its Kubernetes container; the pod around it is `deploy.k8s`'s."""

    name: str
    command: list[str]
    args: list[str]


class EngineKind(ABC):
    """One way to run an engine for a spec. Entries are stateless; `engine_kind(name)` gives the registered one."""

    name: ClassVar[str]
    simulated: ClassVar[bool] = False
    """Its answers are modelled, not computed: it alone runs drafters that exist only as simulator profiles."""
    ready_path: ClassVar[str] = "/health_generate"
    """Answers 200 once a generation through target and drafter succeeds: the start waits for it."""
    alive_path: ClassVar[str] = "/health"
    """Answers 200 while the engine serves: `deploy status` asks it."""
    _registry: ClassVar[dict[str, EngineKind]] = {}

    @classmethod
    def register(cls, name: str) -> Callable[[_Kind], _Kind]:
        """Class decorator: make the class the engine kind `name`."""
        def add(kind: _Kind) -> _Kind:
            if name in cls._registry:
                raise ValueError(f"engine kind {name!r} is registered twice")
            kind.name = name
            cls._registry[name] = kind()
            return kind
        return add

    @abstractmethod
    def argv(self, spec: DeploymentSpec, python: str) -> list[str]:
        """The command that starts the engine; `python` is SGLang's interpreter (or a stand-in with its CLI)."""

    def env(self, spec: DeploymentSpec) -> dict[str, str]:
        """Variables added to the engine's environment."""
        return {}

    @abstractmethod
    def check(self, spec: DeploymentSpec, python: str) -> str:
        """Validate the command without starting it: a line saying what was checked, or a `FieldError`."""

    @abstractmethod
    def container(self, spec: DeploymentSpec, host: str) -> Container:
        """The container serving the spec on `host` (paths as the pod sees them), or a `FieldError` for an engine
        that has no container form."""


def engine_kind(name: str) -> EngineKind:
    try:
        return EngineKind._registry[name]
    except KeyError:
        raise FieldError("engine", f"{name!r} is not an engine kind ({', '.join(engine_names())})") from None


def engine_names() -> list[str]:
    return sorted(EngineKind._registry)
