# Two commands: `make lab` starts the course in JupyterLab, `make test` runs every test.
# Each bootstraps .venv on first use with nothing but python3 and make.
PYTHON ?= python3
VENV   ?= .venv
# The torch build to install first. The default is the CPU-friendly pin these machines carry;
# on a GPU machine use e.g. `make lab TORCH="torch --index-url https://download.pytorch.org/whl/cu128"`.
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mgpu-installed

.PHONY: lab test release check-release clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	# The kernel notebooks and nbval start must be this venv's Python, whatever else is installed.
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (mgpu course)" >/dev/null
	touch $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

test: $(STAMP)
	$(VENV)/bin/mgpu-course release --check
	$(PY) -m pytest -n 2 --dist loadfile

release: $(STAMP)
	$(VENV)/bin/mgpu-course release

clean-venv:
	rm -rf $(VENV)
