# dapo_ref: two commands do everything on a fresh machine.
#   make demo   set up .venv if needed, then a DAPO run on the embedded tiny default
#   make test   set up .venv if needed, then every CPU test (what .ci/run runs)
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
# torch first, pinned: on this kind of machine torch==2.13.0 is a CPU build on local disk,
# while an unpinned torch would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
PIP := $(PY) -m pip --disable-pip-version-check

.PHONY: install demo test check-export check-clean nbtest pytest docs docs-browser clean-docs

$(VENV)/.installed: setup.py settings.ini pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e ".[dev]"
	@touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/dapo-train --config recipes/tiny-cpu.yaml

test: install check-export check-clean nbtest pytest docs
	@echo "make test: all checks passed"

# The notebooks are the source of dapo_ref/: exporting them must change nothing.
check-export: install
	@before=$$(find dapo_ref -name '*.py' -type f | sort | xargs sha256sum); \
	$(BIN)/nbdev_export; \
	after=$$(find dapo_ref -name '*.py' -type f | sort | xargs sha256sum); \
	if [ "$$before" != "$$after" ]; then \
	  diff <(echo "$$before") <(echo "$$after") | sed -n 's/^> [0-9a-f]* */  changed: /p'; \
	  echo "notebooks and dapo_ref/ are out of sync: run nbdev_export (then review and commit dapo_ref/)"; exit 1; fi; \
	echo "check-export: dapo_ref/ matches the notebooks"

# Notebooks are committed clean (no metadata churn): cleaning them must change nothing.
check-clean: install
	@before=$$(find nbs -name '*.ipynb' -not -path '*/.ipynb_checkpoints/*' | sort | xargs sha256sum); \
	$(BIN)/nbdev_clean; \
	after=$$(find nbs -name '*.ipynb' -not -path '*/.ipynb_checkpoints/*' | sort | xargs sha256sum); \
	if [ "$$before" != "$$after" ]; then \
	  diff <(echo "$$before") <(echo "$$after") | sed -n 's/^> [0-9a-f]* */  changed: /p'; \
	  echo "notebook not clean: run nbdev_clean (then review and commit nbs/)"; exit 1; fi; \
	echo "check-clean: notebooks are clean"

# Every notebook top to bottom; cells flagged slow/gpu (settings.ini tst_flags) are skipped.
nbtest: install
	$(BIN)/nbdev_test --timing

pytest: install
	$(PY) -m pytest tests/ -q -p no:cacheprovider

# Docs: nbdev_docs needs Quarto, which cannot be installed here; render every notebook with nbconvert.
docs: install
	$(PY) .ci/check_docs.py

# The browser part alone (headless Chromium over the pages `make docs` rendered).
docs-browser: install
	$(PY) .ci/browser_check.py

clean-docs:
	rm -rf _docs _proc
