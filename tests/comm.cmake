# tests/comm.cmake — the comm suite: in-process checks of a world of one, and
# MPI scenarios run by spawning `mpirun ... spotune-comm-prog CASE` (a
# Criterion test process must never call MPI_Init itself).
add_executable(spotune-comm-prog comm_prog.c)
target_link_libraries(spotune-comm-prog PRIVATE spotune_comm)
if(SPOTUNE_CUDA)
  target_compile_definitions(spotune-comm-prog PRIVATE SPOTUNE_COMM_NCCL)
  target_link_libraries(spotune-comm-prog PRIVATE CUDA::cudart) # its own device buffers
endif()

get_filename_component(mpi_bindir "${MPIEXEC_EXECUTABLE}" DIRECTORY)
find_program(SPOTUNE_MPIRUN mpirun HINTS "${mpi_bindir}")
if(NOT SPOTUNE_MPIRUN)
  set(SPOTUNE_MPIRUN "${MPIEXEC_EXECUTABLE}")
endif()

spotune_test(test_comm SOURCES test_comm.c LIBS spotune_comm LABELS comm)
if(SPOTUNE_CUDA)
  target_compile_definitions(test_comm PRIVATE SPOTUNE_COMM_NCCL)
  add_dependencies(test_comm spotune)
endif()
add_dependencies(test_comm spotune-comm-prog)
target_compile_definitions(test_comm PRIVATE
  SPOTUNE_COMM_PROG="$<TARGET_FILE:spotune-comm-prog>"
  SPOTUNE_MPIEXEC="${SPOTUNE_MPIRUN}")
set_tests_properties(test_comm PROPERTIES TIMEOUT 300)

# scripts/launch.sh: the commands it builds, and one real 2-rank launch.
spotune_require(test_launch.sh check.sh)
add_test(NAME launch_sh COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/test_launch.sh ${CMAKE_BINARY_DIR})
set_tests_properties(launch_sh PROPERTIES TIMEOUT 300 LABELS comm)
