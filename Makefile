# The README's two commands: `make run` and `make test`. Both start with `make install`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install run test test-fast lint clean

install: $(STAMP)

# The lock pins the whole tree, torch==2.13.0 included (an unpinned torch pulls a CUDA build).
$(STAMP): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.lock
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

run: install
	$(BIN)/dynaplane up

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -m "not integration and not browser"

clean:
	rm -rf $(VENV) var .pytest_cache .hypothesis
