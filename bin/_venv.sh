# Sourced by bin/dflashd and bin/test: the project's .venv with the package installed, so that each
# of the README's two commands works first on a new machine. ensure_venv EXTRAS ("" or "test")
# creates .venv if missing and installs `.[EXTRAS]` into it, again only when the packaging files
# change (a stamp per extras and hash; the test extras include everything the runtime needs).
ensure_venv() {
    local extras="$1" hash stamp
    [ -x .venv/bin/python ] || python3 -m venv .venv
    hash="$(cat setup.cfg pyproject.toml | sha1sum | cut -c1-16)"
    [ -f ".venv/.dflashd-installed-test-$hash" ] && return 0
    stamp=".venv/.dflashd-installed-${extras:-runtime}-$hash"
    [ -f "$stamp" ] && return 0
    .venv/bin/python -m pip install --upgrade pip >/dev/null
    # llama-cpp-python (test extras) builds llama.cpp from source the first time (several minutes
    # on 2 cores), after which pip's wheel cache serves it.
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" .venv/bin/python -m pip install -e ".${extras:+[$extras]}" >&2
    rm -f .venv/.dflashd-installed-"${extras:-runtime}"-* && touch "$stamp"
}
