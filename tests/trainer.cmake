# Suites of the kernels and trainer modules.
spotune_test(test_ops SOURCES test_ops.c LIBS spotune_kernels)
if(TARGET spotune_trainer)
  foreach(suite config model_hf data train_cpu ckpt resume)
    if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/test_${suite}.c)
      spotune_test(test_${suite} SOURCES test_${suite}.c test_util.c LIBS spotune_trainer)
    endif()
  endforeach()
endif()
