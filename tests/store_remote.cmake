# tests/store_remote.cmake — training with checkpoints in the local S3 test server
# (the s3 fixture of tests/store.cmake starts and stops it).
spotune_test(test_remote SOURCES test_remote.c remote_util.c test_util.c LIBS spotune_trainer
  LABELS "s3")
spotune_test(test_remote_ranks SOURCES test_remote_ranks.c remote_util.c test_util.c
  LIBS spotune_trainer LABELS "s3")
set_tests_properties(test_remote test_remote_ranks PROPERTIES
  FIXTURES_REQUIRED s3 RESOURCE_LOCK swift_s3 ENVIRONMENT "${store_s3_env}" TIMEOUT 900)

# spotune doctor: the host, storage, store (this server: good and bad
# credentials, an endpoint down), preemption (a fake metadata service) and
# mpirun checks.
spotune_test(test_doctor SOURCES test_doctor.c test_util.c LIBS spotune_trainer LABELS "s3")
set_tests_properties(test_doctor PROPERTIES
  FIXTURES_REQUIRED s3 RESOURCE_LOCK swift_s3 ENVIRONMENT "${store_s3_env}" TIMEOUT 600)
