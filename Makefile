# Two commands for a fresh machine: `make demo` and `make test`.
# Both set up a venv first; set-up is skipped when pyproject.toml has not changed.
# Release: `make dist` (sdist + wheel in dist/, fails on any build warning) and
# `make smoke` (that wheel installed in a fresh venv, exercised from outside the tree).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The tested versions: the lower bounds in pyproject.toml (README, "Tested versions").
# They are installed before the package, so its ranges are already satisfied and pip
# never resolves `torch` against the index (that would pull a multi-GB CUDA build);
# torch==2.13.0 is taken from the CPU wheel on local disk.
TORCH        ?= torch==2.13.0
TRITON       ?= triton==3.8.0
TRANSFORMERS ?= transformers==5.24.0
PINNED       := "$(TORCH)" "$(TRITON)" "$(TRANSFORMERS)"
# the training programs the tests run through (dev extra), tested versions first for the same reason
CLIENTS      ?= accelerate==1.15.0 peft==0.21.2 torchtitan==0.3.0
# the other code bases whose models the tests build (dev extra), tested versions first likewise
MODEL_CODE   ?= x-transformers==2.31.10 diffusers==0.42.1 torchao==0.18.0
PYTEST_WORKERS ?= 2
export TORCH TRITON TRANSFORMERS

.PHONY: setup demo test test-newest test-slow test-zoo smoke dist bench docs clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PINNED)
	$(PY) -m pip install -q $(CLIENTS) $(MODEL_CODE)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: setup
	$(PY) examples/demo.py

# pytest exits 5 when it collects nothing; that is not a failure of the code.
test: setup
	$(PY) -m pytest -q -rs -n $(PYTEST_WORKERS) $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

test-slow: setup
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# every model of tests/zoo (the default `make test` runs its fast subset)
test-zoo: setup
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m zoo tests/zoo $(PYTEST_ARGS)

# sdist, then the wheel built from it (so a file missing from the sdist breaks the wheel);
# any warning of the build backend fails the target (pip's own notes, in capitals, are not its).
dist: setup
	rm -rf dist && mkdir dist
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m build --outdir dist . > dist/build.log 2>&1 || { cat dist/build.log; exit 1; }
	@grep -E '^Successfully built' dist/build.log
	@! grep -E '[Ww]arning|[Dd]eprecat' dist/build.log || { echo "make dist: the build warned (dist/build.log)"; exit 1; }

# The built wheel, not the checkout: fresh venv, runtime extras only, run from a temp dir.
smoke: dist
	$(PYTHON) scripts/wheel_smoke.py dist/normfuse-*.whl $(PINNED)

bench: setup
	$(PY) benchmarks/run_all.py

# The newest transformers release, in a venv of its own beside the pinned torch, triton and
# clients: the tests that run transformers' code (the zoo's fast subset, HF models through the
# pass, the real training clients, checkpointing, generate, export and saved models, several
# models in one process). A release that breaks normfuse fails here before a user meets it.
NEWEST_VENV  ?= .venv-newest
NEWEST_PY    := $(NEWEST_VENV)/bin/python
NEWEST_TESTS ?= tests/zoo/test_zoo.py tests/test_pass_hf.py tests/test_clients.py tests/test_regions.py \
                tests/test_boundary.py tests/test_deployment.py tests/test_training.py tests/test_many_models.py \
                tests/test_qk_rope_pass.py tests/test_audit.py tests/test_checkpoint_side_effects.py \
                tests/test_hyper_connections.py

# The newest release is named explicitly and resolved with everything else in one step: installed
# after the clients, `--upgrade transformers` was undone by the package's own install (torchtitan's
# datasets pins huggingface-hub below what transformers 5.25 needs, and pip took transformers back).
test-newest:
	test -x $(NEWEST_PY) || $(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_PY) -m pip install -q --upgrade pip
	newest=$$($(NEWEST_PY) -m pip index versions transformers 2>/dev/null | sed -n 's/^transformers (\(.*\))$$/\1/p'); \
	test -n "$$newest" || { echo "test-newest: no transformers release found on the index"; exit 1; }; \
	$(NEWEST_PY) -m pip install -q "$(TORCH)" "$(TRITON)" $(CLIENTS) $(MODEL_CODE) "transformers==$$newest" && \
	$(NEWEST_PY) -m pip install -q -e ".[dev]" && \
	$(NEWEST_PY) -c "import sys, torch, transformers; print('newest-release job: transformers', transformers.__version__, \
	'torch', torch.__version__); sys.exit(transformers.__version__ != '$$newest')"
	$(NEWEST_PY) -m pytest -q -rs -n $(PYTEST_WORKERS) $(NEWEST_TESTS) $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

# The documentation site (mkdocs.yml: README.md and docs/) into site/; --strict makes any
# warning fail the build: a broken link, image or anchor, a page missing from the nav.
docs: $(VENV)/.installed-docs
	$(PY) -m mkdocs build --strict --site-dir site

$(VENV)/.installed-docs: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

clean:
	rm -rf $(VENV) $(NEWEST_VENV) build dist site *.egg-info
