#!/usr/bin/env bash
# One batched GPU-machine session: install the carried wheels, run the GPU tests and the 27B bench,
# leaving logs in $OUT (the device tool's output folder; ./out when run by hand).
#   tests/bench/gpu_session.sh [tests|bench|all] [pytest args...]
set -u
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
what="${1:-all}"; shift || true
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
    timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -q --timeout 300 -p no:cacheprovider "$@" 2>&1 | tee "$OUT/tests${TAG:-}.log" | tail -${TAIL:-40}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    timeout "${BENCH_TIMEOUT:-300}" python3 -m daemons.cli bench --synthetic qwen35-27b-q4km --device cuda:0 \
        --synthetic-path /tmp/qwen35-27b-q4km.gguf --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -60
fi
