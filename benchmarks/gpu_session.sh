#!/usr/bin/env bash
# A GPU session in one bounded call (at most 10 minutes on an H200), run from the repository's root:
#
#   OUT=/some/folder bash benchmarks/gpu_session.sh            # on the device machine, $OUT set by its tool
#   OUT=/tmp/dry DRY_RUN=1 bash benchmarks/gpu_session.sh      # anywhere: the same steps, each a few seconds, on a CPU
#
# Each step has its own time limit, and the limits add up to under 10 minutes; a step that fails or runs out of
# time leaves the others to run. Everything goes under $OUT, at most 8 files (the device tool's limit):
#   session.log                          every step's output, with its exit status
#   kernels.txt                          kernels per bf16 step at the base shape, ours and MarianMTModel's
#   gpu-smoke-<date>-<device>.json/.md   base and big, TF32 and bf16, ours beside Marian
#   compiled/gpu-smoke-<date>-<device>.json/.md   base, bf16: the step eager and compiled (default, reduce-overhead)
#   ddp-one-device-<date>-<device>.json/.md   two DDP processes on GPU 0: train, --resume, --average-last
# Wheels of packages the machine lacks go in .whl/ (docs: /work/.library/device/README.md) and are installed first.
set -u
: "${OUT:?set OUT to the folder the results go to}"
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$OUT"
LOG="$OUT/session.log"
PYTHON=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 || { echo "wheels: install failed" >>"$LOG"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
fi

if [ "${DRY_RUN:-0}" = 1 ]; then  # the CPU's stand-ins: each command's arguments checked, nothing long
  DEVICE=cpu; SMOKE=(--device cpu --quick --skip tests synchronisations compiled fsdp); KERNELS=(--device cpu --quick)
  COMPILED=(--device cpu --quick --compile-shapes 1 --compile-modes default)
  TESTS=(--collect-only -q tests/gpu/test_gpu.py)
else
  DEVICE=cuda; SMOKE=(--skip tests compiled fsdp); KERNELS=(--device cuda)
  COMPILED=(--presets base --compile-shapes 2 --compile-modes default reduce-overhead)
  TESTS=(-q -x --durations=5 tests/gpu/test_gpu.py)
fi

step() {  # step NAME SECONDS COMMAND...: run it under its limit, its output and exit status into the log
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit} s): $*" >>"$LOG"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  echo "=== $name: exit $? after $((SECONDS - start)) s" >>"$LOG"
}

step environment 20 "$PYTHON" -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPU', torch.cuda.is_available() and torch.cuda.get_device_name(), 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
step gpu-tests 120 "$PYTHON" -m pytest -p no:cacheprovider "${TESTS[@]}"
step kernels 30 sh -c "\"$PYTHON\" -m benchmarks.kernels ${KERNELS[*]} --top 10 >\"$OUT/kernels.txt\""
step gpu-smoke 150 "$PYTHON" -m benchmarks.gpu_smoke "${SMOKE[@]}" --output-dir "$OUT"
step compiled-step 140 "$PYTHON" -m benchmarks.gpu_smoke "${COMPILED[@]}" --skip tests synchronisations throughput fsdp --output-dir "$OUT/compiled"
step ddp-one-device 110 "$PYTHON" -m benchmarks.ddp_one_device --device "$DEVICE" --timeout 60 --output-dir "$OUT"
ls -l "$OUT" >>"$LOG"
