# Every target installs what it needs: a venv in .venv with `pip install -e .[dev]`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Tests and benchmarks simulate an 8-device mesh on the CPU.
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: test demo bench install clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

test: install
	$(PY) -m pytest -q

# The main job until training lands (issue 5): plan published models without allocating them.
demo: install
	$(PY) -m llama_jax.info llama3-8b --seq 8192
	$(PY) -m llama_jax.info llama3.1-405b --batch 8 --seq 32768

bench: install
	$(PY) bench/compile_time.py --unrolled
	$(PY) bench/load_memory.py
	$(PY) bench/decode.py

clean:
	rm -rf $(VENV) .pytest_cache
