#!/bin/bash
# One full-size V4.1 TP8 rank (dummy weights) on one GPU: the GPU tests of the decode-slot graphs (both families),
# then a decode step with the per-request caches (eager), in decode slots (eager) and in decode slots as one CUDA
# graph, at 1 and 64 requests with the slots sized for max_seq_len 9216; the kernels of the graph step; the graph
# step with the attention and index plugins off, and with the rope, attention and index plugins off
# (benchmarks/README.md, sessions 39-42). TEST_S=0 skips the GPU tests; BUILD_ARGS go to `dsflash build`; BUDGET_S
# (default 585) caps the seconds it runs; TUNE_S (default 0) is the build's tuning budget; REQUESTS (default 1,64) the
# request counts; AB=0 skips the plugins-off steps. All 40 layers need ~600 s and an H200 (the rank holds ~70 GiB). LAYERS=22
# builds the same widths with 22 layers (half ratio-2, half ratio-1, as the full schedule), planned at 47.8 GiB; it
# loads on an 80 GB H100 with a 53.7 GiB peak (session 43, after session 42's binder fix). OVERRIDE (JSON, with
# LAYERS=40) goes to --json-model-override-args: Engram tables of a tenth of the rows (the same lookups per token)
# plan the 40 layers at 44.0 instead of 65.3 GiB, for an 80 GB card. dsflash installed
# (`pip install -e .`). Writes its logs and slots_full.json under $OUT (default out/slots-full).
set -u
OUT=${OUT:-out/slots-full}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONSAFEPATH=1
D=${WORK:-/tmp/slots-full}; mkdir -p "$D"
OVERRIDE=${OVERRIDE:-'{}'}
if [ "${LAYERS:-40}" = 22 ]; then
    OVERRIDE='{"num_hidden_layers": 22, "compress_ratios": [0,0,2,2,2,2,2,2,2,2,2,2,1,1,1,1,1,1,1,1,1,1,0,0,0],
               "kv_source_layer_ids": [2,12], "index_source_layer_ids": [2,8,12,16,20],
               "candidate_source_layer_id": 12, "dspark_target_layer_ids": [19,20,21]}'
fi
if [ "${TEST_S:-150}" != 0 ]; then
    timeout ${TEST_S:-150} python3 -m pytest -q -rA tests/kernels/test_engine_plugins.py -k "slot_graphs" > "$OUT/gpu_tests.log" 2>&1
fi
python3 -m dsflash.serve.cli build --preset v41/full --tp 8 --arch sm90 --dummy-weights --tune-budget-s ${TUNE_S:-0} \
    --max-num-tokens 1024 --max-seq-len 9216 --json-model-override-args "$OVERRIDE" ${BUILD_ARGS:-} --out "$D/full" \
    > "$OUT/build_full.log" 2>&1
AB_FLAGS="--without-flag fused_attention,fused_scores --without-flag fused_rope,fused_attention,fused_scores"
[ "${AB:-1}" = 0 ] && AB_FLAGS=""
timeout $((${BUDGET_S:-585} - SECONDS)) python3 benchmarks/step_chunks.py --engine "$D/full" --simulate-rank 0 \
    --requests ${REQUESTS:-1,64} --steps 5 --fused-only --decode-slots --slot-max-seq-len 9216 --kernel-time $AB_FLAGS \
    --json "$OUT/slots_full.json" \
    > "$OUT/slots_full.log" 2>&1
grep -E "passed|failed" "$OUT/gpu_tests.log" 2>/dev/null | tail -2; grep "^|" "$OUT/slots_full.log"
