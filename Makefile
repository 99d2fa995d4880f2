PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run test lint bench docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt pip uv
	@# uv installs everything at those pins, in 27 s where pip took 55 s, looking also
	@# where pip's configuration finds wheels (the CPU build of torch on the build
	@# machines' disk). --compile-bytecode, as pip does: where PYTHONDONTWRITEBYTECODE is
	@# set (it is on the build machines) no process writes it later, and every Ray worker
	@# would compile ray and numpy afresh (make test took 503 s instead of 314 without it).
	links="$${PIP_FIND_LINKS:-$$($(PY) -m pip config get global.find-links 2>/dev/null)}"; \
	UV_FIND_LINKS="$$(echo $$links | tr ' ' ',')" $(VENV)/bin/uv pip install -q \
		--compile-bytecode --python $(PY) -c constraints.txt -e '.[torch,sinks,dev]'
	touch $(STAMP)

CONFIG ?= default

run: $(STAMP)
	$(PY) examples/ray_driver.py --config $(CONFIG)

test: $(STAMP)
	@# Compiled once here: every Ray worker and child process the tests start imports the
	@# package, and where PYTHONDONTWRITEBYTECODE is set none would write its bytecode.
	$(PY) -m compileall -q metricsvc examples tests benchmarks > /dev/null
	@# Two pytest-xdist workers, a file at a time each, on one Ray cluster, the heaviest
	@# files first (tests/conftest.py: xdist would reorder them by their number of tests).
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

lint: $(STAMP)
	$(PY) -m ruff check metricsvc tests examples benchmarks

docs: $(STAMP)
	$(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) runs site .pytest_cache

bench: $(STAMP)
	$(PY) -m benchmarks.bench_rank
	$(PY) -m benchmarks.bench_summarize
	$(PY) -m benchmarks.bench_merge
	$(PY) -m benchmarks.bench_rpc
	$(PY) -m benchmarks.bench_scale
	$(PY) -m benchmarks.bench_restart
	$(PY) -m benchmarks.bench_import
	$(PY) -m benchmarks.bench_alternatives
