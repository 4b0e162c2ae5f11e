# Two commands for a fresh machine: `make demo` and `make test`.
# Both set up a venv first; set-up is skipped when pyproject.toml has not changed.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU wheel of torch. Installed before the package so that the torch range in
# pyproject.toml is already satisfied and pip never pulls a CUDA build.
TORCH  ?= torch==2.13.0
TRITON ?= triton==3.8.*
PYTEST_WORKERS ?= 2

.PHONY: setup demo test test-slow test-zoo bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" "$(TRITON)"
	$(PY) -m pip install -q -e ".[dev,hf]"
	touch $@

demo: setup
	$(PY) examples/demo.py

# pytest exits 5 when it collects nothing; that is not a failure of the code.
test: setup
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

test-slow: setup
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# every model of tests/zoo (the default `make test` runs its fast subset)
test-zoo: setup
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m zoo tests/zoo $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
