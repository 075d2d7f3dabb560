# Two commands: `make lab` starts the course in JupyterLab, `make test` runs every test (`make test-fast`: a quick tier).
# Each bootstraps .venv on first use with nothing but python3 and make.
PYTHON ?= python3
VENV   ?= .venv
# The torch build to install first. The default is the CPU-friendly pin these machines carry;
# on a GPU machine use e.g. `make lab TORCH="torch --index-url https://download.pytorch.org/whl/cu128"`.
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mgpu-installed

.PHONY: lab test test-fast test-min-torch test-browser release check-release clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	# The kernel notebooks and nbval start must be this venv's Python, whatever else is installed.
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (mgpu course)" >/dev/null
	touch $(STAMP)

# Root or not, display or not: prints the URL (with its token) that opens notebooks/00_setup.ipynb.
# Options go in ARGS, e.g. `make lab ARGS="--port 9000"` (see `python -m mgpu_helpers.tools.lab --help`).
lab: $(STAMP)
	$(PY) -m mgpu_helpers.tools.lab $(ARGS)

# Every test: units, checks, mutants at MGPU_SEEDS seeds (20), nbval over every solution notebook. .ci/run calls it.
test: $(STAMP)
	$(VENV)/bin/mgpu-course release --check
	MGPU_SEEDS=$${MGPU_SEEDS:-20} $(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder

# The fast tier, for each change (<= 5 min on 2 cores): no test marked slow, mutant sweeps at 2 seeds, and
# nbval over the solution notebooks that differ from $(BASE) (default main).
BASE ?= main
test-fast: $(STAMP)
	$(VENV)/bin/mgpu-course release --check
	MGPU_SEEDS=2 $(PY) -m pytest -n 2 --dist loadfile -m "not slow and not browser and not answers" tests \
	  $$(git diff --name-only --diff-filter=d $$(git merge-base HEAD $(BASE)) -- 'solutions/*.ipynb')

# The oldest torch the course supports (MIN_TORCH in mgpu_helpers/__init__.py, pyproject's pin), in a venv of
# its own (.venv-min): the package imports, then the fast tier. Not in .ci/run: CI's time goes to `make test`.
MIN_TORCH_PIN := torch==2.11.0
test-min-torch:
	$(MAKE) VENV=.venv-min TORCH=$(MIN_TORCH_PIN) .venv-min/.mgpu-installed
	.venv-min/bin/python -c "import torch, mgpu_helpers; print('mgpu_helpers imports under torch', torch.__version__)"
	$(MAKE) test-fast VENV=.venv-min TORCH=$(MIN_TORCH_PIN)

# The learner's path in headless Chromium (tests/browser): needs Playwright for Python (the `browser`
# extra) and Debian's chromium, installed here with apt-get when missing and we are root. Not part of
# `make test`, which needs no system packages.
BROWSER_STAMP := $(VENV)/.mgpu-browser-installed
$(BROWSER_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[browser]"
	touch $(BROWSER_STAMP)

test-browser: $(BROWSER_STAMP)
	@if [ -z "$$MGPU_CHROMIUM" ] && ! command -v chromium >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium (apt-get)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else \
	    echo "make test-browser needs Chromium: sudo apt-get install chromium, or MGPU_CHROMIUM=/path/to/chrome" >&2; \
	    exit 1; \
	  fi; \
	fi
	$(PY) -m pytest -m browser tests/browser

release: $(STAMP)
	$(VENV)/bin/mgpu-course release

clean-venv:
	rm -rf $(VENV)
