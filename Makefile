# Gates: lint, types, tests. `make all` runs all three.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: all install lint types test bench demo settings-docs

all: lint types test

$(PY):
	python3 -m venv $(VENV)

install: $(PY)
	$(PY) -m pip install -q -e '.[dev]'

lint:
	$(PY) -m ruff check rlmq common producer workers tests bench
	$(PY) -m ruff format --check rlmq common producer workers tests bench

types:
	$(PY) -m mypy

test:
	$(PY) -m pytest -q -n 4 --dist loadfile

bench:
	$(PY) -m bench.queue_path

demo:
	$(VENV)/bin/rlmq demo --output rows.jsonl

# docs/settings.md is generated from common/settings/ (a test fails when they differ).
settings-docs:
	$(PY) -m rlmq.common.settings.schema > docs/settings.md
