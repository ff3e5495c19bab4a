"""Engine kinds (`base.EngineKind`): SGLang and the simulator, one module each; importing the package registers them."""

from dfserve.deploy.engines import sglang, sim
from dfserve.deploy.engines.base import EngineKind, engine_kind, engine_names

__all__ = ["EngineKind", "engine_kind", "engine_names", "sglang", "sim"]
