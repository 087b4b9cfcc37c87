# The two commands of the README's quick start.
PY ?= python3
# Python caches compiled modules (__pycache__) for the processes the suite starts (about 170
# in the torch tier, each importing schedc, and the rehearsal's torch, installed uncompiled),
# where the machine's environment says not to (PYTHONDONTWRITEBYTECODE=1 here): each would
# compile them again
unexport PYTHONDONTWRITEBYTECODE
# pytest-xdist workers for the torch tier: its tests wait on ranks, sleeps and timeouts as
# much as they compute, so two workers on two cores overlap the waits (tests of one rank
# pool or one written trace share a worker: tests/conftest.py); one thread each, as ranks
# that share the cores run (the workers' own torch, and what they start, unless a test says)
WORKERS ?= 2

.PHONY: demo test test-without-torch gpu-rehearsal typecheck docs
demo:  ## install, then train the default schedule (tiny_ddp_overlap) on the 2 ranks it names
	PYTHON=$(PY) scripts/install.sh
	mkdir -p out
	$(PY) -m schedc run --trace out/trace.json

test:  ## install with the test tools, lint, check the layers, run the whole suite: the torch tests here, then side by side the rest in a venv without torch, the GPU check rehearsed in a venv like the GPU machine's (each test once) and the type checker
	PYTHON=$(PY) scripts/tier.sh install scripts/install.sh test
	$(PY) -m ruff check schedc tests bench
	$(PY) -m ruff format --check schedc tests bench
	lint-imports
	OMP_NUM_THREADS=1 scripts/tier.sh torch $(PY) -m pytest -q -m torch -n $(WORKERS) --dist loadgroup
	$(MAKE) --no-print-directory --output-sync=target -j3 test-without-torch gpu-rehearsal typecheck

test-without-torch:  ## the torch-free tier, in a fresh venv without torch
	PYTHON=$(PY) scripts/tier.sh torch-free scripts/test_without_torch.sh

gpu-rehearsal:  ## scripts/gpu_check.sh rehearsed on this CPU (what a lent GPU will run)
	PYTHON=$(PY) scripts/tier.sh gpu-rehearsal scripts/gpu_rehearsal.sh

typecheck:  ## mypy over the whole package (configuration: pyproject.toml [tool.mypy])
	scripts/tier.sh typecheck $(PY) -m mypy

docs:  ## redraw README's pictures (docs/render/*.svg); MEASURED=1 also traces a 2-rank CPU run
	PYTHON=$(PY) scripts/docs_images.sh $(if $(MEASURED),measured)
