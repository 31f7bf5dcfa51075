#!/usr/bin/env bash
# One GPU round for issue 22 (contexts longer than the GPU: layer-wise KV offload, YaRN), from the repository root of
# the device machine (an H100: python 3.12, torch 2.11, triton 3.6), under 9 minutes, outputs under $OUT:
#   1. GPU tests (pytest when it is there, else the test functions called directly): the ring's side-stream copies
#      against a held-back compute stream, greedy tokens with offload == on a pool that holds everything (CUDA, fp32,
#      two chunk/ring settings, two long requests beside two short ones, a follow-up from the host tier), YaRN
#      through the fused Q/K norm + RoPE + KV store kernel against HF, the host tier's layer-major pinned pool;
#   2. bench/long_context.py: Qwen3-8B shape (dummy weights, YaRN to 524288 positions), a 520000-token document
#      with 32 output tokens through the host pool: decode ms/token against KV bytes / measured host-to-device
#      bandwidth, prefill against the in-GPU prefill's quadratic fit (16K..128K on the same engine's pool),
#      the follow-up question's first token, peak GPU / host memory; a PNG of decode time against context.
# The document shrinks (by the fit's prediction) when the time left would not hold it, and when the host has too
# little memory for its 79 GB pool: both are written into the results (PARTS=bench gives the benchmark the whole
# budget, PARTS=tests runs the tests alone).
# The GPU machine reaches no network: carry .whl (the wheels of ../shared/tools/device-wheels.sh, plus pytest's) and
# .gpu-cache (the tiny test model, with its tokenizer), both made on the CPU machine by the prepare line below.
#
#     bash bench/gpu_round_long_context.sh prepare     # on the CPU machine, once
#     bash bench/gpu_round_long_context.sh             # on the GPU machine
set -u
if [ "${1:-}" = prepare ]; then
  grep -qxF '/.gpu-cache/' .git/info/exclude 2>/dev/null || echo '/.gpu-cache/' >> .git/info/exclude
  RADIXSERVE_CACHE_DIR="$PWD/.gpu-cache" python3 -c "
from tests.test_layerwise_offload_gpu import YARN
from radixserve.testing.tiny_models import tiny_model_dir
print(tiny_model_dir('qwen3', rope_scaling=YARN))" || exit 1
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform any -d .whl pytest pluggy iniconfig packaging pytest-timeout || exit 1
  exit 0
fi
OUT=${OUT:-/tmp/gpu-round-long-context}
BUDGET=${BUDGET:-520}
PARTS=${PARTS:-tests,bench}
mkdir -p "$OUT"
START=$(date +%s)
PY=python3
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site" PATH="/tmp/site/bin:$PATH"
fi
[ -d .gpu-cache ] && export RADIXSERVE_CACHE_DIR="$PWD/.gpu-cache"
SUMMARY="$OUT/summary.txt"
{
  echo "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)"
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  grep -E "MemTotal|MemAvailable" /proc/meminfo | tr -s ' ' | tr '\n' ' '; echo
  $PY -c "import pytest" 2>/dev/null && echo "pytest: yes" || echo "pytest: no (tests called directly)"
  $PY -c "import matplotlib" 2>/dev/null && echo "matplotlib: yes" || echo "matplotlib: no (no PNG; plot from the JSON)"
} | tee "$SUMMARY"
FAILED=0

MIN_STEP_S=30
. "$(dirname "$0")/gpu_round_step.sh"

[[ $PARTS == *tests* ]] && step 1-tests 90 bash -c '
  if python3 -c "import pytest" 2>/dev/null; then
    python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/worker/test_layerwise_offload_gpu.py tests/scheduler/test_host_tier.py
  else
    python3 tests/worker/test_layerwise_offload_gpu.py || rc=1
    python3 -c "
import tests.test_host_tier as t
for seed in range(3):
    t.test_random_workload_on_cuda_with_pinned_host_memory(seed)
print(\"PASSED host tier on cuda, 3 seeds\")" || rc=1
    exit ${rc:-0}
  fi'

# The host pool: 79 GB holds 535K tokens of Qwen3-8B's KV (147456 bytes a token); with less memory available, a
# pool of what there is less 24 GB, and a document that fits it.
read -r HOST_GB DOC <<<"$($PY -c "
avail = int([l.split()[1] for l in open('/proc/meminfo') if l.startswith('MemAvailable')][0]) * 1024 / 1e9
gb = min(79.0, avail - 24.0)
print(round(gb, 1), min(520000, int(gb * 1e9 / 147456) - 15000))")"
echo "host pool ${HOST_GB} GB, document ${DOC} tokens" | tee -a "$SUMMARY"
if awk "BEGIN {exit !($HOST_GB < 8)}"; then
  echo "2-bench: skipped, too little host memory for a host KV pool worth measuring" | tee -a "$SUMMARY"
  PARTS=${PARTS//bench/}
fi
LEFT=$((BUDGET - ($(date +%s) - START) - 15))
[[ $PARTS == *bench* ]] && step 2-bench "$LEFT" $PY -m bench.long_context --config qwen3-8b --context 524288 \
  --doc-tokens "$DOC" --out-tokens 32 --question-tokens 128 --hicache-size "$HOST_GB" --max-total-tokens 140000 \
  --gpu-prefill-points 32768,65536,131072 --decode-points 196608,393216 --decode-tokens 4 \
  --budget-s "$((LEFT - 10))" --out-dir "$OUT/long-context"

# The reply carries the end of the output: the figures last.
echo
echo "==== failures"
grep -h "FAILED\|Error\|Traceback" "$OUT"/1-tests.log "$OUT"/2-bench.log 2>/dev/null | head -20
echo "==== tests (step 1)"
tail -5 "$OUT/1-tests.log"
echo "==== long context (step 2)"
cat "$OUT/long-context/long-context.md" 2>/dev/null || cat "$OUT/long-context/long-context.json" 2>/dev/null \
  || tail -30 "$OUT/2-bench.log"
echo "==== summary"
cat "$SUMMARY"
exit $FAILED
