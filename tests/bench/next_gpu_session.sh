#!/usr/bin/env bash
# The experiments prepared for the next GPU-machine session (tests/bench/GPU_NOTES.md, "the next GPU
# session's first call"), so that a 30-minute device budget goes on measuring, not on typing:
#   tests/bench/next_gpu_session.sh prep     here (needs git): the A/B trees under tests/bench/tmp_ab/
#   tests/bench/next_gpu_session.sh ab       device, ~6 min: the four prepared builds against this one
#   tests/bench/next_gpu_session.sh diag     device, ~6 min: step timeline, MM_B_ONE_LOAD, ncu of the
#                                            wide gate|up, prompt lengths steps vs wide
# Device calls carry [".whl", "tests/bench/tmp_ab"]; both write the 16.5 GB GGUF to /tmp first when
# the machine is cold (~1 minute), then reuse it while it stays warm.
set -u
AB_BRANCHES="nested-wide prep-hollow trigger-8 trigger-16"
GGUF=/tmp/qwen35-27b-q4km.gguf
what="${1:-}"
site() {
    if [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    fi
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
}
gguf() {
    [ -f "$GGUF" ] || python3 -m daemons.cli bench --synthetic qwen35-27b-q4km --synthetic-path "$GGUF" --write-only
}
case "$what" in
prep)
    for b in $AB_BRANCHES step-timeline; do
        rm -rf "tests/bench/tmp_ab/$b" && mkdir -p "tests/bench/tmp_ab/$b"
        git archive "wip/$b" kernels daemons protocol router tests | tar -x -C "tests/bench/tmp_ab/$b"
    done
    ;;
ab)
    site
    trees=()
    for b in $AB_BRANCHES; do trees+=("tests/bench/tmp_ab/$b"); done
    ROUNDS="${ROUNDS:-2}" bash tests/bench/ab_bench.sh "${trees[@]}"
    ;;
diag)
    site
    gguf
    echo "== step timeline (wip/step-timeline)"
    (cd tests/bench/tmp_ab/step-timeline && PYTHONPATH="/tmp/site:$PWD" timeout 150 \
        python3 tests/bench/timeline_gpu_step.py --widths 1,23 --path "$GGUF" 2>&1 | tail -60)
    echo "== activation reads of the wide product (MM_B_ONE_LOAD: timing only)"
    timeout 120 python3 tests/bench/bench_mm_gpu.py --widths 1,23 --cases "gate,ffn_down Q4_K,ssm_out" \
        --variants ";MM_B_ONE_LOAD=1" 2>&1 | tail -30
    echo "== ncu: gate|up at T = 23"
    timeout 150 ncu --clock-control none --kernel-name mm_tc --launch-count 1 \
        --section MemoryWorkloadAnalysis_Tables --section WarpStateStats \
        python3 tests/bench/bench_mm_gpu.py --widths 23 --cases gate --ncu-once 2>&1 \
        | grep -v "^==PROF==" | tail -70
    echo "== prompt lengths: steps vs one wide forward"
    timeout 200 python3 -m daemons.cli bench --synthetic qwen35-27b-q4km --synthetic-path "$GGUF" --device cuda:0 \
        --no-profile --tokens 8 --widths 32 --short-prompts 64,96,128,192 2>&1 | grep -E "^(prompt|decode|verify) "
    ;;
*)
    echo "usage: tests/bench/next_gpu_session.sh prep|ab|diag" >&2
    exit 2
    ;;
esac
