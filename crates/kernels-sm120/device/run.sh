#!/bin/bash
# Device session on a lent GPU machine without a Rust toolchain: run.sh STAGE...
#   kernels  pdserve-kernels compile + check (every kernel against its CPU reference); BENCH=1 adds
#            the decode-attention bandwidth bench
#   models   pdserve-gpu-models arch (tiny checkpoint of each architecture, GPU vs CPU greedy) and
#            logits (random 1B shape, GPU vs CPU logits over 16 steps)
#   speed    pdserve-gpu-models speed (random 8B shape: decode at batch 1 and 64, 2,048-token prefill)
#   model    pdserve-gpu-vs-cpu --model $MODEL_DIR (the default model, imported elsewhere)
#   serve    a random-weight checkpoint of the default model's config (tiny_reference.py write) with
#            its tokenizer files from $BIN/tokenizer, served by pdserve-server --device cuda under 1
#            and 64 concurrent streams (serve_load.py)
# Binaries (built here, stripped) in $BIN (default: beside this script); outputs in $OUT.
set -u
B=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$B/../../.." && pwd)
BIN=${BIN:-$B}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
find_lib() {
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
    f=$(ls $d/$1.so* 2>/dev/null | sort | tail -1); [ -n "$f" ] && { echo "$f"; return; }
  done
  find / -xdev -name "$1.so*" 2>/dev/null | sort | tail -1
}
L=/tmp/cudalib; mkdir -p $L
NVRTC=$(find_lib libnvrtc); CUBLAS=$(find_lib libcublas)
echo "nvrtc: $NVRTC"; echo "cublas: $CUBLAS"
ln -sf "$NVRTC" $L/libnvrtc.so; ln -sf "$CUBLAS" $L/libcublas.so
export LD_LIBRARY_PATH=$L:$(dirname "$NVRTC"):$(dirname "$CUBLAS"):/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    kernels)
      "$BIN/pdserve-kernels" compile sm_90 > "$OUT/compile-device.txt" 2>&1; echo "compile rc=$?"
      timeout 240 "$BIN/pdserve-kernels" check > "$OUT/check.txt" 2>&1; echo "check rc=$?"; tail -8 "$OUT/check.txt"
      [ "${BENCH:-0}" = 1 ] && timeout 240 "$BIN/pdserve-kernels" bench 2>&1 | tee "$OUT/bench.txt" ;;
    models)
      timeout 240 "$BIN/pdserve-gpu-models" arch "$ROOT/crates/model/tests/fixtures/tiny_reference.py" 2>&1 | tee "$OUT/arch.txt"
      timeout 300 "$BIN/pdserve-gpu-models" logits 16 2>&1 | tee "$OUT/logits.txt" ;;
    speed)
      timeout 300 "$BIN/pdserve-gpu-models" speed 2>&1 | tee "$OUT/speed.txt" ;;
    model)
      timeout 300 "$BIN/pdserve-gpu-vs-cpu" --model "$MODEL_DIR" 2>&1 | tee "$OUT/model.txt" ;;
    serve)
      M=/tmp/random-default-shape
      python3 "$ROOT/crates/model/tests/fixtures/tiny_reference.py" write $M "$(cat "$BIN/tokenizer/config.json")"
      cp "$BIN"/tokenizer/tokenizer*.json $M/
      timeout 300 python3 "$B/serve_load.py" "$BIN" $M ${STREAMS:-1,64} ${MAX_TOKENS:-128} 2>&1 | tee "$OUT/serve.txt" ;;
  esac
done
echo "=== done $(date +%T)"
