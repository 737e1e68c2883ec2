# Python-side tests: data preparation (scripts/prepare_data.py).
# Needs: pip install -r scripts/requirements-data.txt
find_program(SPOTUNE_PYTHON3 python3)
if(SPOTUNE_PYTHON3)
  add_test(NAME prepare_data_py COMMAND python3 ${CMAKE_SOURCE_DIR}/tests/test_prepare_data.py)
  set_tests_properties(prepare_data_py PROPERTIES LABELS "python" TIMEOUT 300)
else()
  message(STATUS "python3 not found: the Python tests are not registered")
endif()
