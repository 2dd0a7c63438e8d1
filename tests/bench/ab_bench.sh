#!/usr/bin/env bash
# The 27B bench for two builds in one GPU-machine session, alternately: the same build moves by up
# to ~2% between sessions (clocks, the machine), so only an A/B inside one run shows a small change.
#   tests/bench/ab_bench.sh OTHER_TREE [ROUNDS]
# OTHER_TREE: the other build's files (kernels/, daemons/, protocol/, router/), e.g.
#   mkdir -p tests/bench/tmp_ab/main_tree && git archive main kernels daemons protocol router | tar -x -C tests/bench/tmp_ab/main_tree
# in a folder git ignores, carried to the GPU machine with the run (carry: [".whl", "tests/bench/tmp_ab"]).
set -u
other="${1:?usage: tests/bench/ab_bench.sh OTHER_TREE [ROUNDS]}"
rounds="${2:-2}"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
bench=(python3 -m daemons.cli bench --synthetic qwen35-27b-q4km --device cuda:0 --synthetic-path /tmp/qwen35-27b-q4km.gguf)
here="$PWD"
for _ in $(seq "$rounds"); do
    for v in this other; do
        echo "== $v"
        if [ "$v" = other ]; then
            (cd "$other" && PYTHONPATH="/tmp/site:$PWD" timeout 150 "${bench[@]}" 2>&1)
        else
            (cd "$here" && PYTHONPATH="/tmp/site:$PWD" timeout 150 "${bench[@]}" 2>&1)
        fi | grep -E "^(decode|verify|graph) " | grep -v "tok/s ("
    done
done
