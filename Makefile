# vramcast — one command each for the things people do.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run docs test lint typecheck unit bench traces openapi clean

# The client distribution (clients/python) first on the command line: the service depends on
# it, and pip takes this local copy rather than looking for one on an index.
$(STAMP): pyproject.toml clients/python/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ./clients/python -e '.[dev,trace]'
	touch $(STAMP)

# The service on the embedded SQLite default (VRAMCAST_DATABASE_URL overrides), at
# http://127.0.0.1:8000 (VRAMCAST_HOST, VRAMCAST_PORT), interactive docs at /docs.
run: $(STAMP) docs
	mkdir -p var
	if [ -d migrations ] && { [ -f alembic.ini ] || grep -q '^\[tool\.alembic\]' pyproject.toml; }; then \
		$(BIN)/alembic upgrade head; \
	fi
	$(BIN)/vramcast serve

# The manual (docs/, mkdocs.yml), served by the service at /manual/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet -d service/web/manual

openapi: $(STAMP)
	$(BIN)/python -m service.openapi

# The client's job models (clients/python/src/vramcast_client/_generated.py), from the
# committed openapi/openapi.json.
.PHONY: client-models
client-models: $(STAMP)
	$(BIN)/python -m service.openapi --client

lint: $(STAMP)
	$(BIN)/ruff check service clients tests bench
	$(BIN)/ruff format --check service clients tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

# Two workers (pytest-xdist). The schema-generated module runs on its own afterwards: its
# schemathesis items share one node id per test, which xdist cannot hand out, and it counts
# the cases of the whole module.
FUZZ := tests/api/test_fuzz.py
unit: $(STAMP)
	$(BIN)/pytest -q -n 2 --ignore=$(FUZZ)
	$(BIN)/pytest -q $(FUZZ)

test: lint typecheck unit

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
