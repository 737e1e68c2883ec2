#!/usr/bin/env bash
# test.sh — builds spotune and runs the whole suite, as CI does:
#   1. installs what is missing (Debian packages, the .venv for Python tests
#      with the Hugging Face stack the fixtures and exports are checked
#      against, the local S3 test server's packages);
#   2. the normal build (the CUDA backend compiled and linked when nvcc is
#      found; its tests report "skipped" without a GPU) and every test;
#   3. a Release build (-O3, CPU backend), compiled only: GCC's warnings
#      (errors here) depend on the optimization level, and the GPU bundle
#      (scripts/gpu_bundle.sh) builds Release;
#   4. a build with AddressSanitizer + UndefinedBehaviorSanitizer and every
#      CPU test again.
# usage: scripts/test.sh [--no-asan] [-R REGEX]   (-R: only the ctest tests matching)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
asan=1
filter=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-asan) asan=0 ;;
    -R) filter=(-R "$2"); shift ;;
    *) echo "usage: scripts/test.sh [--no-asan] [-R REGEX]" >&2; exit 2 ;;
  esac
  shift
done

# The local S3 server is started and stopped by ctest (tests/store.cmake); if
# the run is interrupted before ctest stops it, stop it here (Swift detaches
# from its caller, so nothing else would).
stop_s3() { if [ -x scripts/swift-s3.sh ]; then scripts/swift-s3.sh stop >/dev/null 2>&1 || true; fi; }
trap stop_s3 EXIT
trap 'stop_s3; exit 130' INT TERM

scripts/install-deps.sh --python --hf
# Installed just above: a test that finds torch, PEFT or bitsandbytes missing
# fails here instead of reporting itself skipped.
export SPOTUNE_REQUIRE_HF_TESTS=1
# and the cuDNN frontend's headers (scripts/requirements-build.txt): the
# check of the cuDNN attention graphs fails instead of skipping without them
export SPOTUNE_REQUIRE_CUDNN_FRONTEND=1
if [ -x scripts/install-s3-test-deps.sh ]; then scripts/install-s3-test-deps.sh; fi
export PATH="$root/.venv/bin:$PATH"
if [ -d /usr/local/cuda/bin ]; then export PATH="$PATH:/usr/local/cuda/bin"; fi
# Open MPI refuses to run as root unless told; tests spawn mpirun.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
# No test asks a real cloud's metadata service for credentials (on a cloud
# machine it would answer); the tests of that path run their own fake.
export AWS_EC2_METADATA_DISABLED=true
unset AWS_CONTAINER_CREDENTIALS_FULL_URI AWS_CONTAINER_CREDENTIALS_RELATIVE_URI \
  AWS_WEB_IDENTITY_TOKEN_FILE AWS_ROLE_ARN

echo "== build: build/"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
ninja -C build
echo "== build: build-release/ (Release, -O3, CPU backend; compiled only)"
cmake -S . -B build-release -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPOTUNE_CUDA=OFF >/dev/null
ninja -C build-release >/dev/null || { ninja -C build-release; exit 1; }
echo "== tests: build/"
# Two tests at a time. The suites on the emulated CUDA device (label
# cuda_emu) are computation alone, one process each (those with several ranks
# ask for the cores they use: PROCESSORS, tests/cuda.cmake). Of the rest, the
# ones that mostly wait or use one core run two at once, and every other one
# alone (PROCESSORS, the end of tests/CMakeLists.txt).
(cd build && ctest --output-on-failure --timeout 1500 -L cuda_emu -j 2 "${filter[@]}")
(cd build && ctest --output-on-failure --timeout 1500 -LE cuda_emu -j 2 "${filter[@]}")

if [ "$asan" = 1 ]; then
  echo "== build: build-asan/ (AddressSanitizer + UndefinedBehaviorSanitizer)"
  cmake -S . -B build-asan -G Ninja -DSPOTUNE_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug \
    -DCMAKE_C_FLAGS_DEBUG="-O1 -g" >/dev/null
  ninja -C build-asan
  # intercept_tls_get_addr=0: the leak check at exit can die on a garbage
  # dynamic-TLS range the runtime recorded (tests/test_util.c tu_mpirun)
  export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:detect_stack_use_after_return=0:intercept_tls_get_addr=0"
  export LSAN_OPTIONS="suppressions=$root/tests/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
  echo "== tests: build-asan/ (every CPU test; the Python ones ran above)"
  # Not again here: the Python suites; build_fails_loudly* (how CMake
  # configures, the same in both builds: no program of ours runs);
  # gpu_check_sh (the GPU check script's table, budget and stand-ins: the
  # programs its dry run starts are under test here in their own suites)
  (cd build-asan && ctest --output-on-failure --timeout 3000 -j 2 -LE python \
    -E '^(build_fails_loudly|build_fails_loudly_cuda|gpu_check_sh)$' "${filter[@]}")
fi
echo "== all tests passed"
