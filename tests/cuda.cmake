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
spotune_test(test_cuda_attention SOURCES test_cuda_attention.c test_cuda_attention_cudnn.c
  cuda_ops_util.c
  LIBS spotune_kernels LABELS cuda)
spotune_test(test_cudnn_graphs SOURCES test_cudnn_graphs.c LIBS spotune_kernels LABELS cuda)
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
spotune_test(test_cuda_ranks SOURCES test_cuda_ranks.c test_util.c LIBS spotune_trainer
  LABELS cuda)
add_dependencies(test_cuda_ranks spotune)
set_tests_properties(test_cuda_ranks PROPERTIES TIMEOUT 900)
spotune_test(test_cuda_doctor SOURCES test_cuda_doctor.c test_util.c LIBS spotune_trainer
  LABELS cuda)
add_dependencies(test_cuda_doctor spotune)

# The fused attention kernels' own source (kernels/cuda/cuda_flash_*.cuh)
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

# The emulated cuBLAS and cuBLASLt (cuda_emu/emu_cublas.cc, which the
# emulated module below uses for the backend's products) against the
# libraries' documented definition and refusals: every build.
# And its streams that lag (SPOTUNE_CUDA_EMU_DEFER, emu_runtime.cc).
foreach(t test_emu_cublas_api test_emu_streams)
  spotune_test(${t} SOURCES cuda_emu/${t}.cc cuda_emu/emu_cublas.cc cuda_emu/emu_runtime.cc
    cuda_emu/cuda_emu.c LABELS cuda_emu)
  target_compile_definitions(${t} PRIVATE SPOTUNE_CUDA_EMU)
  target_include_directories(${t} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/cuda_emu)
  set_target_properties(${t} PROPERTIES CXX_STANDARD 20 CXX_STANDARD_REQUIRED ON)
  if(SPOTUNE_WERROR)
    target_compile_options(${t} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  endif()
endforeach()

# The CUDA backend itself on the emulated device: its .cu files compiled as
# C++ for it (cuBLAS and cuBLASLt: emu_cublas.cc, from their documentation), a module
# like libspotune_cuda.so that SPOTUNE_CUDA_MODULE points a process at, so
# that the CUDA suites below run their checks without a GPU ("emu_" + the
# suite's name). Never loaded unless named. Only in builds with the CUDA
# backend.
if(SPOTUNE_CUDA)
  set(emu_cuda_sources cuda_backend.cu cuda_matmul.cu cuda_matmul_ops.cu cuda_skinny.cu cuda_wide.cu cuda_ops.cu cuda_nf4.cu cuda_vec.cu
    cuda_attention.cu cuda_flash.cu cuda_flash_wgmma.cu cuda_cudnn.cu cuda_cudnn_layout.cu
    cuda_doctor.cu)
  list(TRANSFORM emu_cuda_sources PREPEND ${CMAKE_SOURCE_DIR}/kernels/cuda/)
  set_source_files_properties(${emu_cuda_sources} PROPERTIES LANGUAGE CXX)
  function(spotune_emu_module name)
    add_library(${name} MODULE ${emu_cuda_sources} cuda_emu/emu_runtime.cc
      cuda_emu/emu_cublas.cc cuda_emu/cuda_emu.c)
    set_target_properties(${name} PROPERTIES
      OUTPUT_NAME ${name} PREFIX lib LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests
      POSITION_INDEPENDENT_CODE ON CXX_STANDARD 20 CXX_STANDARD_REQUIRED ON)
    target_compile_definitions(${name} PRIVATE SPOTUNE_CUDA_EMU)
    target_include_directories(${name} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/cuda_emu
      ${CMAKE_SOURCE_DIR})
    target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wno-unknown-pragmas>)
    if(SPOTUNE_WERROR)
      target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
    endif()
  endfunction()
  spotune_emu_module(spotune_cuda_emu)
  # The same module instrumented with AddressSanitizer and
  # UndefinedBehaviorSanitizer (the backend's host code, its kernels as the
  # emulated device runs them, the emulated runtime and cuBLAS), loaded by
  # the uninstrumented test programs with the ASan runtime preloaded: the
  # suites below that take seconds ("asan_emu_"; about 50 s together, ten
  # times their emulated time; attention's would take 3 minutes, the
  # model's and the layer's far more, so they run with the guard pages
  # only). The sanitizer build proper is CPU-only (no module loader).
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libasan.so
    OUTPUT_VARIABLE emu_libasan OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(IS_ABSOLUTE "${emu_libasan}" AND EXISTS "${emu_libasan}")
    spotune_emu_module(spotune_cuda_emu_asan)
    target_compile_options(spotune_cuda_emu_asan PRIVATE -fsanitize=address,undefined
      -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
    target_link_options(spotune_cuda_emu_asan PRIVATE -fsanitize=address,undefined)
  else()
    message(STATUS "the emulated CUDA module is not also built with AddressSanitizer: "
                   "${CMAKE_CXX_COMPILER} has no libasan.so")
  endif()
  # NCCL for ranks on the emulated device (cuda_emu/emu_nccl.c): preloaded
  # (LD_PRELOAD), it stands in for libnccl and the five CUDA runtime calls of
  # comm/comm_nccl.c, through shared memory between the ranks of one host;
  # it refuses to start unless the emulated module is loaded.
  add_library(spotune_nccl_emu SHARED cuda_emu/emu_nccl.c)
  set_target_properties(spotune_nccl_emu PROPERTIES
    OUTPUT_NAME spotune_nccl_emu PREFIX lib LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  target_include_directories(spotune_nccl_emu SYSTEM PRIVATE ${NCCL_INCLUDE}
    ${CUDAToolkit_INCLUDE_DIRS})
  target_link_libraries(spotune_nccl_emu PRIVATE m)
  # the emulation itself: its collectives against their definitions on
  # forked ranks, its refusals, timeouts and aborts
  spotune_test(test_nccl_emu SOURCES cuda_emu/test_nccl_emu.c LIBS spotune_nccl_emu dl m
    LABELS cuda_emu)
  target_include_directories(test_nccl_emu SYSTEM PRIVATE ${NCCL_INCLUDE}
    ${CUDAToolkit_INCLUDE_DIRS})
  set_tests_properties(test_nccl_emu PROPERTIES
    ENVIRONMENT "SPOTUNE_CUDA_MODULE=$<TARGET_FILE:spotune_cuda_emu>")
  # its guarded memory (SPOTUNE_CUDA_EMU_GUARD, set for the suites below):
  # an access past a buffer's end, or before its start, is a SIGSEGV
  spotune_test(test_emu_guard SOURCES cuda_emu/test_emu_guard.c LIBS spotune_kernels
    LABELS cuda_emu)
  set_tests_properties(test_emu_guard PROPERTIES
    ENVIRONMENT "SPOTUNE_CUDA_MODULE=$<TARGET_FILE:spotune_cuda_emu>")
  # the backend's products (cuda_matmul.cu) on the emulated cuBLAS and
  # cuBLASLt through each path: cuBLASLt, no algorithm, refused at run time
  spotune_test(test_emu_cublas SOURCES cuda_emu/test_emu_cublas.c LIBS spotune_kernels dl
    LABELS cuda_emu)
  set_tests_properties(test_emu_cublas PROPERTIES
    ENVIRONMENT "SPOTUNE_CUDA_MODULE=$<TARGET_FILE:spotune_cuda_emu>;SPOTUNE_CUDA_EMU_GUARD=1")
  # The suites on it, at reduced shapes (the real-shape tests skip: hours on
  # the emulated device), in builds with the CUDA backend (whose loader reads
  # SPOTUNE_CUDA_MODULE): cuda_model about 5 minutes here (its 50 LoRA
  # steps 2.8 of them; 8 each of QLoRA and DoRA through the spotune binary,
  # the graphs replays); test_cuda_comm's one-rank NCCL checks on the
  # emulated NCCL (15-30 s); test_cuda_layer's layer at hidden 512, seq 256
  # (35-70 s); test_cuda_ranks' two and three ranks (about 5 minutes). Not in
  # the sanitizer build (CPU-only, no module loader; test_cuda_emu runs
  # there).
  set(emu_env "SPOTUNE_CUDA_MODULE=$<TARGET_FILE:spotune_cuda_emu>;SPOTUNE_TEST_SHAPES=reduced;LD_PRELOAD=$<TARGET_FILE:spotune_nccl_emu>;SPOTUNE_CUDA_EMU_GUARD=1;SPOTUNE_CUDA_EMU_DEFER=all")
  foreach(suite test_cuda_elementwise test_cuda_ops test_cuda_attention test_cuda_layer
      test_cuda_comm test_cuda_ranks test_cuda_doctor)
    add_test(NAME emu_${suite} COMMAND ${suite} --jobs 1)
    set_tests_properties(emu_${suite} PROPERTIES LABELS "cuda_emu" TIMEOUT 900
      ENVIRONMENT "${emu_env}"
      FAIL_REGULAR_EXPRESSION "ERROR: LeakSanitizer;ERROR: AddressSanitizer;runtime error:")
  endforeach()
  # cuda_model in two, so that scripts/test.sh runs its halves side by side:
  # the 50-step LoRA run against the CPU (more than half of its time), and
  # every other case
  add_test(NAME emu_test_cuda_model COMMAND test_cuda_model --jobs 1
    --filter "cuda_model/!(lora_training_tracks_the_cpu)")
  add_test(NAME emu_test_cuda_model_lora_training COMMAND test_cuda_model --jobs 1
    --filter "cuda_model/lora_training_tracks_the_cpu")
  set_tests_properties(emu_test_cuda_model emu_test_cuda_model_lora_training PROPERTIES
    LABELS "cuda_emu" TIMEOUT 900 ENVIRONMENT "${emu_env}"
    FAIL_REGULAR_EXPRESSION "ERROR: LeakSanitizer;ERROR: AddressSanitizer;runtime error:")
  # the layer with LoRA's narrow products split three ways (cuda_skinny.cu:
  # the emulated device has one multiprocessor, so the splits it would
  # choose are mostly one): the last block's sum of the splits on every
  # product of a layer's forward and backward
  add_test(NAME emu_test_cuda_layer_skinny_splits COMMAND test_cuda_layer --jobs 1)
  set_tests_properties(emu_test_cuda_layer_skinny_splits PROPERTIES LABELS "cuda_emu" TIMEOUT 900
    ENVIRONMENT "${emu_env};SPOTUNE_CUDA_SKINNY=splits=3"
    FAIL_REGULAR_EXPRESSION "ERROR: LeakSanitizer;ERROR: AddressSanitizer;runtime error:")
  set_property(TEST emu_test_cuda_ranks APPEND PROPERTY ENVIRONMENT SPOTUNE_CUDA_EMU_DEVICES=3)
  set_property(TEST emu_test_cuda_doctor APPEND PROPERTY ENVIRONMENT SPOTUNE_CUDA_EMU_DEVICES=2)
  # scripts/test.sh runs two cuda_emu suites at once: those with two or three
  # ranks run alone (a rank waits at most 60 s for its peers in the emulated
  # NCCL), and so does the emulated NCCL's own suite, whose ranks come late on
  # purpose
  set_tests_properties(emu_test_cuda_ranks emu_test_cuda_doctor test_nccl_emu PROPERTIES
    PROCESSORS 3)
  # with only the communication stream lagging (the compute stream at
  # once): a kernel reading a collective's result without waiting for it
  # reads the old values (docs/cuda.md, "Streams that lag")
  foreach(case lora_overlapped_buckets_and_graphs full_sharded_gradients_on_three_ranks)
    add_test(NAME emu_test_cuda_ranks_aux_${case} COMMAND test_cuda_ranks --jobs 1
      --filter "cuda_ranks/${case}")
    set_tests_properties(emu_test_cuda_ranks_aux_${case} PROPERTIES LABELS "cuda_emu"
      TIMEOUT 600 PROCESSORS 3
      ENVIRONMENT "SPOTUNE_CUDA_MODULE=$<TARGET_FILE:spotune_cuda_emu>;SPOTUNE_TEST_SHAPES=reduced;LD_PRELOAD=$<TARGET_FILE:spotune_nccl_emu>;SPOTUNE_CUDA_EMU_GUARD=1;SPOTUNE_CUDA_EMU_DEFER=aux;SPOTUNE_CUDA_EMU_DEVICES=3"
      FAIL_REGULAR_EXPRESSION "ERROR: LeakSanitizer;ERROR: AddressSanitizer;runtime error:")
  endforeach()
  if(TARGET spotune_cuda_emu_asan)
    foreach(suite test_cuda_ops test_cuda_elementwise test_emu_cublas)
      add_test(NAME asan_emu_${suite} COMMAND ${suite} --jobs 1)
      set_tests_properties(asan_emu_${suite} PROPERTIES LABELS "cuda_emu" TIMEOUT 600
        ENVIRONMENT "SPOTUNE_CUDA_MODULE=$<TARGET_FILE:spotune_cuda_emu_asan>;SPOTUNE_TEST_SHAPES=reduced;LD_PRELOAD=${emu_libasan};ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1:detect_stack_use_after_return=0;LSAN_OPTIONS=suppressions=${CMAKE_CURRENT_SOURCE_DIR}/lsan.supp:print_suppressions=0;UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1"
        FAIL_REGULAR_EXPRESSION "ERROR: LeakSanitizer;ERROR: AddressSanitizer;runtime error:")
    endforeach()
  endif()
  # the ops and attention (batched, strided products) with cuBLASLt offering
  # no algorithm, and refusing at run time: every product on the fallback.
  # Of the attention, the cases that run products (the unfused path, and
  # the fused kernels compared with it); not the fused kernels' own
  # variants, cuDNN's or RoPE, which run none.
  set(lt_filter_test_cuda_ops "*")
  string(CONCAT lt_filter_test_cuda_attention "cuda_ops/!(rope_*|flash_attention_odd_shapes_*|"
    "flash_attention_dq_*|flash_attention_operands_*|*wgmma*|*cudnn*)")
  foreach(mode no-algorithm refuses)
    foreach(suite test_cuda_ops test_cuda_attention)
      add_test(NAME emu_${suite}_cublaslt_${mode} COMMAND ${suite} --jobs 1
        --filter "${lt_filter_${suite}}")
      set_tests_properties(emu_${suite}_cublaslt_${mode} PROPERTIES LABELS "cuda_emu" TIMEOUT 900
        ENVIRONMENT "SPOTUNE_CUDA_MODULE=$<TARGET_FILE:spotune_cuda_emu>;SPOTUNE_TEST_SHAPES=reduced;SPOTUNE_CUDA_EMU_GUARD=1;SPOTUNE_CUDA_EMU_CUBLASLT=${mode}"
        FAIL_REGULAR_EXPRESSION "ERROR: LeakSanitizer;ERROR: AddressSanitizer;runtime error:")
    endforeach()
  endforeach()
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

# scripts/gpu_profile.sh with a stand-in ncu printing real Nsight Compute
# output (tests/fixtures/ncu_*): the attention kernels' table, a step's
# kernel shares, attn_bench under other CUDA modules, exit 77 without ncu
# (tests/test_gpu_profile.sh).
spotune_require(test_gpu_profile.sh fixtures/ncu_dkdv_details.txt fixtures/ncu_step_durations.csv)
add_test(NAME gpu_profile_sh COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/test_gpu_profile.sh)
set_tests_properties(gpu_profile_sh PROPERTIES TIMEOUT 120 LABELS "cuda;gpu_check")
