# The two commands of the README. Both set everything up on a fresh machine first.
#   make lessons   execute every lesson headless on this machine's hardware -> output/
#   make test      lint + unit tests + every lesson under papermill
VENV ?= .venv
PY := $(VENV)/bin/python
LESSONS ?=
ARGS ?=

.PHONY: setup lessons test lint strip clean

setup:
	@bash scripts/bootstrap.sh $(VENV)

lessons: setup
	$(PY) -m tutorial_lib.harness.notebooks run $(LESSONS) $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest $(ARGS)

strip: setup
	$(PY) -m tutorial_lib.harness.notebooks strip notebooks/*.ipynb

clean:
	rm -rf output .pytest_cache
