#!/usr/bin/env bash
# scripts/gpu_bundle.sh — build spotune with the CUDA backend here and pack,
# into one folder, what a GPU machine needs to run the CUDA tests and the
# benchmarks when it has only the NVIDIA driver and the CUDA 13 runtime
# libraries (cudart, cuBLAS, cuBLASLt, NCCL):
#
#   gpu-bundle/
#     gpu_check.sh          run this there: tests, benchmarks, one table, at
#                           most 8 minutes (--dry-run: every GPU step skipped)
#     run                   ./run CMD ARGS: CMD with the bundle's environment
#     env.sh                the same environment for `source`
#     bin/                  spotune, test_cuda_ops, test_cuda_elementwise,
#                           test_cuda_attention, test_cuda_layer,
#                           test_cuda_model, test_cuda_comm, the kernel
#                           workbenches attn_bench, elem_bench and mm_bench
#                           (kernels/cuda/dev; stripped) and
#                           libspotune_cuda.so, the CUDA backend they load
#     lib.tar.xz            every other shared library they load (Open MPI,
#                           HDF5, OpenBLAS, libyaml, jansson, Criterion, curl
#                           and their dependencies), unpacked into lib/ on
#                           first use: unpacked they are over 100 MiB
#     tests/fixtures/       the fixtures the model test reads, as
#                           tests/fixtures/gpu_bundle.list names them (the
#                           test fails on a case not listed)
#     gpu_profile.sh        where Nsight Compute is installed: where the
#                           time goes (the attention kernels, a step kernel
#                           by kernel, other builds of the CUDA module)
#     scripts/              bench_hf_peft.py, kernel_shares.py, stall_lines.py
#     BUILD.txt             commit, architectures, compiler, build date
#
# Left out: glibc, libstdc++/libgcc_s, the CUDA runtime, cuBLAS/cuBLASLt,
# NCCL and the driver (the machine has those; env.sh finds them in the
# loader's cache, $SPOTUNE_CUDA_LIB_DIRS, /usr/local/cuda*, or Python's
# nvidia-* wheels).
#
# usage: scripts/gpu_bundle.sh [--arch LIST] [--out DIR] [--build-dir DIR] [-j N]
#   --arch LIST       CUDA architectures (default 90: H100/H200), e.g. "80;90"
#   --out DIR         bundle folder (default gpu-bundle, replaced)
#   --build-dir DIR   build folder (default build-gpu-bundle)
#   -j N              parallel build jobs
set -euo pipefail

ARCH=90
OUT=gpu-bundle
BUILD=build-gpu-bundle
JOBS=""
LIMIT_MIB=62 # the bundle and the checkout's tracked files together

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
    case "$1" in
    --arch) ARCH="$2"; shift 2 ;;
    --arch=*) ARCH="${1#*=}"; shift ;;
    --out) OUT="$2"; shift 2 ;;
    --out=*) OUT="${1#*=}"; shift ;;
    --build-dir) BUILD="$2"; shift 2 ;;
    --build-dir=*) BUILD="${1#*=}"; shift ;;
    -j) JOBS="$2"; shift 2 ;;
    -j*) JOBS="${1#-j}"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_bundle.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
die() { echo "gpu_bundle.sh: error: $*" >&2; exit 1; }
command -v nvcc >/dev/null || die "nvcc is not on PATH: the CUDA backend cannot be built"
command -v xz >/dev/null || die "xz is needed to pack the libraries"
case "$OUT" in ""|/|.|..) die "refusing --out '$OUT'" ;; esac

