#!/usr/bin/env bash
# tests/test_build_fails.sh SOURCE_DIR cpu|cuda — the build fails loudly.
# In a copy of the source tree (the files git knows, tracked or not ignored),
# one file at a time is taken away and the configure step must fail with a
# message naming it: a test source, a test script, a suite file, a module's
# CMakeLists.txt, a source a module lists. A suite file the list does not
# name fails too. The configure output says why the CUDA backend is off.
#   cpu:  every case with the CUDA backend off (no nvcc needed)
#   cuda: with the CUDA backend on, kernels/cuda/CMakeLists.txt is required;
#         exits 77 (skipped) where nvcc is not found
# Configure only: nothing is compiled.
set -uo pipefail

src=${1:?usage: test_build_fails.sh SOURCE_DIR cpu|cuda}
mode=${2:?usage: test_build_fails.sh SOURCE_DIR cpu|cuda}
export PATH="$PATH:/usr/local/cuda/bin"
if [ "$mode" = cuda ] && ! command -v nvcc >/dev/null; then
    echo "skipped: nvcc is not on PATH (nor in /usr/local/cuda/bin): the CUDA backend cannot be configured"
    exit 77
fi
command -v git >/dev/null || { echo "FAIL: git is needed to list the source tree" >&2; exit 1; }
git -C "$src" rev-parse --is-inside-work-tree >/dev/null 2>&1 ||
    { echo "FAIL: $src is not a git checkout" >&2; exit 1; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/spotune-build-fails.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
tree=$tmp/src
mkdir -p "$tree"
(cd "$src" && git ls-files -co --exclude-standard -z |
    while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
    xargs -0 cp --parents -t "$tree") || { echo "FAIL: copying the source tree" >&2; exit 1; }

failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cuda_flags=(-DSPOTUNE_CUDA=OFF)
[ "$mode" = cuda ] && cuda_flags=(-DSPOTUNE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)

# configure BUILD_DIR ARGS... -> exit status; the output in $tmp/out
configure() {
    local b=$1
    shift
    cmake -S "$tree" -B "$tmp/$b" "${gen[@]}" "$@" >"$tmp/out" 2>&1
}

# expect_ok BUILD_DIR WHAT ARGS...: the configure step succeeds
expect_ok() {
    local b=$1 what=$2
    shift 2
    if configure "$b" "$@"; then
        echo "ok: $what configures"
    else
        fail "$what does not configure:"
        tail -30 "$tmp/out"
    fi
}

# expect_message TEXT: the last configure output has TEXT (line breaks and
# indentation of CMake's messages folded into single spaces)
expect_message() {
    local flat
    flat=$(tr '\n' ' ' <"$tmp/out" | tr -s ' ')
    case "$flat" in
    *"$1"*) echo "ok: the output says \"$1\"" ;;
    *) fail "the output does not say \"$1\":"; tail -30 "$tmp/out" ;;
    esac
}

# without PATH: the configure step must fail and its output name the file
without() {
    local path=$1 name
    name=$(basename "$path")
    [ -e "$tree/$path" ] || { fail "$path is not in the source tree: update this test"; return; }
    mv "$tree/$path" "$tmp/held"
    if configure build "${cuda_flags[@]}"; then
        fail "configure succeeded without $path"
    elif grep -q "CMake Error" "$tmp/out" && tr '\n' ' ' <"$tmp/out" | grep -q "$name"; then
        echo "ok: without $path the configure step fails, naming it"
    else
        fail "without $path the configure step failed without naming $name:"
        tail -30 "$tmp/out"
    fi
    mv "$tmp/held" "$tree/$path"
}

if [ "$mode" = cuda ]; then
    expect_ok build "the tree with the CUDA backend" "${cuda_flags[@]}"
    expect_message "CUDA backend: ON"
    without kernels/cuda/CMakeLists.txt
    without kernels/cuda/cuda_ops.cu
else
    expect_ok build "the tree without the CUDA backend" "${cuda_flags[@]}"
    expect_message "CUDA backend: OFF, because SPOTUNE_CUDA=OFF"
    # every module and suite is configured: the tests of each are registered,
    # the CUDA suites too (they report skipped without a device)
    ctest --test-dir "$tmp/build" -N >"$tmp/tests" 2>&1 || fail "ctest -N failed"
    for t in test_ops test_ops_attention test_config test_comm launch_sh test_store_file test_remote \
        test_bench test_cuda_ops test_cuda_elementwise test_cuda_attention gpu_check_sh multinode_trajectory prepare_data_py \
        build_fails_loudly; do
        grep -q "Test *#[0-9]*: $t\$" "$tmp/tests" || fail "test $t is not registered"
    done
    expect_ok build-asan "the sanitizer build" -DSPOTUNE_SANITIZE=ON -DSPOTUNE_CUDA=ON
    expect_message "CUDA backend: OFF, because SPOTUNE_SANITIZE=ON"
    # AUTO (the default) without nvcc on PATH: off, saying so; with one: on
    if PATH=/usr/bin:/bin command -v nvcc >/dev/null; then
        CUDACXX= PATH=/usr/bin:/bin expect_ok build-auto "the default with nvcc in /usr/bin"
        expect_message "CUDA backend: ON"
    else
        CUDACXX= PATH=/usr/bin:/bin expect_ok build-auto "the default without nvcc"
        expect_message "CUDA backend: OFF, because SPOTUNE_CUDA=AUTO and no CUDA compiler was found"
    fi
    # CUDA asked for by name must be there
    if configure build-on -DSPOTUNE_CUDA=ON -DCMAKE_CUDA_COMPILER=/nonexistent/nvcc; then
        fail "SPOTUNE_CUDA=ON configured without a CUDA compiler"
    else
        expect_message "/nonexistent/nvcc"
    fi
    # a suite file that tests/CMakeLists.txt does not list
    echo "# not listed" >"$tree/tests/unlisted.cmake"
    if configure build "${cuda_flags[@]}"; then
        fail "an unlisted tests/unlisted.cmake configured"
    else
        expect_message "tests/unlisted.cmake is not in the list of suites"
    fi
    rm "$tree/tests/unlisted.cmake"

    without tests/test_config.c         # a Criterion suite of trainer.cmake
    without tests/test_util.c           # a source shared by suites
    without tests/op_checks.c           # test_ops and test_cuda_ops
    without tests/test_launch.sh        # a script test
    without tests/store.cmake           # a suite file
    without tests/cuda.cmake            # the CUDA suites are registered without CUDA too
    without comm/CMakeLists.txt         # a module
    without checkpoint/CMakeLists.txt
    without trainer/CMakeLists.txt
    without kernels/CMakeLists.txt
    without checkpoint/lease.c          # a source a module lists
    without trainer/main.c
    without kernels/cpu/cpu_ops.c
    # and after all that, the tree as it was configures again
    expect_ok build "the restored tree" "${cuda_flags[@]}"
fi

if [ "$failures" -gt 0 ]; then
    echo "$failures check(s) failed"
    exit 1
fi
echo "all checks passed"
