# The commands of the README. Each sets up what it needs on a fresh machine first (scripts/bootstrap.sh:
# reuses the torch you already have, see its header).
#   make lessons   execute every lesson headless on this machine's hardware -> output/
#   make lab       open the lessons in JupyterLab
#   make test      lint + unit tests + every lesson under papermill
VENV ?= .venv
PY := $(VENV)/bin/python
LESSONS ?=
ARGS ?=

.PHONY: setup setup-lab setup-dev lessons lab test lint strip clean

setup:
	@bash scripts/bootstrap.sh $(VENV)

setup-lab:
	@bash scripts/bootstrap.sh $(VENV) lab

setup-dev:
	@bash scripts/bootstrap.sh $(VENV) dev

lessons: setup
	$(PY) -m tutorial_lib.harness.notebooks run $(LESSONS) $(ARGS)

# Tools run as modules of $(PY), never as $(VENV)/bin scripts: a venv that reuses another environment's
# packages (scripts/bootstrap.sh) gets no scripts for what that environment already has.
lab: setup-lab
	$(PY) -m jupyterlab notebooks/ $(ARGS)

lint: setup-dev
	$(PY) -m ruff check .
	$(PY) -c "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"

test: lint
	$(PY) -m pytest $(ARGS)

strip: setup
	$(PY) -m tutorial_lib.harness.notebooks strip notebooks/*.ipynb

clean:
	rm -rf output .pytest_cache
