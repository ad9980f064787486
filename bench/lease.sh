#!/usr/bin/env bash
# The GPU measurements, in calls that each fit a 10-minute command on a lent H100/H200, in the
# order they are worth running (device time is short). On the device machine, from the
# repository root:
#
#   bash bench/lease.sh               # ~7 min, the plan to run first (the `clock` stage):
#                                     #   training (cuDNN; its remat policies dots_with_attention
#                                     #   and full) and decode (scan, unrolled, unrolled int8, the
#                                     #   scan with XLA's dynamic-slice fusion) vs
#                                     #   transformers, each of our programs saved as XLA
#                                     #   optimized it (hlo.tar.gz), priced by XLA's GPU cost
#                                     #   model against the measured step (bench/gpu_clock.py)
#   bash bench/lease.sh profile       # ~4 min: where the training step and a decode step go
#   bash bench/lease.sh train         # ~7 min: bench/gpu.py training, every run vs transformers
#   bash bench/lease.sh decode        # ~5 min: bench/gpu.py decode, every run vs the floor
#   bash bench/lease.sh correctness   # ~7 min: bench/gpu.py's checks against references
#   bash bench/lease.sh 8b            # ~6 min: LLaMA-3-8B decode (training when it fits)
#   bash bench/lease.sh aot           # ~3 min: the deviceless GPU compile against the device's
#                                     #   own; saves the device's target description
#   bash bench/lease.sh speculate     # ~3 min: bench/speculate.py, the verify pass on the
#                                     #   GPU model and prompt lookup / a draft on the demo model
#   bash bench/lease.sh attention     # ~1 min: a decode step's attention, the XLA path against
#                                     #   cuDNN's fused call on the cache as it is: right, and
#                                     #   faster? (bench/decode_attention.py)
#   bash bench/lease.sh grammar       # ~4 min: constrained decoding's cost on the demo model
#                                     #   (bench/grammar.py --decode --serve): is the host's
#                                     #   mask hidden behind the GPU's forward?
#
# `speculate` and `grammar` read .lease/ (carried; git ignores it), which `bash bench/lease.sh
# prepare` (with .venv's python, or $PYTHON) makes here from `make demo` and `make
# demo-draft`: their last checkpoints without the optimizer state, and the benchmark's
# prompts from the demo corpus (not on the device).
#
# Python packages the machine's image lacks travel as wheels in .whl/ (carried; git ignores
# it), installed first when present: `prepare` downloads them for the device's Python 3.12 at
# .venv's versions (2026-11-29: .lease 41 MB and .whl 14 MB, with the repository ~59 MB of
# the 64 MiB a call carries). Without them every stage that trains stops at `import grain`.
# Results go under $OUT/STAGE (JSON, tables). In the profile stage a failing profile is
# reported and the next one runs.
set -euo pipefail
stages="clock profile train decode correctness 8b aot speculate attention grammar prepare"
# What the device's image (Python 3.12, its package list in the device notes, 2026-11) lacks of
# what training, the grammar library and the server import, with their own needs: pip download
# --no-deps resolves none of them.
device_lacks="grain array-record portpicker tensorboardX llguidance fastapi starlette pydantic
  pydantic-core typing-inspection annotated-types uvicorn openai httpx2 httpcore2 truststore
  jiter sniffio opentelemetry-api"
stage=${1:-clock}
if [[ -z $stage || $stage == *" "* || " $stages " != *" $stage "* ]]; then
  echo "usage: bash bench/lease.sh STAGE, STAGE one of: $stages" >&2
  exit 2
fi
if [[ $stage == prepare ]]; then  # here, not on the device
  rm -rf .lease
  for run in demo demo-draft; do
    step=$(ls "runs/$run/checkpoints" | sort -n | tail -1)
    mkdir -p ".lease/$run/checkpoints/$step"
    cp "runs/$run/config.yaml" "runs/$run/tokenizer.model" ".lease/$run/"
    for part in "runs/$run/checkpoints/$step"/*; do
      [[ $(basename "$part") == opt_state ]] || cp -r "$part" ".lease/$run/checkpoints/$step/"
    done
  done
  "${PYTHON:-.venv/bin/python}" bench/speculate.py --checkpoint runs/demo --save-prompts .lease/prompts.json
  rm -rf .whl
  # shellcheck disable=SC2086  # one name a word
  pins=$("${PYTHON:-.venv/bin/python}" -c 'import importlib.metadata as m, sys
print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' $device_lacks)
  platforms=""
  for tag in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 \
      manylinux_2_28 manylinux_2_31 manylinux_2_34; do
    platforms+=" --platform ${tag}_x86_64"
  done
  # shellcheck disable=SC2086
  "${PYTHON:-.venv/bin/python}" -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp $platforms -d .whl $pins
  du -sh .lease .whl
  exit
fi
out=${OUT:-.}/$stage
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

# Runs a profile; a failure is reported and the stage goes on.
profile() { "$@" || echo "FAILED ($?): $*"; }

case $stage in
  clock)
    # XLA's GPU cost model writes its estimate into each fusion's backend config; an unknown
    # flag would stop every child, so it is tried first.
    cost=--xla_gpu_collect_cost_model_stats=true
    if XLA_FLAGS=$cost python3 -c "import jax; jax.jit(lambda x: x + 1)(1.0)"; then
      export XLA_FLAGS="${XLA_FLAGS:-} $cost"
    else
      echo "this XLA lacks $cost: the programs are saved without its estimates"
    fi
    rm -rf /tmp/lease-hlo
    python3 bench/gpu.py --sections train decode --out "$out" --dump /tmp/lease-hlo \
      --train-runs cudnn cudnn+remat=dots_with_attention cudnn+remat=full transformers \
      --decode-runs scan unrolled unrolled:int8/bfloat16 "scan +slice-fusion" transformers
    (cd /tmp/lease-hlo && find . -name '*after_optimizations.txt' -print0 |
       tar --null -czf "$out/hlo.tar.gz" -T -)
    python3 bench/gpu_clock.py "$out" ;;
  profile)
    profile python3 bench/profile_step.py --impl cudnn --out "$out/step"
    profile python3 bench/profile_step.py --impl cudnn --set remat=dots_with_attention \
      --out "$out/step-dots-attn"
    for impl in scan unrolled; do
      for batch in 1 8; do
        profile python3 bench/profile_decode.py --impl $impl --batch $batch \
          --out "$out/decode-$impl-$batch"
      done
    done
    LLAMA_JAX_GPU_FLAGS=0 profile python3 bench/profile_decode.py --impl scan \
      --batch 1 --out "$out/decode-scan-1-noflags" ;;
  train|decode|correctness)
    python3 bench/gpu.py --sections "$stage" --out "$out" ;;
  8b)
    python3 bench/gpu.py --plan llama3-8b --sections train decode --out "$out" ;;
  aot)
    python3 bench/aot_gpu.py --out "$out" ;;
  speculate)
    mkdir -p "$out"
    python3 bench/speculate.py --verify-model gpu --verify-k 2 8 15 --rounds 3 \
      --checkpoint .lease/demo --draft .lease/demo-draft --prompts .lease/prompts.json \
      --out "$out/speculate.json" ;;
  attention)
    python3 bench/decode_attention.py --out "$out/decode_attention.json" ;;
  grammar)
    mkdir -p "$out"
    python3 bench/grammar.py --decode .lease/demo --serve .lease/demo --rounds 5 \
      --no-libraries | tee "$out/grammar.md" ;;
esac
