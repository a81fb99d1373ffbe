#!/bin/bash
# The checks only an accelerator can make, in one run on one GPU host (results under $OUT):
#   OUT=/tmp/acc bash benchmarks/accelerator.sh            # every part: about 30 minutes
#   OUT=/tmp/acc PART=levers bash benchmarks/accelerator.sh  # the levers alone: under 9 minutes
#   OUT=/tmp/acc PART=peers,ab,profile bash benchmarks/accelerator.sh  # about 5 minutes (2026-11-28)
# GPT-2 small and SmolLM2-135M tokens/s and MFU against a hand-written step (bf16), XLA's attention
# against cuDNN's fused kernel, compiled memory of bf16 / cuDNN / remat, and Llama 3.2 1B.
# Then the levers (issue 32: remat policies, scan unrolling, float8, XLA flags, the batch finder)
# as A/B rows; the loss and Llama 3.2 1B (ab); where GPT-2 small's step goes (profile, its trace
# back in $OUT); and disttrain against MaxText when a MaxText venv was carried (the GPU host
# reaches no registry, so benchmarks/pack_peer.py packs what MaxText needs beyond the image into
# .peer/maxtext.<cpython>-<machine>.tar.xz: carry .peer and .whl). PART=base|levers|profile|ab|peers, or several
# joined by ',', runs those parts. Each run has its own time limit so that one slow compile cannot
# take the others' time.
set -o pipefail
OUT=${OUT:-/tmp/accelerator}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=.92 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c 'import jax, flax, optax, orbax.checkpoint as o, grain; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())'
PART=${PART:-all}
part() { [ "$PART" = all ] || [[ ",$PART," == *",$1,"* ]]; }
bench() {  # name, limit in seconds, flags...
  local name=$1 limit=$2
  shift 2
  echo "== $name: throughput.py $*"
  rm -f "$OUT/$name.json"  # a run that fails leaves no result, not the last call's
  timeout "$limit" $py benchmarks/throughput.py --windows=10 --json="$OUT/$name.json" "$@" \
    2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -4
  $py -c 'import json, sys; r = json.load(open(sys.argv[1]))["results"][0]; print({k: r.get(k) for k in ("ratio", "tokens_per_sec", "mfu", "mfu_peak", "peak_flops_per_sec")})' "$OUT/$name.json" 2>/dev/null
}
if part base; then
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
if part levers; then
  # The levers as A/B rows of benchmarks/levers.py (one process per model, variants in turn, no
  # hand-written side): fits a 15-minute lease. LEVERS_SEC bounds the part; each run gets at most
  # what is left.
  t0=$SECONDS budget=${LEVERS_SEC:-520}
  left() { local l=$((budget - (SECONDS - t0))); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
  levers() {  # name, limit, flags...
    local name=$1 limit; limit=$(left "$2"); shift 2
    [ "$limit" -lt 20 ] && { echo "== $name: skipped (part budget spent)"; return 1; }
    echo "== $name (limit ${limit}s): levers.py $*"
    rm -f "$OUT/$name.json"
    timeout "$limit" $py benchmarks/levers.py --json="$OUT/$name.json" "$@" 2>&1 \
      | grep -v "^WARNING\|^I0000\|^W0000\|^E0000" | tail -12
  }
  # XLA flags the launcher adds on GPUs, off and on (levers.py, like throughput.py, adds none).
  flags=$($py -c 'from disttrain.parallel import xla_flags; print(xla_flags.merge("", True)[0])')
  gpt=(--config=launch/configs/gpt.py:${GPT:-gpt2_small} --set=precision.compute_dtype=bfloat16
       --windows=4 --window_sec=0.75)
  levers gpt2_flags_off 75 "${gpt[@]}" --variants='global_batch_size=32'
  XLA_FLAGS="$flags" levers gpt2_flags_on 120 "${gpt[@]}" \
    --variants='global_batch_size=32;global_batch_size=64;global_batch_size=64,model.remat=minimal'
  # Llama 3.2 1B: full remat (what the base part measures) against the policies that keep more,
  # scan unrolling and float8 projections; with the launcher's flags where they ran above.
  $py -c 'import json, sys; assert "error" not in json.load(open(sys.argv[1]))["results"][0]' \
    "$OUT/gpt2_flags_on.json" 2>/dev/null && export XLA_FLAGS="$flags"
  levers llama3_1b 330 --config=launch/configs/llama.py:${LLAMA:-llama3_1b} --windows=4 --window_sec=0.75 \
    --set=precision.compute_dtype=bfloat16,global_batch_size=8 --variants="model.remat=full;\
model.remat=full,precision.matmul=float8;model.remat=minimal;model.remat=save_attention_out;\
model.remat=dots_saveable;model.remat=full,model.scan_unroll=2;model.remat=minimal,precision.matmul=float8"
  unset XLA_FLAGS
  limit=$(left 120)
  if [ "$limit" -ge 30 ]; then
    echo "== batch finder (limit ${limit}s): gpt2_small, bf16, remat=none"
    timeout "$limit" $py -m disttrain.launch.train --find_batch_size \
      --config=launch/configs/gpt.py:${GPT:-gpt2_small} --config.precision.compute_dtype=bfloat16 \
      2>&1 | grep -v "^WARNING\|^I0000\|^W0000\|^E0000" | tail -8
  fi
fi
if part profile; then
  # Where GPT-2 small's step time goes on this GPU: 3 traced steps of the launcher's run (batch 64,
  # remat minimal), per kind of operation and the busiest operations; the trace comes back too.
  echo "== profile: gpt2_small, batch 64, bf16, remat minimal, steps 16-18 traced"
  timeout 150 $py -m disttrain.launch.train --config=launch/configs/gpt.py:${GPT:-gpt2_small} \
    --workdir=/tmp/profile_gpt2 --config.data.name=synthetic_tokens --config.global_batch_size=64 \
    --config.precision.compute_dtype=bfloat16 --config.model.remat=minimal \
    --config.num_train_steps=20 --config.log_every_steps=5 --config.eval_every_steps=0 \
    --config.checkpoint_every_steps=0 --config.profile.start_step=16 --config.profile.num_steps=3 \
    2>&1 | grep -v "^WARNING\|^I0000\|^W0000\|^E0000" | tail -3
  timeout 60 $py benchmarks/op_profile.py /tmp/profile_gpt2 2>&1 | tail -14
  find /tmp/profile_gpt2 -name '*.xplane.pb' -size -16M -exec cp {} "$OUT/gpt2_profile.xplane.pb" \;
fi
if part ab; then
  # The loss on GPUs: chunked (model.loss_chunk=0, each chunk's gradients made in its forward
  # pass) against the whole [B, T, V] logits (-1), and Llama 3.2 1B at the chunked default.
  # (--xla_gpu_enable_triton_gemm=false, MaxText's GPU recipes' flag, measured 0.95x on 2026-11-28.)
  flags=$($py -c 'from disttrain.parallel import xla_flags; print(xla_flags.merge("", True)[0])')
  ab() {  # name, limit, config, --set, variants
    echo "== ab $1: $3 $4"
    rm -f "$OUT/ab_$1.json"
    XLA_FLAGS="$flags" timeout "$2" $py benchmarks/levers.py --json="$OUT/ab_$1.json" \
      --config="$3" --windows=4 --window_sec=0.75 --set="$4" --variants="$5" 2>&1 \
      | grep -v "^WARNING\|^I0000\|^W0000\|^E0000" | tail -4
  }
  ab gpt2 90 launch/configs/gpt.py:${GPT:-gpt2_small} \
    precision.compute_dtype=bfloat16,global_batch_size=64,model.remat=minimal \
    "model.loss_chunk=0;model.loss_chunk=-1"
  ab smollm2 100 launch/configs/llama.py:${SMOL:-smollm2_135m} \
    precision.compute_dtype=bfloat16,global_batch_size=32,model.remat=minimal \
    "model.loss_chunk=0;model.loss_chunk=-1"
  ab llama3_1b 150 launch/configs/llama.py:${LLAMA:-llama3_1b} \
    precision.compute_dtype=bfloat16,global_batch_size=16,model.remat=minimal \
    "precision.matmul=default;precision.matmul=float8"
fi
if part peers; then
  venv=${PEER_VENV:-$HOME/.cache/disttrain/peers/maxtext}
  # benchmarks/pack_peer.py's archive for this host's CPython and machine (its compiled modules)
  read -r major minor machine < <($py -c 'import os, sys; print(*sys.version_info[:2], os.uname().machine)')
  tag=cp$major$minor-$machine
  pack=.peer/maxtext.$tag.tar.xz
  if [ ! -x "$venv/bin/python" ] && [ -f "$pack" ]; then
    venv=/tmp/maxtext-peer
    site=$venv/lib/python$major.$minor/site-packages
    if mkdir -p "$site" "$venv/bin" && tar -xJf "$pack" -C "$site"; then
      printf '#!/bin/sh\nPYTHONPATH="%s:$PYTHONPATH" exec "%s" "$@"\n' "$site" \
        "$(realpath -s "$(command -v "$py")")" > "$venv/bin/python" && chmod +x "$venv/bin/python"
    else
      echo "== peers: could not unpack $pack"
    fi
  elif [ ! -x "$venv/bin/python" ] && ls .peer/maxtext.*.tar.xz >/dev/null 2>&1; then
    echo "== peers: .peer holds $(ls .peer) but this host is $tag: pack again for it"
  fi
  if [ -x "$venv/bin/python" ]; then
    # SmolLM2-135M (tied embeddings, as peers.py maps them), 32 x 2,048, each side's cuDNN attention;
    # PEER_PROFILE=1 adds a traced run per side and their op_profile table (about 2 minutes)
    echo "== peers: disttrain against MaxText, ${PEER_SIZE:-smollm2_135m}, one GPU"
    rm -f "$OUT/peers.json"
    timeout ${PEER_SEC:-$([ "$PEER_PROFILE" = 1 ] && echo 500 || echo 300)} $py benchmarks/peers.py --peer_venv="$venv" --layouts=1 \
      --size=${PEER_SIZE:-smollm2_135m} --global_batch_size=32 --seq_len=${PEER_SEQ:-2048} \
      --precision=bfloat16 --remat=minimal --pairs=${PEER_PAIRS:-1} --steps=50 --warmup=15 \
      --timeout=140 --json="$OUT/peers.json" $([ "$PEER_PROFILE" = 1 ] && echo --profile) 2>&1 | grep -v "^WARNING\|^I0000\|^W0000\|^E0000" | tail -30
  else
    echo "== peers: unmeasured (no MaxText venv and no .peer/maxtext.$tag.tar.xz; see pack_peer.py)"
  fi
fi
