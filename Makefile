# Entry points: `make demo`, `make test` (without the slow tests), `make test-all` (everything; CI). Both create .venv and install on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# two pytest workers, each test module whole on one (its module fixtures built once), longest modules first
# (tests/conftest.py); XDIST= runs on one worker (docs/testing.md has both timed)
XDIST ?= -n 2 --dist loadfile --no-loadscope-reorder
DEMO_ARGS ?=

.PHONY: demo selfcheck test test-all lint install clean gpu-check

$(STAMP): pyproject.toml constraints.txt scripts/setup_env.sh scripts/prefix_grpo_autofix.py
	VENV=$(VENV) bash scripts/setup_env.sh
	touch $(STAMP)

install: $(STAMP)
ifeq ($(INSTALL_FLASH_ATTN),1)
	VENV=$(VENV) bash scripts/setup_env.sh --flash-attn
endif

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: lint
	@echo "make test: the suite without the tests marked slow, on 2 pytest workers (at most 6 minutes on 2 cores; measured times: docs/history.md, structure: docs/testing.md); make test-all runs everything (CI runs it)"
	$(PY) -m compileall -q app tests > /dev/null  # what every launched process imports, compiled once (PYTHONDONTWRITEBYTECODE hosts)
	$(PY) -m pytest -q -m "not slow" $(XDIST) $(PYTEST_ARGS)

test-all: lint
	@echo "make test-all: the whole suite, slow tests included, on 2 pytest workers (at most 30 minutes on 2 cores, CI at most 40 with the install; measured times: docs/history.md)"
	$(PY) -m compileall -q app tests > /dev/null
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m app.demos.video $(DEMO_ARGS)

clean:
	rm -rf outputs .pytest_cache

selfcheck: $(STAMP)
	$(PY) -m app.training.selfcheck

gpu-check: $(STAMP)
	bash scripts/gpu_check.sh
