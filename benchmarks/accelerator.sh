#!/bin/bash
# The checks only an accelerator can make, in one run on one GPU host (results under $OUT):
#   OUT=/tmp/acc bash benchmarks/accelerator.sh
# GPT-2 small and SmolLM2-135M tokens/s and MFU against a hand-written step (bf16), XLA's attention
# against cuDNN's fused kernel, compiled memory of bf16 / cuDNN / remat, and Llama 3.2 1B.
# Then the levers (issue 32: remat policies, scan unrolling, float8, XLA flags, the batch finder)
# as A/B rows, and disttrain against MaxText when a MaxText venv was carried (the GPU host
# reaches no registry). PART=base|levers|peers runs one part. Each run has its own time limit so
# that one slow compile cannot take the others' time.
set -o pipefail
OUT=${OUT:-/tmp/accelerator}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=.92 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c 'import jax, flax, optax, orbax.checkpoint as o, grain; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())'
PART=${PART:-all}
bench() {  # name, limit in seconds, flags...
  local name=$1 limit=$2
  shift 2
  echo "== $name: throughput.py $*"
  timeout "$limit" $py benchmarks/throughput.py --windows=10 --json="$OUT/$name.json" "$@" \
    2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -4
  $py -c 'import json, sys; r = json.load(open(sys.argv[1]))["results"][0]; print({k: r.get(k) for k in ("ratio", "tokens_per_sec", "mfu", "mfu_peak", "peak_flops_per_sec")})' "$OUT/$name.json" 2>/dev/null
}
if [ "$PART" = all ] || [ "$PART" = base ]; then
bench gpt2_xla 100 --model=gpt --size=gpt2_small --precision=bfloat16 --attention=xla
bench gpt2_cudnn 100 --model=gpt --size=gpt2_small --precision=bfloat16 --attention=cudnn
bench smollm2 120 --model=llama --size=smollm2_135m --precision=bfloat16
if [ -z "$SKIP_MEMORY" ]; then
  echo "== memory.py --accelerator"
  timeout 100 $py benchmarks/memory.py --accelerator --json="$OUT/memory.json" 2>&1 | tail -7
fi
bench llama3_1b 200 --model=llama --size=llama3_1b --precision=bfloat16 --remat=full \
  --global_batch_size=8
fi
if [ "$PART" = all ] || [ "$PART" = levers ]; then
  # Remat: what full recomputation costs against the policies that keep the projections.
  for remat in minimal save_attention_out dots_saveable; do
    bench "llama3_1b_$remat" 150 --model=llama --size=llama3_1b --precision=bfloat16 \
      --remat=$remat --global_batch_size=8 --windows=5
  done
  bench llama3_1b_unroll2 150 --model=llama --size=llama3_1b --precision=bfloat16 --remat=full \
    --scan_unroll=2 --global_batch_size=8 --windows=5
  bench llama3_1b_float8 150 --model=llama --size=llama3_1b --precision=bfloat16 --remat=full \
    --matmul=float8 --global_batch_size=8 --windows=5
  # The launcher adds these flags on GPUs; throughput.py does not, so this row sets them itself.
  flags=$($py -c 'from disttrain.parallel import xla_flags; print(xla_flags.merge("", True)[0])')
  XLA_FLAGS="$flags" bench gpt2_xla_flags 100 --model=gpt --size=gpt2_small --precision=bfloat16 \
    --windows=5
  echo "== batch finder: llama3_1b, bf16, remat=full"
  timeout 200 $py -m disttrain.launch.train --find_batch_size --config=launch/configs/llama.py:llama3_1b \
    --config.precision.compute_dtype=bfloat16 --config.model.remat=full 2>&1 | tail -6
fi
if [ "$PART" = all ] || [ "$PART" = peers ]; then
  if [ -x "${PEER_VENV:-$HOME/.cache/disttrain/peers/maxtext}/bin/python" ]; then
    timeout 500 $py benchmarks/peers.py --layouts=1 --size=tiny --precision=bfloat16 \
      --json="$OUT/peers.json" ${PEER_VENV:+--peer_venv=$PEER_VENV} 2>&1 | tail -6
  else
    echo "== peers: unmeasured (no MaxText venv here; this host reaches no registry)"
  fi
fi
