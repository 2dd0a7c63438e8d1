#!/usr/bin/env bash
# One batched GPU-machine session: install the carried wheels, run the GPU tests and the 27B bench,
# leaving logs in $OUT (the device tool's output folder; ./out when run by hand).
#   tests/bench/gpu_session.sh [tests|bench|all|persist|trace|chain] [pytest args...]
# persist: tests/bench/persist_probe.py's decode and verify questions (GPU_NOTES, thirty-fourth and
# thirty-fifth sessions), ~2-4 minutes; needs only the gguf wheel.
# trace: the stages of verify W=23's gate|up and ffn_down launches (tests/bench/stage_trace_gpu.py
# --width 23 and gate|up's copies alone; GPU_NOTES, thirty-sixth session), ~3-4 minutes.
# chain: the persistent-chain candidates (mma_matmul.cu mm_chain; GPU_NOTES, thirty-ninth to forty-first sessions):
# the chained step from captured graphs (chain_step_check_gpu.py on models of the 27B's widths with 8 and 24 layers,
# with MM_CHAIN_GIVE_UP, which names a wait that never ends and the blocks it waited for): levels 1-3 with the
# chains launched as cooperative grids (the default), then levels 1 and 3 as ordinary grids (the forty-first
# session's hang); then tests/bench/bench_chain_gpu.py (the decode step's products as launches and as one chain, a
# phase's counts on one line, on eight, and waiters on a flag the last arrival raises), ~6 minutes.
# chain-tests: the chain's GPU tests (~1.5 minutes).
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
if [ "$what" = persist ]; then
    timeout "${PROBE_TIMEOUT:-240}" python3 tests/bench/persist_probe.py --stages 3 --chain --hold-cycles 0 1340 \
        --phase-blocks 1 0 2>&1 | tee "$OUT/persist_decode.log"
    timeout "${PROBE_TIMEOUT:-240}" python3 tests/bench/persist_probe.py --stages 2 --act-bytes 12512 --trig -1 --chain \
        --hold-cycles 0 1650 --phases "prep=3.6;dn=9.4,11.0,6.2;att=10.6,17.9,7.9" --phase-blocks 1 0 2>&1 \
        | tee "$OUT/persist_verify.log"
fi
if [ "$what" = trace ]; then
    timeout "${PROBE_TIMEOUT:-240}" python3 tests/bench/stage_trace_gpu.py --width 23 --reps 4 2>&1 \
        | tee "$OUT/trace_w23.log"
    timeout "${PROBE_TIMEOUT:-240}" python3 tests/bench/stage_trace_gpu.py --width 23 --reps 4 --launch ffn_down 2>&1 \
        | tee "$OUT/trace_w23_ffn_down.log"
    # gate|up's copies alone (results wrong): the stage rate the pipeline reaches with nothing to compute
    timeout "${PROBE_TIMEOUT:-240}" python3 tests/bench/stage_trace_gpu.py --width 23 --reps 4 \
        --variant MM_NO_COMPUTE=1,MM_NO_EXCHANGE=1 2>&1 | tee "$OUT/trace_w23_copies.log"
fi
if [ "$what" = chain-tests ]; then
    timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -q --timeout 300 -p no:cacheprovider \
        tests/test_fused_kernels.py tests/test_gpu_step.py -k "chain and cuda" "$@" 2>&1 | tee "$OUT/tests_chain.log" | tail -20
fi
if [ "$what" = chain ]; then
    quiet=(grep -v -e "^Traceback" -e "^  File" -e "Exception ignored" -e moduleUnload -e check_status -e "^$")
    # the chained step from graphs with the chains as cooperative grids (the default: expected to pass), at 8
    # and at 24 layers (more chains a step), then as ordinary grids (the hang: the give-up record names the
    # blocks that never started and the multiprocessors short of four)
    timeout 120 python3 tests/bench/chain_step_check_gpu.py --layers 8 --levels 1,2,3 --modes graphs --give-up 2>&1 \
        | tee "$OUT/chain_check.log" | "${quiet[@]}" | head -30
    timeout 150 python3 tests/bench/chain_step_check_gpu.py --layers 24 --levels 1,3 --modes graphs --give-up 2>&1 \
        | tee "$OUT/chain_check24.log" | "${quiet[@]}" | head -30
    timeout 120 python3 tests/bench/chain_step_check_gpu.py --layers 8 --levels 1,3 --modes graphs --give-up \
        --no-cooperative 2>&1 | tee "$OUT/chain_check_not_cooperative.log" | "${quiet[@]}" | head -30
    timeout "${PROBE_TIMEOUT:-300}" python3 tests/bench/bench_chain_gpu.py --gguf /tmp/qwen35-27b-q4km.gguf \
        --spread 1 8 flag 2>&1 | tee "$OUT/bench_chain.log"
fi
