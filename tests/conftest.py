"""Fixtures more than one test module shares, each built once per session."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from dfserve.eval.tiny import DemoModels


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory: pytest.TempPathFactory) -> DemoModels:
    """`dfserve demo --offline`'s tiny models, built once into a fresh cache (`built` is True): the offline demo
    reads them from that cache, and the eval tests take their target and drafters from them (tens of seconds of
    distillation each time otherwise)."""
    from dfserve.eval.tiny import build_demo

    return build_demo(tmp_path_factory.mktemp("demo-cache"))
