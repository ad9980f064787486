#!/usr/bin/env bash
# Make the venv bench/xla_clock_maxtext.py runs in: MaxText 0.2.5 + jax[tpu] 0.12.0.1 (libtpu
# 0.0.50.1) on Python 3.12, for deviceless XLA:TPU compiles on a CPU-only machine.
#
#   bash bench/xla_clock_venv.sh .venv-maxtext     # then .venv-maxtext/bin/python bench/xla_clock_maxtext.py ...
#
# Idempotent: a marker holding the lock's hash skips the install when nothing changed. Prints one line.
#
# Why a lock installed with --no-deps: maxtext 0.2.5 on PyPI declares no base dependencies, and its
# `tpu` extra pulls ~250 packages (datasets, tensorboard, gcloud, ...). The lock is the set that
# `import maxtext.trainers.pre_train.train_compile` needs, found by installing what each ImportError
# named (absl-py flax optax orbax-checkpoint omegaconf pydantic packaging pathwaysutils jinja2 qwix
# aqtp tokamax huggingface-hub transformers grain drjax pillow tiktoken sentencepiece sympy) and
# then freezing. No torch: transformers only warns that it is missing.
set -euo pipefail

VENV=${1:?usage: $0 VENV_DIR}
PYTHON=${PYTHON:-/root/.pyenv/versions/3.12.1/bin/python3.12}  # the interpreter itself, not the pyenv shim

LOCK="jax[tpu]==0.12.0.1 jaxlib==0.12.0.1 libtpu==0.0.50.1 maxtext==0.2.5
absl-py==2.5.1 aiofiles==25.1.0 aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0
annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 aqtp==0.9.0 array_record==0.8.6
attrs==26.1.0 certifi==2026.10.19.post1 cffi==2.1.1 charset-normalizer==3.5.3 cheroot==11.1.2
click==8.5.1 cloudpickle==3.1.3 cryptography==50.0.2 decorator==5.3.1 drjax==0.2.1 duckdb==2.0.1
einshape==1.0 etils==1.15.0 fastapi==0.165.0 filelock==4.3.1 fire==0.7.1 flax==0.12.12
frozenlist==1.8.0 fsspec==2026.9.0 gcsfs==2026.10.1 google-api-core==2.44.0 google-auth==2.63.0
google-auth-oauthlib==1.5.0 google-cloud-core==2.8.0 google-cloud-storage==3.17.1
google-cloud-storage-control==1.17.0 google-crc32c==1.9.0 google-resumable-media==2.11.0
googleapis-common-protos==1.76.0 grain==0.2.18 grpc-google-iam-v1==0.14.6 grpcio==1.85.3
grpcio-status==1.85.3 gviz-api==1.10.0 h11==0.16.0 hf-xet==1.8.0 httpcore2==2.16.2 httpx2==2.16.2
huggingface_hub==2.4.0 humanize==4.17.0 idna==3.20 immutabledict==4.3.1 jaraco.functools==4.6.0
jaxtyping==0.3.11 Jinja2==3.1.6 markdown-it-py==4.3.0 MarkupSafe==3.0.4 mdurl==0.1.2
ml_dtypes==0.6.0 more-itertools==11.2.1 mpmath==1.3.0 msgpack==1.2.4 multidict==7.2.1 numpy==2.5.5
oauthlib==4.0.1 omegaconf==2.4.0 opentelemetry-api==1.45.2 opt_einsum==3.4.0 optax==0.2.8
orbax-checkpoint==0.12.8 packaging==26.4 pathwaysutils==0.1.13 pillow==13.0.0 portpicker==1.6.0
prometheus_client==0.26.0 propcache==0.5.4 proto-plus==1.29.0 protobuf==7.36.2 psutil==7.2.2
pyasn1==0.6.5 pyasn1_modules==0.4.2 pycparser==3.12 pydantic==2.14.4 pydantic_core==2.50.5
Pygments==2.21.0 PyYAML==6.0.4 qwix==0.1.8 regex==2026.11.19 requests==2.34.2
requests-oauthlib==2.0.0 rich==15.0.0 safetensors==0.8.0 scipy==1.18.1 sentencepiece==0.2.3
shellingham==1.5.4 simplejson==4.3.0 six==1.17.0 starlette==1.10.0 sympy==1.14.0
tensorboardX==2.6.5 tensorstore==0.1.86 termcolor==3.3.0 tiktoken==0.14.0 tokamax==0.0.17
tokenizers==0.23.3 tqdm==4.70.1 transformers==5.24.0 treescope==0.1.10 truststore==0.10.5
typer==0.29.2 typing-inspection==0.4.5 typing_extensions==4.16.0 urllib3==2.8.0 uvicorn==0.54.0
uvloop==0.23.0 wadler_lindig==0.1.8 Werkzeug==3.1.9 xprof==2.24.2 yarl==1.25.1 zipp==4.1.2"

HASH=$(printf '%s' "$LOCK" | sha256sum | cut -c1-16)
MARKER="$VENV/.xla_clock_installed"
if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$HASH" ]]; then
  echo "xla_clock venv ready: $VENV (already installed, lock $HASH)"
  exit 0
fi

[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
echo '*' > "$VENV/.gitignore"  # keep git from seeing the venv (what python>=3.13's venv does itself)
LOG="$VENV/xla_clock_install.log"
# shellcheck disable=SC2086  # the lock is a whitespace-separated list of requirements
if ! "$VENV/bin/python" -m pip install --no-deps --disable-pip-version-check $LOCK >"$LOG" 2>&1 \
   || ! "$VENV/bin/python" -c "import maxtext.trainers.pre_train.train_compile" >>"$LOG" 2>&1; then
  tail -n 30 "$LOG" >&2
  echo "xla_clock venv: install failed, see $LOG" >&2
  exit 1
fi
echo "$HASH" > "$MARKER"
echo "xla_clock venv ready: $VENV ($("$VENV/bin/python" -c 'import jax, maxtext.version as v; print("jax", jax.__version__, "maxtext", v.__version__)' 2>/dev/null))"
