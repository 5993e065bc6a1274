# polytrain: the README's commands call these targets.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=
# The whole suite runs in two pytest processes, a test file at a time in each (module
# fixtures stay whole): in one process the Ray tests leave the cores idle about 30 % of
# the time (process starts, restarts, polls); two streams fill them.
# PYTEST_WORKERS=0 runs it in this process.
PYTEST_WORKERS ?= 2
PARALLEL := -n $(PYTEST_WORKERS) --dist loadfile

.PHONY: setup test test-long demo bench lint unit docs chaos

setup:            ## install polytrain and every backend into .venv (idempotent)
	bash scripts/setup.sh

test: setup       ## install everything (a single-node Slurm and chromium too, where root), then run the whole test suite
	bash scripts/install_slurm.sh
	bash scripts/install_chromium.sh
	$(PY) -m ruff check polytrain tests examples benchmarks
	$(PY) -m pytest $(PARALLEL) $(PYTEST_ARGS)

test-long: setup  ## the whole suite plus every case of the backend x option matrices
	POLYTRAIN_LONG_TESTS=1 $(PY) -m pytest $(PARALLEL) $(PYTEST_ARGS)

unit:             ## the fast unit tests only (no Ray)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

demo: setup       ## the main job: train the digits example on every installed backend and compare
	$(PY) -m polytrain compare -c examples/configs/digits_both.yaml --epochs 5 --out polytrain_runs/demo

bench: setup      ## side-by-side benchmarks against the native launchers; rewrites benchmarks/RESULTS.md (benchmarks/run.py --help: every suite)
	$(PY) benchmarks/run.py sidebyside

chaos: setup      ## the chaos run: 20 seeded faults per backend (5 torch backends + TFTrainer) on a simulated cluster; figures into RELIABILITY.md
	$(PY) benchmarks/run.py chaos --faults 20 --seed 0 --out benchmarks/out/chaos --update-reliability RELIABILITY.md

docs: setup       ## build the documentation site into site/ (mkdocs build --strict)
	$(PY) -m mkdocs build --strict --site-dir site

lint:
	$(PY) -m ruff check polytrain tests examples benchmarks
