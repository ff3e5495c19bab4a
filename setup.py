"""The package's one C extension (the relay's per-read work, see dfserve/_relay.c); the rest is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("dfserve._relay", ["dfserve/_relay.c"], extra_compile_args=["-Wall", "-Wextra", "-Wno-unused-parameter"])])
