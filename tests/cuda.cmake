# Suites of the CUDA backend: every op against the CPU backend, and the whole
# model (one step, and a 50-step LoRA run through the spotune binary) on
# CUDA against the CPU. Registered in every build: without a CUDA device (or
# without the CUDA backend) each prints "skipped: no CUDA device" and exits
# 77, which ctest counts as skipped.
spotune_test(test_cuda_ops SOURCES test_cuda_ops.c LIBS spotune_kernels LABELS cuda)
if(TARGET spotune_trainer)
  spotune_test(test_cuda_model SOURCES test_cuda_model.c test_util.c LIBS spotune_trainer
    LABELS cuda)
  if(TARGET spotune)
    add_dependencies(test_cuda_model spotune)
  endif()
  set_tests_properties(test_cuda_model PROPERTIES TIMEOUT 900)
endif()
