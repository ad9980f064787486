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
#
# `speculate` reads .lease/ (carried; git ignores it), which `bash bench/lease.sh prepare`
# (with .venv's python, or $PYTHON) makes here from `make demo` and `make demo-draft`: their
# last checkpoints without the optimizer state, and the benchmark's prompts from the demo
# corpus (not on the device).
#
# Python packages the machine lacks travel as wheels in .whl/ (carried; see the device
# notes): they are installed first when present. Results go under $OUT/STAGE (JSON, tables).
# In the profile stage a failing profile is reported and the next one runs.
set -euo pipefail
stages="clock profile train decode correctness 8b aot speculate prepare"
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
esac
