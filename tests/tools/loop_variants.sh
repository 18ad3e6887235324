#!/bin/bash
# Runs recipe variants with two rlflow binaries and compares their per-step metrics exactly
# (tests/tools/compare_metrics.py: every key but perf/* and time). Used to check that the one
# RL loop (controller/controller.c with the in-process roles) gives the metrics of the loop it
# replaced (main at c637b7a, controller/rl_step.c), docs/architecture.md.
#
# Usage: tests/tools/loop_variants.sh OLD_RLFLOW NEW_RLFLOW OUT_DIR [case...]
# Cases (default: all): default ppo dynamic kl epochs2 lora programs rm rm_dynamic_kl calc. Each runs 30 steps
# from a warm start, validating every 10 steps, no checkpoints but the last. Environment:
#   MODEL, DATA        the arithmetic warm start and data directory (train.jsonl, val.jsonl)
#   CALC_MODEL, CALC_DATA   the multiplication warm start and data for the calculator case
#   PYTHON             a python3 with zmq and google.protobuf (the reward-program case)
set -u
OLD=$1 NEW=$2 OUT=$3
shift 3
SRC=$(cd "$(dirname "$0")/../.." && pwd)
MODEL=${MODEL:-/tmp/lead/m} DATA=${DATA:-/tmp/m20/data/arith3d}
CALC_MODEL=${CALC_MODEL:-/tmp/h19b_curve/models/multiply-sft} CALC_DATA=${CALC_DATA:-/tmp/h19b_curve/data/multiply}
PYTHON=${PYTHON:-/usr/bin/python3}
CASES=${*:-default ppo dynamic kl epochs2 lora programs rm rm_dynamic_kl calc}
status=0
for c in $CASES; do
  R=examples/grpo.toml M=$MODEL D=$DATA X=()
  case $c in
    default) ;;
    ppo) R=examples/ppo.toml ;;
    dynamic) X=(--set algorithm.dynamic_sampling=true) ;;
    kl) X=(--set algorithm.kl_coef=0.01) ;;
    epochs2) X=(--set train.ppo_epochs=2) ;;
    lora) X=(--set lora.enabled=true) ;;
    rm) X=(--set "reward.model=$SRC/tests/data/reward_model" --set reward.model_weight=100) ;;
    rm_dynamic_kl) X=(--set "reward.model=$SRC/tests/data/reward_model" --set reward.model_weight=100
                      --set algorithm.dynamic_sampling=true --set algorithm.kl_coef=0.01) ;;
    calc) R=examples/grpo_calculator.toml M=$CALC_MODEL D=$CALC_DATA ;;
    programs) ;;
    *) echo "unknown case $c"; exit 2 ;;
  esac
  for which in old new; do
    bin=$OLD; [ $which = new ] && bin=$NEW
    d=$OUT/$which/$c
    rm -rf "$d"; mkdir -p "$d"
    P=()
    [ $c = programs ] && P=(--set "reward.programs=[[\"$PYTHON\",\"$SRC/tests/tools/reward_program_started.py\",\"--log\",\"$d/program.txt\"]]")
    (cd "$SRC" && "$bin" run $R --set model.path=$M --set data.train=$D/train.jsonl --set data.val=$D/val.jsonl \
       --set train.steps=30 --set logging.val_every=10 --set checkpoint.every=0 --set logging.dir=$d \
       "${X[@]}" "${P[@]}" > "$d/log.txt" 2>&1) || { echo "$c ($which): rlflow failed, see $d/log.txt"; status=1; }
  done
  printf '%-9s ' "$c"
  python3 "$SRC/tests/tools/compare_metrics.py" "$OUT/old/$c/metrics.jsonl" "$OUT/new/$c/metrics.jsonl" | tail -1
  python3 "$SRC/tests/tools/compare_metrics.py" "$OUT/old/$c/metrics.jsonl" "$OUT/new/$c/metrics.jsonl" > /dev/null || status=1
done
exit $status
