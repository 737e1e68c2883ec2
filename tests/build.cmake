# tests/build.cmake — the build itself: a missing module, module source, test
# source or suite file stops the configure step with a message naming it
# (tests/test_build_fails.sh, configure only, in a copy of the source tree);
# and the one version string, project(spotune VERSION ...), is what
# spotune --version prints and what a checkpoint records as its writer.
spotune_require(test_build_fails.sh)
add_test(NAME build_fails_loudly
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/test_build_fails.sh ${CMAKE_SOURCE_DIR} cpu)
set_tests_properties(build_fails_loudly PROPERTIES LABELS build TIMEOUT 300)
# The CUDA module's CMakeLists.txt is required when the CUDA backend is on:
# needs nvcc (without it the entry exits 77, which ctest reports as skipped).
add_test(NAME build_fails_loudly_cuda
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/test_build_fails.sh ${CMAKE_SOURCE_DIR} cuda)
set_tests_properties(build_fails_loudly_cuda PROPERTIES LABELS "build;cuda" TIMEOUT 300
  SKIP_RETURN_CODE 77)

spotune_test(test_version SOURCES test_version.c test_util.c LIBS spotune_trainer LABELS build)
add_dependencies(test_version spotune)
target_compile_definitions(test_version PRIVATE SPOTUNE_CMAKE_VERSION="${PROJECT_VERSION}")
set_tests_properties(test_version PROPERTIES TIMEOUT 300)
