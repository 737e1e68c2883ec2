# Python-side tests: data preparation (scripts/prepare_data.py), the plot of
# a run's metrics (scripts/plot_metrics.py), a step's GPU time by kernel
# (scripts/kernel_shares.py), where a kernel's warps wait (scripts/stall_lines.py)
# and the merged export under PEFT.
# Needs: pip install -r scripts/requirements-data.txt
find_program(SPOTUNE_PYTHON3 python3 REQUIRED)
spotune_require(test_prepare_data.py test_plot_metrics.py)
add_test(NAME prepare_data_py COMMAND python3 ${CMAKE_SOURCE_DIR}/tests/test_prepare_data.py)
set_tests_properties(prepare_data_py PROPERTIES LABELS "python" TIMEOUT 300)
# scripts/plot_metrics.py (needs scripts/requirements-plot.txt: matplotlib)
add_test(NAME plot_metrics_py COMMAND python3 ${CMAKE_SOURCE_DIR}/tests/test_plot_metrics.py)
set_tests_properties(plot_metrics_py PROPERTIES LABELS "python" TIMEOUT 300)
# scripts/kernel_shares.py (the standard library only): a step's GPU time by
# kernel from Nsight Compute's CSV, on an excerpt of a real one
spotune_require(test_kernel_shares.py fixtures/ncu_step_durations.csv)
add_test(NAME kernel_shares_py COMMAND python3 ${CMAKE_SOURCE_DIR}/tests/test_kernel_shares.py)
set_tests_properties(kernel_shares_py PROPERTIES LABELS "python" TIMEOUT 120)
# scripts/stall_lines.py (the standard library only): where a kernel's warps
# wait, by instruction, from Nsight Compute's source view, on an excerpt of a
# real one
spotune_require(test_stall_lines.py fixtures/ncu_source_forward_wgmma.csv)
add_test(NAME stall_lines_py COMMAND python3 ${CMAKE_SOURCE_DIR}/tests/test_stall_lines.py)
set_tests_properties(stall_lines_py PROPERTIES LABELS "python" TIMEOUT 120)
# tests/check_fixtures.py: every golden-value fixture of tests/fixtures/ made
# again by its scripts/make_*.py generator from torch, transformers, PEFT and
# bitsandbytes (scripts/requirements-hf.txt) and compared with the committed
# one (float32 within rel 1e-6, the rest exact). Without the packages exit 77:
# skipped (scripts/test.sh installs them and makes that a failure).
spotune_require(check_fixtures.py)
add_test(NAME fixtures_reproduce_py COMMAND python3 ${CMAKE_SOURCE_DIR}/tests/check_fixtures.py)
set_tests_properties(fixtures_reproduce_py PROPERTIES LABELS "python" TIMEOUT 900
                     SKIP_RETURN_CODE 77)
# scripts/check_merged_export.py --fixtures: spotune trains and exports every
# tests/fixtures/hf architecture; the merged model must generate and score as
# base + adapter under PEFT. Needs torch, transformers 5.24, peft 0.21.2 and
# h5py; without them the script exits 77 and ctest reports the test skipped
# (scripts/test.sh installs them: scripts/install-deps.sh --python --hf).
add_test(NAME check_merged_export_py
         COMMAND python3 ${CMAKE_SOURCE_DIR}/scripts/check_merged_export.py --fixtures
                 --spotune $<TARGET_FILE:spotune>)
set_tests_properties(check_merged_export_py PROPERTIES LABELS "python" TIMEOUT 900
                     SKIP_RETURN_CODE 77)
# scripts/soak.py --quick: the preemption campaign's smoke run (about 80 s):
# 12 interruptions of LoRA, full, QDoRA and gathered full runs on 1-4 ranks,
# local and through its own S3 server, each resume and the final result
# checked (docs/reliability.md). A new random seed each run, printed first:
# `scripts/soak.py --seed N` makes the same choices again.
spotune_require(../scripts/soak.py)
add_test(NAME soak_quick_py
         COMMAND python3 ${CMAKE_SOURCE_DIR}/scripts/soak.py --quick --spotune $<TARGET_FILE:spotune>)
set_tests_properties(soak_quick_py PROPERTIES LABELS "python;soak" TIMEOUT 900)
