# Two commands set everything up on a fresh clone:  `make report`  and  `make test`.
VENV ?= .venv
STAMP := $(VENV)/.kvarn-installed

.PHONY: setup demo report test lint format clean

$(STAMP): pyproject.toml scripts/setup.sh
	VENV=$(VENV) bash scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvarn demo

report: $(STAMP)
	$(VENV)/bin/kvarn report

test: $(STAMP)
	VENV=$(VENV) bash scripts/test.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