# ---- build ----------------------------------------------------------------------
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
if [ -f "$BUILD/CMakeCache.txt" ] && ! grep -q "^CMAKE_GENERATOR:INTERNAL=Ninja" "$BUILD/CMakeCache.txt" \
    && [ ${#GEN[@]} -gt 0 ]; then
    GEN=() # an existing build folder keeps its generator
fi
echo "== configure $BUILD (Release, CUDA architectures $ARCH)"
cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DSPOTUNE_CUDA=ON \
    -DSPOTUNE_KERNEL_BENCH=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" >/dev/null
grep -q "^SPOTUNE_CUDA:STRING=ON" "$BUILD/CMakeCache.txt" || die "the build has the CUDA backend off"
# the attention by cuDNN needs the frontend's headers (scripts/requirements-build.txt)
grep -q "^SPOTUNE_CUDNN_FRONTEND_INCLUDE:PATH=/" "$BUILD/CMakeCache.txt" ||
    die "no cuDNN frontend headers (the attention by cuDNN needs them): run scripts/install-deps.sh --python first"
TESTS=(test_cuda_ops test_cuda_elementwise test_cuda_attention test_cuda_layer test_cuda_model
    test_cuda_comm)
WORKBENCH=(attn_bench elem_bench mm_bench) # kernels/cuda/dev, built into $BUILD/dev
TARGETS=(spotune "${TESTS[@]}" "${WORKBENCH[@]}")
echo "== build ${TARGETS[*]}"
cmake --build "$BUILD" ${JOBS:+-j "$JOBS"} --target "${TARGETS[@]}"

BINS=("$BUILD/spotune")
for t in "${TESTS[@]}"; do BINS+=("$BUILD/tests/$t"); done
# the workbenches load the CUDA backend from beside them too, and link the
# same libraries as the tests: packed and checked with them below
for t in "${WORKBENCH[@]}"; do BINS+=("$BUILD/dev/$t"); done
# the CUDA backend, loaded by the programs from beside them (kernels/backend.c)
BINS+=("$BUILD/libspotune_cuda.so")
for b in "${BINS[@]}"; do [ -f "$b" ] || die "$b was not built"; done

# ---- pack ---------------------------------------------------------------------------
echo "== pack $OUT"
rm -rf "$OUT"
mkdir -p "$OUT/bin" "$OUT/scripts" "$OUT/tests/fixtures/hf" "$OUT/tests/fixtures/nf4"
for b in "${BINS[@]}"; do
    cp "$b" "$OUT/bin/"
    strip --strip-unneeded "$OUT/bin/$(basename "$b")"
done
# every case test_cuda_model opens (it asserts that each is listed)
while read -r c; do
    [ -n "$c" ] && cp -r "tests/fixtures/$c" "$OUT/tests/fixtures/$(dirname "$c")/"
done < tests/fixtures/gpu_bundle.list
cp tests/fixtures/gpu_bundle.list "$OUT/tests/fixtures/"
cp scripts/gpu_check.sh "$OUT/gpu_check.sh"
cp scripts/gpu_profile.sh "$OUT/gpu_profile.sh"
cp scripts/bench_hf_peft.py scripts/kernel_shares.py scripts/stall_lines.py "$OUT/scripts/"
chmod +x "$OUT/gpu_check.sh" "$OUT/gpu_profile.sh"

# What the machine provides: the C library, the C++ runtime, CUDA, NCCL, the driver.
SYSTEM_LIBS='^(linux-vdso|ld-linux|libc\.so|libm\.so|libmvec\.so|libpthread\.so|libdl\.so|librt\.so|libresolv\.so|libutil\.so|libanl\.so|libnsl\.so|libBrokenLocale\.so|libstdc\+\+\.so|libgcc_s\.so|libcuda\.so|libcudart\.so|libcublas\.so|libcublasLt\.so|libnccl\.so|libnvidia-)'
LIBS="$OUT/.lib"
mkdir -p "$LIBS"
for b in "${BINS[@]}"; do
    if ldd "$b" | grep -q "not found"; then
        ldd "$b" | grep "not found" >&2
        die "$b has unresolved libraries here"
    fi
    ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
        if ! [[ "$name" =~ $SYSTEM_LIBS ]]; then
            cp -L "$path" "$LIBS/$name"
        fi
    done
done
tar -C "$LIBS" -cf - . | xz -9 -T0 > "$OUT/lib.tar.xz"
NLIBS=$(find "$LIBS" -type f | wc -l)
rm -rf "$LIBS"

cat > "$OUT/env.sh" <<'EOF'
# Source this (bash): unpacks lib.tar.xz on first use and sets the paths the
# bundle's programs need. SPOTUNE_CUDA_LIB_DIRS (colon-separated) adds
# folders holding libcudart.so.13, libcublas(Lt).so.13 and libnccl.so.2.
SPOTUNE_BUNDLE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -w "$SPOTUNE_BUNDLE" ]; then
    SPOTUNE_BUNDLE_LIB="$SPOTUNE_BUNDLE/lib"
else
    SPOTUNE_BUNDLE_LIB="${TMPDIR:-/tmp}/spotune-bundle-$(id -u)/lib"
fi
if [ ! -f "$SPOTUNE_BUNDLE_LIB/.unpacked" ] || [ "$SPOTUNE_BUNDLE/lib.tar.xz" -nt "$SPOTUNE_BUNDLE_LIB/.unpacked" ]; then
    rm -rf "$SPOTUNE_BUNDLE_LIB" && mkdir -p "$SPOTUNE_BUNDLE_LIB" || return 1
    if command -v xz >/dev/null 2>&1; then
        tar -C "$SPOTUNE_BUNDLE_LIB" -xJf "$SPOTUNE_BUNDLE/lib.tar.xz"
    else
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
            "$SPOTUNE_BUNDLE/lib.tar.xz" "$SPOTUNE_BUNDLE_LIB"
    fi || { echo "env.sh: could not unpack $SPOTUNE_BUNDLE/lib.tar.xz" >&2; return 1; }
    touch "$SPOTUNE_BUNDLE_LIB/.unpacked"
fi
spotune_cuda_lib_dirs() {
    local found="" lib d py ldc
    ldc=$(command -v ldconfig || echo /sbin/ldconfig)
    for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2 libcudnn.so.9 \
        libnvrtc.so.13; do
        if "$ldc" -p 2>/dev/null | awk -v l="$lib" '$1 == l {f = 1} END {exit !f}'; then
            continue
        fi
        for d in ${SPOTUNE_CUDA_LIB_DIRS//:/ } ${LD_LIBRARY_PATH//:/ } /usr/local/cuda/lib64 \
                 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13*/lib64 \
                 /usr/local/cuda-13*/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
            if [ -e "$d/$lib" ]; then found="$found:$d"; continue 2; fi
        done
        for py in $(python3 -c 'import sys, os; print(" ".join(os.path.join(p, "nvidia") for p in sys.path if os.path.isdir(os.path.join(p, "nvidia"))))' 2>/dev/null); do
            d=$(find "$py" -maxdepth 4 -name "$lib" -print -quit 2>/dev/null)
            if [ -n "$d" ]; then found="$found:$(dirname "$d")"; continue 2; fi
        done
        case $lib in
        libcudnn* | libnvrtc*) # cuDNN, and NVRTC for its engines compiled at run time
            echo "env.sh: note: $lib not found: SPOTUNE_CUDA_ATTENTION=cudnn may run the fused kernels (set SPOTUNE_CUDA_LIB_DIRS)" >&2 ;;
        *) echo "env.sh: warning: $lib not found (set SPOTUNE_CUDA_LIB_DIRS)" >&2 ;;
        esac
    done
    echo "${found#:}"
}
SPOTUNE_CUDA_DIRS=$(spotune_cuda_lib_dirs)
export LD_LIBRARY_PATH="$SPOTUNE_BUNDLE_LIB${SPOTUNE_CUDA_DIRS:+:$SPOTUNE_CUDA_DIRS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$SPOTUNE_BUNDLE/bin:$PATH"
export SPOTUNE_TEST_SOURCE_DIR="$SPOTUNE_BUNDLE" SPOTUNE_TEST_BINARY_DIR="$SPOTUNE_BUNDLE/bin"
export SPOTUNE_BUNDLE SPOTUNE_BUNDLE_LIB
EOF

