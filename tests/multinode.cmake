# tests/multinode.cmake — spotune across several hosts made on this machine
# (tests/multinode/multinode.sh): network namespaces as nodes, mpirun across
# them through a launch agent in place of ssh, the S3 test server on a
# storage node. One ctest entry per case; each makes its own namespaces
# (names unique to the run) and removes them. The storage node runs its own
# S3 server (scripts/swift-s3.sh) on the loopback of its namespace, where
# its ports cannot meet any other server's: no fixture and no ports to set,
# and it runs alongside the other S3 suites. Where namespaces cannot be made
# (not root, no ip or unshare) every case is skipped (77) with the reason.
# RESOURCE_LOCK: the cases measure how fast a job ends after a failure, so
# they run one at a time.
spotune_require(multinode/mn_forward.c multinode/mn_audit.c multinode/multinode.sh
  multinode/agent.sh)
add_executable(spotune-mn-forward multinode/mn_forward.c)
add_executable(spotune-mn-audit multinode/mn_audit.c)
target_link_libraries(spotune-mn-audit PRIVATE spotune_trainer)

foreach(case trajectory launch_hostfile node_lost partition storage_partition
             resume_fewer_ranks sharded_shared_dir sharded_spread doctor spot_watch)
  add_test(NAME multinode_${case}
    COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/multinode/multinode.sh ${CMAKE_BINARY_DIR} ${case})
  set_tests_properties(multinode_${case} PROPERTIES
    LABELS multinode SKIP_RETURN_CODE 77 TIMEOUT 600 RESOURCE_LOCK multinode
    FAIL_REGULAR_EXPRESSION "ERROR: LeakSanitizer;ERROR: AddressSanitizer;runtime error:")
endforeach()
set_tests_properties(multinode_storage_partition multinode_resume_fewer_ranks
  multinode_sharded_spread PROPERTIES
  LABELS "multinode;s3")
