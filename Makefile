# Every target sets itself up: a fresh clone needs only Python 3.10+ and make.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-ray durations docs bench dist compat compat-env conformance-table keras-suite clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,examples,docs]'
	@# Bytecode for this checkout's own modules, which a PYTHONDONTWRITEBYTECODE
	@# environment never caches: each task process of the tests imports them
	@# (~0.2 CPU-s a process to compile; a stale file is recompiled in memory).
	$(PY) -m compileall -q keras_dist tests tools examples benchmarks > /dev/null
	touch $(STAMP)

## install: this checkout's environment, .venv (every target below does it first)
install: $(STAMP)

## demo: asynchronous training on a local cluster (chief, 2 workers, 1 ps) on the bundled digits
demo: $(STAMP)
	$(VENV)/bin/keras-dist-run --workers 2 --ps 1 -- $(PY) examples/train_digits.py

## test: the whole test suite but Ray's on $(TEST_WORKERS) xdist workers (tests/suite_plan.py),
## then the 20 slowest tests (every test's seconds: $(DURATIONS)), then the docs build.
## pytest exit 5, "no tests ran", counts as failure.
TEST_WORKERS ?= 2
DURATIONS    := logs/test-durations.json
test: $(STAMP)
	@$(PY) -m pytest -m "not ray" -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder \
	    --durations-json=$(DURATIONS); rc=$$?; \
	$(PY) tools/durations.py $(DURATIONS) --top 20 || true; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; \
	exit $$rc
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir $(VENV)/site

## durations: tests/DURATIONS.md (where the suite's time goes) and tests/durations.json (the order
## work goes out in) from the last `make test` run
durations:
	$(PY) tools/durations.py $(DURATIONS) --top 40 --write

## test-ray: keras_dist.ray's tests on a local Ray (installs the ray extra; ~3 min on 2 cores)
test-ray: $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[ray]'
	$(PY) -m pytest -m ray tests/test_ray.py

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

## bench: every benchmark side by side, then docs/benchmarks.md (installs the bench extra; ~40 min)
bench: $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[bench]'
	$(PY) benchmarks/fit_overhead.py
	$(PY) benchmarks/iterator_release.py
	$(VENV)/bin/keras-dist-run --workers 2 --ps 1 -- $(PY) benchmarks/ps_throughput.py
	$(VENV)/bin/keras-dist-run --workers 2 --ps 1 -- $(PY) benchmarks/local_steps.py
	$(PY) benchmarks/ps_startup.py
	$(PY) benchmarks/flags_startup.py
	$(PY) benchmarks/stalled_worker.py
	$(PY) benchmarks/preemption.py
	$(VENV)/bin/keras-dist-run --workers 2 --ps 2 -- $(PY) benchmarks/ps_sharded.py
	$(PY) benchmarks/staleness_convergence.py
	$(PY) benchmarks/simulator_validation.py
	$(PY) benchmarks/simulator_validation.py --optimizer ringmaster --output benchmarks/results/simulator_validation_ringmaster
	$(PY) benchmarks/straggler.py
	$(PY) benchmarks/straggler_detection.py
	$(PY) benchmarks/report.py

## dist: the sdist and the wheel, in dist/
dist: $(STAMP)
	$(PY) -m pip install --quiet build
	rm -rf dist
	$(PY) -m build --outdir dist .

## compat: the fast subset on each tested TensorFlow x Keras pair, from the wheel
## (PAIRS=oldest|middle|newest|all; environments cached in .compat/)
PAIRS ?= all
compat: dist
	$(PY) tools/compat.py --pairs $(PAIRS)

## compat-env: only the compat environments, with everything the wheel needs but the wheel
## (.ci/run builds them while the suite runs; `make compat` then installs only the wheel)
compat-env: | $(PY)
	$(PY) tools/compat.py --pairs $(PAIRS) --prepare-only

## conformance-table: docs/compatibility.md's conformance matrix from tests/conformance.py's EXPECTED
conformance-table: $(STAMP)
	$(PY) tests/conformance.py --write

## keras-suite: Keras' own fit tests (its sdist's trainer_test and fit callbacks' tests) with no strategy,
## under Mirrored (2 logical CPUs) and under Mirrored through kd.fit; summary in logs/keras-suite.md
keras-suite: $(STAMP)
	$(PY) tools/keras_suite.py --out=logs/keras-suite.md

clean:
	rm -rf $(VENV) site build dist *.egg-info
