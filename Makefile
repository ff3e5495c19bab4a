# The README's two commands: `make demo` and `make test`. Each sets up everything it needs on a fresh machine.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# SGLang's own parser for `dfserve deploy --check`, in a venv of its own (see $(SGLANG_STAMP) below).
SGLANG_VERSION := 0.5.23
SGLANG_VENV ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed

.PHONY: demo test lint system-deps

$(STAMP): pyproject.toml setup.py dfserve/_relay.c requirements/ci.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements/ci.txt
	# Builds the relay's C extension (dfserve/_relay.c) in place: needs gcc and the Python headers.
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

# sglang without its GPU dependencies plus the few packages its parser imports; torch and the rest come from
# $(VENV) through a .pth file, so torch is installed once and SGLang's own pins stay out of the project venv.
$(SGLANG_STAMP): $(STAMP) requirements/sglang-check.txt
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))' \
		> "$$($(SGLANG_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/dfserve-venv.pth"
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps sglang==$(SGLANG_VERSION)
	$(SGLANG_VENV)/bin/python -m pip install -q -r requirements/sglang-check.txt
	touch $(SGLANG_STAMP)

demo: $(STAMP)
	$(BIN)/dfserve demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# Debian packages the tests start: Prometheus (with promtool) and its Pushgateway; installed only where missing.
system-deps:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null && command -v prometheus-pushgateway >/dev/null \
		|| { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
			prometheus prometheus-pushgateway; }

test: $(STAMP) $(SGLANG_STAMP) system-deps lint
	$(BIN)/python -m pytest -q
