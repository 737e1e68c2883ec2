# Suites of the CUDA backend: every op against the CPU backend (RoPE and
# attention, real attention shapes included, in test_cuda_attention; the
# elementwise ops' vector paths against their scalar kernels, bit for bit,
# in test_cuda_elementwise), one
# decoder layer at the 7B shape against the CPU, the whole model (one step,
# and a 50-step LoRA run through the spotune binary) on CUDA against the CPU,
# and the NCCL paths of training through a one-rank communicator. Registered
# in every build: without a usable CUDA device (or without the CUDA backend)
# each prints "skipped: no usable CUDA device: " and the CUDA error, and
# exits 77, which ctest counts as skipped.
spotune_test(test_cuda_ops SOURCES test_cuda_ops.c test_cuda_ops_weights.c cuda_ops_util.c
  op_checks.c op_specs.c op_replay.c
  LIBS spotune_kernels LABELS cuda)
spotune_test(test_cuda_elementwise SOURCES test_cuda_elementwise.c cuda_ops_util.c
  LIBS spotune_kernels LABELS cuda)
spotune_test(test_cuda_attention SOURCES test_cuda_attention.c cuda_ops_util.c
  LIBS spotune_kernels LABELS cuda)
spotune_test(test_cuda_layer SOURCES test_cuda_layer.c test_util.c LIBS spotune_trainer
  LABELS cuda)
set_tests_properties(test_cuda_layer PROPERTIES TIMEOUT 900)
spotune_test(test_cuda_model SOURCES test_cuda_model.c test_util.c graphs_util.c LIBS spotune_trainer
  LABELS cuda)
add_dependencies(test_cuda_model spotune)
set_tests_properties(test_cuda_model PROPERTIES TIMEOUT 900)
spotune_test(test_cuda_comm SOURCES test_cuda_comm.c test_util.c LIBS spotune_trainer
  LABELS cuda)
set_tests_properties(test_cuda_comm PROPERTIES TIMEOUT 300)

# The fused attention kernels' own source (kernels/cuda/cuda_flash_kernels.cuh)
# on the CPU emulation of the device (tests/cuda_emu: fibers for threads, the
# warp operations and mma.sync emulated) against the CPU backend: runs in
# every build, without a GPU, the sanitizer build included (every load and
# store of the kernels bounds-checked). C++ only because the kernels are
# templates.
enable_language(CXX)
spotune_test(test_cuda_emu SOURCES cuda_emu/test_flash_emu.cc cuda_emu/cuda_emu.c
  LIBS spotune_kernels LABELS cuda_emu)
target_compile_definitions(test_cuda_emu PRIVATE SPOTUNE_CUDA_EMU)
target_include_directories(test_cuda_emu PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/cuda_emu)
if(SPOTUNE_WERROR)
  target_compile_options(test_cuda_emu PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
endif()

# scripts/gpu_check.sh without a GPU (here, and in CI): every GPU step is a
# SKIPPED row with its reason, the table has every row, the whole run stays
# far inside its budget; and with stand-in programs, PASS, FAIL, TIMEOUT and
# SKIPPED rows, the budget cut-off, both MFU conventions and the Python
# peer's import error (tests/test_gpu_check.sh).
spotune_require(test_gpu_check.sh check.sh)
add_test(NAME gpu_check_sh COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/test_gpu_check.sh
  ${CMAKE_BINARY_DIR})
set_tests_properties(gpu_check_sh PROPERTIES TIMEOUT 300 LABELS "cuda;gpu_check")
