# `make serve` and `make test` bootstrap .venv on first use (scripts/bootstrap.sh);
# the stamp files make a second run skip the installs.
VENV   := .venv
PY     := $(VENV)/bin/python
ARGS   ?=

.PHONY: serve test lint layers bench clean ray

$(VENV)/.stamp-runtime: pyproject.toml scripts/bootstrap.sh
	scripts/bootstrap.sh
	touch $@

$(VENV)/.stamp-test: pyproject.toml scripts/bootstrap.sh
	scripts/bootstrap.sh --test
	touch $(VENV)/.stamp-runtime $@

# The `ray` extra (several machines): run on every machine of the cluster.
$(VENV)/.stamp-ray: pyproject.toml scripts/bootstrap.sh
	scripts/bootstrap.sh --ray
	touch $(VENV)/.stamp-runtime $@

ray: $(VENV)/.stamp-ray

serve: $(VENV)/.stamp-runtime
	$(VENV)/bin/bargein serve $(ARGS)

# Two pytest-xdist workers, a module (or a shared Ray cluster's tests) at a time, the
# heaviest first (tests/workers.py); `make test WORKERS=0` runs in one process. -rs lists
# every skip with its reason; the run ends with each worker's time by unit of work.
WORKERS ?= 2
XDIST   := $(if $(filter 0,$(WORKERS)),-p no:xdist,-n $(WORKERS) --dist loadgroup)

test: $(VENV)/.stamp-test
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -rs $(XDIST) --durations=30 $(ARGS)

lint: $(VENV)/.stamp-test
	$(VENV)/bin/ruff check bargein tests bench

# The import layers of pyproject.toml's [tool.importlinter] (also the first step of `make test`).
layers: $(VENV)/.stamp-test
	$(VENV)/bin/lint-imports

bench: $(VENV)/.stamp-runtime
	$(VENV)/bin/bargein bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
