# `spotune bench`'s checks of step 1 (the loss of random weights, the same
# step on the CPU backend, both MFU conventions, --probe-cuda), on the CPU.
spotune_test(test_bench SOURCES test_bench.c test_util.c LIBS spotune_trainer LABELS bench)
add_dependencies(test_bench spotune)
set_tests_properties(test_bench PROPERTIES TIMEOUT 600)
