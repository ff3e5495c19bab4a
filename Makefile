# The README's two commands: `make demo` and `make test`. Each sets up everything it needs on a fresh machine.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
# SGLang's own parser for `dfserve deploy --check`, in a venv of its own (see $(SGLANG_STAMP) below).
SGLANG_VERSION := 0.5.23
SGLANG_VENV ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed

.PHONY: demo test lint sanitize system-deps sglang-cpu

# The demo's venv: dfserve and its pinned runtime dependencies only (requirements/demo.txt), no torch.
$(DEMO_STAMP): pyproject.toml setup.py $(wildcard dfserve/relay_c/*) requirements/demo.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements/demo.txt
	# Builds the relay's C extension (dfserve/relay_c/) in place: needs gcc and the Python headers.
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(DEMO_STAMP)

# The rest of CI's list on top, in the same venv: after `make demo`, `make test` installs only what the demo lacked.
$(STAMP): $(DEMO_STAMP) requirements/ci.txt
	$(BIN)/python -m pip install -q -r requirements/ci.txt
	touch $(STAMP)

# sglang without its GPU dependencies plus the few packages its parser imports; torch and the rest come from
# $(VENV) through a .pth file, so torch is installed once and SGLang's own pins stay out of the project venv.
$(SGLANG_STAMP): $(STAMP) requirements/sglang-check.txt
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))' \
		> "$$($(SGLANG_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/dfserve-venv.pth"
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps sglang==$(SGLANG_VERSION)
	@echo "$(SGLANG_VENV): sglang's own pins are left unmet on purpose (no GPU kernels; torch from $(VENV)), so pip's warnings about them are silenced"
	$(SGLANG_VENV)/bin/python -m pip install -q --no-warn-conflicts -r requirements/sglang-check.txt
	touch $(SGLANG_STAMP)

# SGLang itself on CPU, serving DFLASH with real weights in the end-to-end tests (tests/integration/test_sglang_cpu*.py):
# its own venv with torch's CPU build, sglang --no-deps, the patches in sglang_cpu/patches (each checked with
# --dry-run first), then this project's CPU distribution (sglang_cpu/: stand-in sgl_kernel ops, platform, hooks).
SGLANG_CPU_VENV ?= .venv-sglang-cpu
SGLANG_CPU_BASE := $(SGLANG_CPU_VENV)/.sglang-installed
SGLANG_CPU_STAMP := $(SGLANG_CPU_VENV)/.installed
SGLANG_CPU_PATCHES := $(sort $(wildcard sglang_cpu/patches/*.patch))

$(SGLANG_CPU_BASE): requirements/sglang-cpu.txt $(SGLANG_CPU_PATCHES)
	rm -rf $(SGLANG_CPU_VENV)
	$(PYTHON) -m venv $(SGLANG_CPU_VENV)
	$(SGLANG_CPU_VENV)/bin/python -m pip install -q -r requirements/sglang-cpu.txt
	@echo "# pip's resolver lists sglang's CUDA requirements as missing below: expected, sglang is installed --no-deps"
	$(SGLANG_CPU_VENV)/bin/python -m pip install -q --no-deps sglang==$(SGLANG_VERSION)
	site="$$($(SGLANG_CPU_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"; \
		for patch in $(SGLANG_CPU_PATCHES); do \
			patch -d "$$site" -p1 -s --dry-run < $$patch && patch -d "$$site" -p1 -s < $$patch || exit 1; \
		done
	touch $@

# What is installed: the packages and pyproject.toml (not tests/, run from the source folder, nor pip's build output).
SGLANG_CPU_SOURCES := sglang_cpu/pyproject.toml $(wildcard sglang_cpu/sgl_kernel/*.py sglang_cpu/dfserve_sglang_cpu/*.py)
$(SGLANG_CPU_STAMP): $(SGLANG_CPU_BASE) $(SGLANG_CPU_SOURCES)
	$(SGLANG_CPU_VENV)/bin/python -m pip install -q --no-deps --force-reinstall ./sglang_cpu
	touch $@

sglang-cpu: $(SGLANG_CPU_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/dfserve demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# The relay's C extension built with AddressSanitizer and UBSan (any report is fatal) in a copy of the package (which
# must be what the tests import, not the venv's build), and its tests run on it, with a bounded fuzz: the
# differential test against the pure-Python twin, on more inputs.
SANITIZE_DIR := build/sanitize
SANITIZERS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
SANITIZED := LD_PRELOAD="$$(gcc -print-file-name=libasan.so)" ASAN_OPTIONS=detect_leaks=0 \
	UBSAN_OPTIONS=print_stacktrace=1 PYTHONMALLOC=malloc
sanitize: $(STAMP)
	rm -rf $(SANITIZE_DIR) && mkdir -p $(SANITIZE_DIR)
	cp -r dfserve tests pyproject.toml setup.py README.md $(SANITIZE_DIR)/
	rm -f $(SANITIZE_DIR)/dfserve/_relay.*.so
	cd $(SANITIZE_DIR) && CFLAGS="$(SANITIZERS) -g" LDFLAGS="$(SANITIZERS)" \
		$(abspath $(BIN))/python setup.py -q build_ext --inplace
	cd $(SANITIZE_DIR) && $(SANITIZED) $(abspath $(BIN))/python -c \
		'import os, dfserve._relay as r; assert r.__file__.startswith(os.getcwd()), r.__file__'
	cd $(SANITIZE_DIR) && $(SANITIZED) DFSERVE_FUZZ_EXAMPLES=400 \
		$(abspath $(BIN))/python -m pytest -q --capture=sys -p no:cacheprovider \
		tests/unit/test_relay.py tests/unit/test_relay_differential.py tests/unit/test_http1.py \
		tests/integration/test_stamped_socket.py

# Debian packages the tests need, each installed only where missing: gcc (with its AddressSanitizer and UBSan
# runtimes) and the Python headers, which build the relay's extension; Prometheus (with promtool) and its
# Pushgateway, which the tests start.
PY_INCLUDE = $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_path("include"))')
system-deps:
	@command -v gcc >/dev/null && test -f "$(PY_INCLUDE)/Python.h" \
		|| { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
			gcc libc6-dev $(notdir $(PYTHON))-dev; }
	@command -v prometheus >/dev/null && command -v promtool >/dev/null && command -v prometheus-pushgateway >/dev/null \
		|| { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
			prometheus prometheus-pushgateway; }

# system-deps first: the venv's install builds the extension the tests import.
test: system-deps $(STAMP) $(SGLANG_STAMP) $(SGLANG_CPU_STAMP) lint sanitize
	$(BIN)/python -m pytest -q
