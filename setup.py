"""The package's one C extension, `dfserve._relay` (the relay's per-read work, see dfserve/relay_c/relay.h); the rest
is in pyproject.toml. The extension is optional: where it cannot be built (no compiler, no Python headers) the
install goes on and `dfserve.relay_core` uses its pure-Python twin, `dfserve/_relay_py/`."""

from pathlib import Path

from setuptools import Extension, setup

SOURCES = sorted(str(path) for path in Path("dfserve/relay_c").glob("*.c"))

setup(ext_modules=[Extension("dfserve._relay", SOURCES, depends=["dfserve/relay_c/relay.h"], optional=True,
                             extra_compile_args=["-Wall", "-Wextra", "-Wno-unused-parameter"])])
