#!/usr/bin/env bash
# The 27B bench for several builds in one GPU-machine session, in turn: the same build moves by up
# to ~2% between sessions (clocks, the machine), so only an A/B inside one run shows a small change.
#   ROUNDS=2 tests/bench/ab_bench.sh OTHER_TREE [OTHER_TREE...]
# Each round benches this checkout, then every OTHER_TREE: another build's files (kernels/, daemons/,
# protocol/, router/), e.g.
#   mkdir -p tests/bench/tmp_ab/main_tree && git archive main kernels daemons protocol router | tar -x -C tests/bench/tmp_ab/main_tree
# in a folder git ignores, carried to the GPU machine with the run (carry: [".whl", "tests/bench/tmp_ab"]).
# BENCH_ARGS: more bench options for every run (e.g. "--no-profile --widths 1,23,32": shorter runs).
# An argument def:NAME=VALUE is this checkout with one knob's default changed: a kernel define (the line
# `#define NAME ...` in kernels/*.cu / *.cuh) or a module constant (`NAME = ...` or `NAME: TYPE = ...` at the
# start of a line of kernels/*.py or daemons/*.py), which must be there exactly once (or once in each, for a
# constant the sources mirror, e.g. ATT_SPLIT_KEYS: both change), e.g.
#   tests/bench/ab_bench.sh def:MM_WIDE_TRIGGER_AHEAD=-1 def:MM_BARRIER_PIPE=0 \
#       'def:WIDE_SWIGLU_VARIANT=("MM_GRID=3", "MM_STAGES=3")'
# Several knobs in one build: join them with '+', e.g. 'def:CHAIN_STEP=2+def:MM_CHAIN_SPREAD=8'.
# CONTROL=1 adds an identical copy of this checkout as one more build: in one machine session a build
# can run ~0.2 ms fast at W=23 for the whole call (GPU_NOTES, fourteenth session), so a lone difference
# of that size needs the control beside it. At the end, tests/bench/ab_summary.py prints the graph
# times per build (median, range, difference against this checkout).
set -u
[ $# -ge 1 ] || { echo "usage: ROUNDS=2 tests/bench/ab_bench.sh OTHER_TREE [OTHER_TREE...]" >&2; exit 2; }
rounds="${ROUNDS:-2}"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
bench=(python3 -m daemons.cli bench --synthetic qwen35-27b-q4km --device cuda:0 --synthetic-path /tmp/qwen35-27b-q4km.gguf ${BENCH_ARGS:-})
copy_checkout() {          # a copy of this checkout's build at $1
    mkdir -p "$1" && tar --exclude=tests/bench/tmp_ab -cf - kernels daemons protocol router tests setup.cfg \
        | tar -x -C "$1"
}
trees=("$PWD")
for arg in "$@"; do
    case "$arg" in
    def:*=*)
        tree="$(mktemp -d)/$(printf '%s' "${arg#def:}" | tr -c 'A-Za-z0-9_=.,+-' '_')"
        copy_checkout "$tree"
        cu=("$tree"/kernels/*.cu "$tree"/kernels/*.cuh)
        py=("$tree"/kernels/*.py "$tree"/daemons/*.py)
        rest="${arg#def:}"
        while [ -n "$rest" ]; do
            spec="${rest%%+def:*}"
            if [ "$spec" = "$rest" ]; then rest=""; else rest="${rest#*+def:}"; fi
            name="${spec%%=*}"; value="${spec#*=}"
            n_cu=$(cat "${cu[@]}" | grep -c -x -E "#define $name .*")
            n_py=$(cat "${py[@]}" | grep -c -E "^$name(: [^=]*)? = ")
            if [ "$n_cu" -gt 1 ] || [ "$n_py" -gt 1 ] || [ $((n_cu + n_py)) = 0 ]; then
                echo "ab_bench: $name is not defined exactly once in kernels/ and daemons/ ($n_cu #defines, $n_py module constants)" >&2
                exit 2
            fi
            esc=$(printf '%s' "$value" | sed -e 's/[\\|&]/\\&/g')     # sed's replacement: \ | & literal
            # a constant mirrored in both (fused.cu's ATT_SPLIT_KEYS and fused_gpu.py's, "the same names"): both
            if [ "$n_cu" = 1 ]; then
                sed -i -E "s|^#define $name .*\$|#define $name $esc|" "${cu[@]}"
            fi
            if [ "$n_py" = 1 ]; then
                sed -i -E "s|^($name(: [^=]*)?) = .*\$|\1 = $esc|" "${py[@]}"
            fi
        done
        echo "build $arg: $tree"
        trees+=("$tree") ;;
    *) trees+=("$arg") ;;
    esac
done
if [ "${CONTROL:-0}" = 1 ]; then
    control="$(mktemp -d)/control"
    copy_checkout "$control"
    trees+=("$control")
fi
log="$(mktemp)"
for _ in $(seq "$rounds"); do
    for tree in "${trees[@]}"; do
        echo "== $tree"      # (a build's errors pass the filter too: a failed build reads as one)
        (cd "$tree" && PYTHONPATH="/tmp/site:$PWD" timeout 150 "${bench[@]}" 2>&1) \
            | grep -E "^(prefill|decode|verify|rollback|graph|host) |[A-Za-z]+Error" | grep -v -e "tok/s (" -e "^verify  "
    done
done | tee "$log"
echo
python3 tests/bench/ab_summary.py < "$log"
