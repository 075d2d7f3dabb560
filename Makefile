# Two commands: `make lab` starts the course in JupyterLab, `make test` runs every test.
# Each bootstraps .venv on first use with nothing but python3 and make.
PYTHON ?= python3
VENV   ?= .venv
# The torch build to install first. The default is the CPU-friendly pin these machines carry;
# on a GPU machine use e.g. `make lab TORCH="torch --index-url https://download.pytorch.org/whl/cu128"`.
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mgpu-installed

.PHONY: lab test test-browser release check-release clean-venv

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

# Then the CPU-figure tests (planned = measured by the profiler) once more under a lower oneDNN ISA than this
# CPU's (AVX-512 -> AVX2, AVX2 -> SSE4.1; tools/cpu_isa.py): CPU plans come from the CPU's own kernels.
test: $(STAMP)
	$(VENV)/bin/mgpu-course release --check
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder
	@isa=$$($(PY) -m mgpu_helpers.tools.cpu_isa --lower); \
	if [ -n "$$isa" ]; then \
	  echo "CPU figures again with ONEDNN_MAX_CPU_ISA=$$isa ($$($(PY) -m mgpu_helpers.tools.cpu_isa))"; \
	  ONEDNN_MAX_CPU_ISA=$$isa $(PY) -m pytest -n 2 --dist loadfile -q -m cpu_figures tests; \
	fi

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
