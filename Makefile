# Two entry points: `make demo` and `make test`. Both create .venv and install on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: demo selfcheck test lint install clean gpu-check

$(STAMP): pyproject.toml constraints.txt scripts/setup_env.sh scripts/prefix_grpo_autofix.py
	VENV=$(VENV) bash scripts/setup_env.sh
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: lint
	@echo "make test: the whole suite (about 22-24 min on 2 cores, estimated); make test PYTEST_ARGS='-m \"not slow\"' skips the slow tests"
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m app.demo $(DEMO_ARGS)

clean:
	rm -rf outputs .pytest_cache

selfcheck: $(STAMP)
	$(PY) -m app.selfcheck

gpu-check: $(STAMP)
	bash scripts/gpu_check.sh
