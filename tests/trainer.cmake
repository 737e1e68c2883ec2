# Suites of the kernels and trainer modules.
spotune_test(test_ops SOURCES test_ops.c test_ops_step.c test_ops_vmath.c test_ops_skinny.c ops_util.c op_checks.c op_specs.c op_replay.c
  LIBS spotune_kernels)
# under the sanitizers the skinny products' tiles check every load here
# (where their edges are driven), not only their operands' spans
# (kernels/cpu/cpu_skinny.c)
set_property(TEST test_ops APPEND PROPERTY ENVIRONMENT SPOTUNE_ASAN_SKINNY=loads)
spotune_test(test_ops_attention SOURCES test_ops_attention.c ops_util.c LIBS spotune_kernels)
foreach(suite config model_hf model_io data train_cpu train_inputs ckpt_shard distributed export_hf
              init_from nf4 packing)
  spotune_test(test_${suite} SOURCES test_${suite}.c test_util.c LIBS spotune_trainer)
endforeach()
# the checkpoint commands and what a checkpoint must hold: one fixture (cmd_ckpt_util)
foreach(suite cmd_ckpt ckpt_contents)
  spotune_test(test_${suite} SOURCES test_${suite}.c cmd_ckpt_util.c test_util.c
               LIBS spotune_trainer)
endforeach()
# the checkpoint directory protocol; a rank's shard puts into the store
spotune_test(test_ckpt SOURCES test_ckpt.c test_ckpt_put.c test_util.c LIBS spotune_trainer)
# launch traces, captured spans, and training with them against without
spotune_test(test_graphs SOURCES test_graphs.c graphs_util.c test_util.c LIBS spotune_trainer)
# spotune plan: memory, speed and cost before renting
# spotune doctor's host.blas (the rest of the doctor: test_doctor, with the S3 server)
spotune_test(test_doctor_blas SOURCES test_doctor_blas.c test_util.c LIBS spotune_trainer)
spotune_test(test_plan SOURCES test_plan.c test_plan_model.c test_util.c LIBS spotune_trainer)
# preemption and resume, the checkpoint policy, long paths, stops within a step or a
# validation: one fixture (resume_util)
foreach(suite resume resume_choice ckpt_policy rank_change long_paths stop_early)
  spotune_test(test_${suite} SOURCES test_${suite}.c resume_util.c test_util.c
               LIBS spotune_trainer)
endforeach()

# scripts/spot-run.sh against a fake cloud metadata service on loopback
# (python3: required by tests/python.cmake).
spotune_require(test_spot_run.sh)
add_test(NAME spot_run COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/test_spot_run.sh ${CMAKE_BINARY_DIR})
set_tests_properties(spot_run PROPERTIES TIMEOUT 600)
