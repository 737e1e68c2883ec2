# tests/store.cmake — object-store suites (checkpoint/store*, uploader).
# file:// runs in-process. The S3 suites run against a real S3-compatible
# server (OpenStack Swift + s3api on 127.0.0.1, scripts/swift-s3.sh) that the
# fixture tests s3_server_start / s3_server_stop start and stop; install its
# packages once with scripts/install-s3-test-deps.sh. Two build trees can test
# at the same time with different SPOTUNE_TEST_S3_PORT / _BACKEND_PORT values.
set(SPOTUNE_TEST_S3_PORT 28080 CACHE STRING "S3 port of the local test server")
set(SPOTUNE_TEST_S3_BACKEND_PORT 26010 CACHE STRING "First of its 3 backend ports")

set(store_swift ${CMAKE_SOURCE_DIR}/scripts/swift-s3.sh)
spotune_require(${store_swift})
set(store_server_env
  SWIFT_S3_BASE=${CMAKE_BINARY_DIR}/swift-s3
  SWIFT_S3_PORT=${SPOTUNE_TEST_S3_PORT}
  SWIFT_S3_BACKEND_PORT=${SPOTUNE_TEST_S3_BACKEND_PORT})
# Sanitizer build: Criterion runs each test in a child process and reports it
# passed even when LeakSanitizer (or UBSan, which recovers) complains in that
# child, so a report in the output fails the ctest entry. Suppressions for
# leaks inside libraries go in tests/lsan-store.supp.
set(store_common_env
  LSAN_OPTIONS=suppressions=${CMAKE_SOURCE_DIR}/tests/lsan-store.supp:print_suppressions=0)
set(store_fail_regex "ERROR: LeakSanitizer;ERROR: AddressSanitizer;runtime error:")
set(store_s3_env
  ${store_server_env} ${store_common_env}
  AWS_ACCESS_KEY_ID=test:tester
  AWS_SECRET_ACCESS_KEY=spotune-local-test-secret-7f3a
  AWS_REGION=us-east-1
  SPOTUNE_TEST_S3_ENDPOINT=http://127.0.0.1:${SPOTUNE_TEST_S3_PORT})

# test_util.c (directories, the S3 server's endpoint and proxy) links the trainer.
spotune_test(test_store_file
  SOURCES test_store_file.c test_store_util.c test_util.c
  LIBS spotune_trainer
  LABELS store)
set_tests_properties(test_store_file PROPERTIES
  ENVIRONMENT "${store_common_env}" FAIL_REGULAR_EXPRESSION "${store_fail_regex}")
spotune_test(test_store_file_uploader
  SOURCES test_store_file_uploader.c test_store_util.c test_util.c
  LIBS spotune_trainer
  LABELS store)
set_tests_properties(test_store_file_uploader PROPERTIES
  ENVIRONMENT "${store_common_env}" FAIL_REGULAR_EXPRESSION "${store_fail_regex}")

# The S3 client on the wire against an in-process fake endpoint (no server),
# with instance-role credentials from tests/tools/fake_metadata.py.
spotune_test(test_store_wire
  SOURCES test_store_wire.c test_util.c
  LIBS spotune_trainer
  LABELS store)
# (libxml2 too: the client's XML reading is checked on its own there)
pkg_check_modules(LIBXML2_TESTS REQUIRED IMPORTED_TARGET libxml-2.0)
target_link_libraries(test_store_wire PRIVATE PkgConfig::LIBXML2_TESTS)
set_tests_properties(test_store_wire PROPERTIES
  ENVIRONMENT "${store_common_env}" FAIL_REGULAR_EXPRESSION "${store_fail_regex}")

# The lease's races, against file:// and tests/tools/fake_s3.py (no server).
spotune_test(test_lease
  SOURCES test_lease.c test_store_util.c test_util.c
  LIBS spotune_trainer
  LABELS store)
set_tests_properties(test_lease PROPERTIES
  ENVIRONMENT "${store_common_env}" FAIL_REGULAR_EXPRESSION "${store_fail_regex}")

add_test(NAME s3_server_start COMMAND bash ${store_swift} start --clean)
set_tests_properties(s3_server_start PROPERTIES
  FIXTURES_SETUP s3 ENVIRONMENT "${store_server_env}" LABELS "store;s3" TIMEOUT 90)
add_test(NAME s3_server_stop COMMAND bash ${store_swift} stop)
set_tests_properties(s3_server_stop PROPERTIES
  FIXTURES_CLEANUP s3 ENVIRONMENT "${store_server_env}" LABELS "store;s3")

foreach(suite test_store_s3 test_store_s3_fault)
  spotune_test(${suite}
    SOURCES ${suite}.c test_store_util.c test_util.c
    LIBS spotune_trainer
    LABELS "store;s3")
  # RESOURCE_LOCK: the fault suite stops the shared proxy
  set_tests_properties(${suite} PROPERTIES
    FIXTURES_REQUIRED s3 RESOURCE_LOCK swift_s3 ENVIRONMENT "${store_s3_env}" TIMEOUT 300
    FAIL_REGULAR_EXPRESSION "${store_fail_regex}")
endforeach()
