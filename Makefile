# Developer and CI entry points. Everything runs from the project's own .venv.

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# Reinstall only when the dependency list changes.
STAMP := $(VENV)/.pdserve-installed

.PHONY: venv tools test test-fast lint up bench

venv: $(STAMP)

# Prometheus + promtool for tests/deploy (rules, alert unit tests, the live dashboard test):
# Debian's package where promtool is missing and apt-get can run (root, as in CI); otherwise a
# note, and those tests skip saying why.
tools:
	@if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } \
			|| echo "note: apt-get could not install prometheus: tests/deploy's Prometheus tests will skip"; \
	else \
		echo "note: prometheus/promtool not installed and apt-get unavailable here: tests/deploy's Prometheus tests will skip"; \
	fi

# torch goes in first and pinned: 2.13.0 is served as a local CPU build, while an unpinned torch
# (or one pulled in by `pip install -e .`) would fetch GBs of CUDA wheels. Where torch already
# imports (a GPU machine with its own build), that step is skipped.
# The example speculative plugin is installed like any out-of-tree plugin (not editable), so its
# entry point is what pdserve discovers; its sources are prerequisites so edits reinstall it.
PLUGIN := examples/standalone
$(STAMP): pyproject.toml $(PLUGIN)/pyproject.toml $(wildcard $(PLUGIN)/pdserve_standalone/*.py)
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -U pip
	if $(VPY) -c "import torch" >/dev/null 2>&1; then \
		echo "torch already installed: $$($(VPY) -c 'import torch; print(torch.__version__)')"; \
	else \
		$(VPY) -m pip install torch==2.13.0; \
	fi
	$(VPY) -m pip install -e '.[node,router,bench,test,lint,triton,deploy-test]'
	$(VPY) -m pip install --no-deps nixl-cu13==1.5.1 || echo "warning: nixl-cu13 not installed; PD transfer unavailable"
	$(VPY) -m pip install ./$(PLUGIN)
	touch $@

test: venv tools
	TRITON_INTERPRET=1 $(VPY) -m pytest -q -x

# Everything but the tests that start real node processes (marked slow): the edit-test loop.
test-fast: venv
	TRITON_INTERPRET=1 $(VPY) -m pytest -q -x -m "not slow"

# ruff (lint + format check) over the whole tree, mypy over the typed surface (pyproject.toml).
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

up: venv
	$(VENV)/bin/pdserve up

bench: venv
	$(VPY) -m bench.engine_cpu
