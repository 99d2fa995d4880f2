PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run test lint bench docs clean

# Bytecode is written as modules are first imported, into .venv and this checkout, even
# where PYTHONDONTWRITEBYTECODE is set (it is on the build machines): otherwise every Ray
# worker and child process the tests start would compile ray, numpy and the package
# afresh (make test took 503 s instead of 314). Compiling only what is imported, once,
# costs a fraction of compiling the whole environment at install (37 CPU-s, 20 s here).
unexport PYTHONDONTWRITEBYTECODE

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv --without-pip $(VENV)
	@# uv installs everything at those pins (pip included), in a few seconds where pip took
	@# 55, looking also where pip's configuration finds wheels (the CPU build of torch on
	@# the build machines' disk). uv itself comes from the interpreter's own pip where it
	@# has one (3 s less than putting a pip in the venv first), else from the venv's.
	if $(PYTHON) -m pip --python $(PY) --version > /dev/null 2>&1; then pip="$(PYTHON) -m pip"; \
		$$pip --python $(PY) install -q -c constraints.txt uv; \
	else $(PYTHON) -m venv $(VENV) && pip="$(PY) -m pip" && $$pip install -q -c constraints.txt uv; \
	fi && links="$${PIP_FIND_LINKS:-$$($$pip config get global.find-links 2>/dev/null)}" && \
	UV_FIND_LINKS="$$(echo $$links | tr ' ' ',')" $(VENV)/bin/uv pip install -q \
		--python $(PY) -c constraints.txt pip -e '.[torch,sinks,dev]'
	touch $(STAMP)

CONFIG ?= default
TEST_LIMIT_S ?= 2400
PYTEST_ARGS = -q -n 3 --dist loadfile --no-loadscope-reorder --max-worker-restart=0

run: $(STAMP)
	$(PY) examples/ray_driver.py --config $(CONFIG)

test: $(STAMP)
	@# Three pytest-xdist workers, a file at a time each, on one Ray cluster, the heaviest
	@# files first (tests/conftest.py: xdist would reorder them by their number of tests).
	@# Three on two cores: while a test waits (a restart, a timeout, a node held alone)
	@# another's test uses the cores; with two workers the cores stood idle 69-78 CPU-s of
	@# a run, with three 26-27, and the suite took 11-18 s less in three pairs of runs.
	@# A worker that dies (a segfault, a kill) fails its test by name and ends the run:
	@# pytest-xdist 3.8 hangs for good when it replaces a crashed worker under --dist
	@# loadfile (pytest-xdist#784, #1323), as a CI run did; and no run outlives
	@# TEST_LIMIT_S (an interrupt first, so pytest prints what it ran and where it stood).
	timeout -s INT -k 60 $(TEST_LIMIT_S) $(PY) -m pytest $(PYTEST_ARGS)

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
