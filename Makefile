PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run test lint bench docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# pip for torch: its configuration finds the CPU wheel kept on this machine's disk
	@# (uv does not look there). uv for the rest, at the same pins: the same packages as
	@# pip would install, in 35 s where pip alone took 55 s.
	$(PY) -m pip install -q -c constraints.txt torch uv
	@# --compile-bytecode, as pip does: where PYTHONDONTWRITEBYTECODE is set (it is on the
	@# build machines) no process writes it later, and every Ray worker would compile ray
	@# and numpy afresh (make test took 503 s instead of 314 without it).
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -c constraints.txt \
		-e '.[torch,sinks,dev]'
	touch $(STAMP)

CONFIG ?= default

run: $(STAMP)
	$(PY) examples/ray_driver.py --config $(CONFIG)

test: $(STAMP)
	@# Compiled once here: every Ray worker and child process the tests start imports the
	@# package, and where PYTHONDONTWRITEBYTECODE is set none would write its bytecode.
	$(PY) -m compileall -q metricsvc examples tests benchmarks > /dev/null
	@# Two pytest-xdist workers, a file at a time each, on one Ray cluster (tests/conftest.py).
	$(PY) -m pytest -q -n 2 --dist loadfile

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