cat > "$OUT/run" <<'EOF'
#!/usr/bin/env bash
# ./run CMD [ARGS]: runs CMD (spotune, test_cuda_ops, ldd ...) with the bundle's environment.
source "$(dirname "$0")/env.sh" || exit 1
exec "$@"
EOF
chmod +x "$OUT/run"

{
    echo "spotune GPU bundle"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "built: $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -m)"
    echo "CUDA architectures: $ARCH"
    echo "nvcc: $(nvcc --version | tail -1)"
    echo "libraries packed: $NLIBS"
    echo
    echo "On the GPU machine, from this folder:  OUT=dir ./gpu_check.sh   (at most 8 minutes)"
    echo "or ./run spotune --help, ./run test_cuda_ops (test_cuda_elementwise, test_cuda_attention, test_cuda_layer, test_cuda_model, test_cuda_comm)"
    echo "or ./run attn_bench, ./run elem_bench (the kernel workbenches: kernels/cuda/dev/README.md)"
} > "$OUT/BUILD.txt"

# ---- check ------------------------------------------------------------------------------
# the bundle is copied with the checkout: both together within $LIMIT_MIB MiB
KIB=$(du -sk "$OUT" | cut -f1)
TREE_KIB=$(($(git ls-files -z 2>/dev/null | du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f1) / 1024))
echo "== $OUT: $((KIB / 1024)) MiB packed, $NLIBS libraries; the checkout's tracked files $((TREE_KIB / 1024)) MiB"
[ $((KIB + TREE_KIB)) -lt $((LIMIT_MIB * 1024)) ] ||
    die "$OUT ($((KIB / 1024)) MiB) and the checkout's files ($((TREE_KIB / 1024)) MiB) are over the ${LIMIT_MIB} MiB limit"
# shellcheck disable=SC2016 # expanded by the inner shell
MISSING=$("$OUT/run" bash -c 'for b in "$SPOTUNE_BUNDLE"/bin/*; do ldd "$b" | grep "not found"; done' || true)
[ -z "$MISSING" ] || die "unresolved in the bundle: $MISSING"
echo "== every library resolves with the bundle's environment"
du -sh "$OUT/lib" 2>/dev/null | sed 's/^/   unpacked lib\/: /'
rm -rf "${OUT:?}/lib" # unpacked again on the GPU machine
echo "done: copy $OUT/ to the GPU machine and run ./gpu_check.sh there"
