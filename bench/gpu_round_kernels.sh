#!/usr/bin/env bash
# One GPU round for issue 21's kernels, from the repository root of the device machine (an H100: python 3.12,
# torch 2.11, triton 3.6), about 6 minutes, outputs under $OUT:
#   1. correctness: the fused layer kernels (Q/K norms + RoPE + KV store, gate/up + SiLU, the projections) at
#      model sizes against their torch twins, the grouped decode path against the plain kernel, and the `gpu`
#      tests of the kernel test files when pytest is there (among them: at most 8 kernels per decode layer);
#   2. shared-prefix attention: each kernel's share of the copy bandwidth for the bytes it must read, beside the
#      gather floor and the contiguous-read ceiling, W1 and gsp geometries, Qwen3-8B and -0.6B shapes;
#   3. kernels per decode layer and decode-step times (Qwen3-8B and -0.6B shapes, random weights) with each fusion
#      and cuBLAS split-K on and off, and the fused steps' logits against the unfused step's;
#   4. the gate/up + SiLU kernel against cuBLAS + SiLU-and-mul by row count, with a tile sweep.
# Each step gets at most its cap, and no more than what is left of BUDGET seconds. radixserve's layers import msgspec
# (radixserve/forward_context.py -> protocol.py): .whl/msgspec-*.whl is installed when it is missing.
#
#     bash bench/gpu_round_kernels.sh
set -u
OUT=${OUT:-/tmp/gpu-round-kernels}
BUDGET=${BUDGET:-350}
mkdir -p "$OUT"
START=$(date +%s)
PY=python3
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! $PY -c "import msgspec" 2>/dev/null && ls .whl/msgspec-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/msgspec-*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
SUMMARY="$OUT/summary.txt"
{
  echo "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  $PY -c "import msgspec" 2>/dev/null && echo "msgspec: yes" || echo "msgspec: MISSING (steps 1c, 3 fail)"
  $PY -c "import pytest" 2>/dev/null && echo "pytest: yes" || echo "pytest: no (step 1 runs the bench checks only)"
} | tee "$SUMMARY"
FAILED=0

. "$(dirname "$0")/gpu_round_step.sh"

step 1-correctness 120 bash -c '
  python3 -m bench.check_kernels_gpu --only-fused || rc=1
  python3 bench/shared_prefix_kernel_bench.py --check-only --quick-checks || rc=1
  if python3 -c "import pytest" 2>/dev/null; then
    python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/worker/test_kernels_triton.py tests/worker/test_kernels_shared_prefix.py \
      -k "at_most_8 or grouped" || rc=1
  fi
  exit ${rc:-0}'
step 2-shared-prefix 150 $PY bench/shared_prefix_kernel_bench.py --no-checks \
  --out "$OUT/shared-prefix-bandwidth.md"
step 3-kernels-per-layer 100 $PY -m bench.kernels_per_layer --batches bs1 W1 --out "$OUT/kernels-per-layer.md"
step 4-gate-up 60 $PY -m bench.gate_up_silu_bench --sweep

# The reply carries the end of the output: the short tables last.
echo
echo "==== failures and cut steps"
grep -h "FAIL\|Error\|Traceback" "$OUT"/1-correctness.log | head -20
echo "==== gate/up + SiLU (step 4)"
grep -v "sweep" "$OUT/4-gate-up.log" 2>/dev/null | tail -16
echo "==== kernels per layer (step 3)"
grep "kernels/layer" "$OUT/3-kernels-per-layer.log" 2>/dev/null
echo "==== shared-prefix bandwidth (step 2)"
tail -26 "$OUT/2-shared-prefix.log" 2>/dev/null
echo "==== summary"
cat "$SUMMARY"
exit $FAILED
