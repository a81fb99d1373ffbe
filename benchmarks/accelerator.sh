#!/bin/bash
# The checks only an accelerator can make, in one run on one GPU host (results under $OUT):
#   OUT=/tmp/acc bash benchmarks/accelerator.sh
# GPT-2 small and SmolLM2-135M tokens/s and MFU against a hand-written step (bf16), XLA's attention
# against cuDNN's fused kernel, compiled memory of bf16 / cuDNN / remat, and Llama 3.2 1B.
# Each run has its own time limit so that one slow compile cannot take the others' time.
set -o pipefail
OUT=${OUT:-/tmp/accelerator}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=.92 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c 'import jax, flax, optax, orbax.checkpoint as o, grain; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())'
bench() {  # name, limit in seconds, flags...
  local name=$1 limit=$2
  shift 2
  echo "== $name: throughput.py $*"
  timeout "$limit" $py benchmarks/throughput.py --windows=10 --json="$OUT/$name.json" "$@" \
    2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -4
  $py -c 'import json, sys; r = json.load(open(sys.argv[1]))["results"][0]; print({k: r.get(k) for k in ("ratio", "tokens_per_sec", "mfu", "mfu_peak", "peak_flops_per_sec")})' "$OUT/$name.json" 2>/dev/null
}
bench gpt2_xla 100 --model=gpt --size=gpt2_small --precision=bfloat16 --attention=xla
bench gpt2_cudnn 100 --model=gpt --size=gpt2_small --precision=bfloat16 --attention=cudnn
bench smollm2 120 --model=llama --size=smollm2_135m --precision=bfloat16
if [ -z "$SKIP_MEMORY" ]; then
  echo "== memory.py --accelerator"
  timeout 100 $py benchmarks/memory.py --accelerator --json="$OUT/memory.json" 2>&1 | tail -7
fi
bench llama3_1b 200 --model=llama --size=llama3_1b --precision=bfloat16 --remat=full \
  --global_batch_size=8
