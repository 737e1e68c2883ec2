# Suites of the kernels and trainer modules.
spotune_test(test_ops SOURCES test_ops.c LIBS spotune_kernels)
if(TARGET spotune_trainer)
  foreach(suite config model_hf model_io data train_cpu ckpt cmd_ckpt distributed)
    if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/test_${suite}.c)
      spotune_test(test_${suite} SOURCES test_${suite}.c test_util.c LIBS spotune_trainer)
    endif()
  endforeach()
  # preemption and resume, and the checkpoint policy: one fixture (resume_util)
  foreach(suite resume ckpt_policy rank_change)
    spotune_test(test_${suite} SOURCES test_${suite}.c resume_util.c test_util.c
                 LIBS spotune_trainer)
  endforeach()
endif()

# scripts/spot-run.sh against a fake cloud metadata service on loopback.
find_program(SPOTUNE_PYTHON3_FOR_SPOT python3)
if(SPOTUNE_PYTHON3_FOR_SPOT AND TARGET spotune)
  add_test(NAME spot_run COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/test_spot_run.sh ${CMAKE_BINARY_DIR})
  set_tests_properties(spot_run PROPERTIES TIMEOUT 600)
endif()
