#!/usr/bin/env bash
# The default command's robustness matrix (docs/training.md, "The default recipe on every
# floating-point path"): the whole `rlflow run examples/grpo.toml` (SFT warm start built from
# scratch, then GRPO) for each numeric path x train seed, one run at a time, each with its own
# model and run directory under OUT. Prints one line per run: path, seed, warm-start steps,
# accuracy before -> after, wall and user+sys CPU seconds.
#   tests/tools/default_matrix.sh OUT [PATH...]      (run from the repository root, after setup.sh)
# PATH is "native" (the library's own choice), an OpenBLAS core type ("Haswell", "SkylakeX"),
# "fp32" (--set model.precision=fp32), "isa=AVX2" / "isa=AVX512_CORE" (ONEDNN_MAX_CPU_ISA), or
# "threads=N" (OMP_NUM_THREADS=N: a machine with another number of cores; N above the cores
# here gives that machine's numbers, not its time).
# SEEDS (default "1 2 3") picks the train seeds; extra --set options go in SETS.
set -u
out=${1:?usage: default_matrix.sh OUT [PATH...]}
shift
paths=("$@")
[ ${#paths[@]} -eq 0 ] && paths=(native Haswell SkylakeX)
mkdir -p "$out"
for p in "${paths[@]}"; do
  for seed in ${SEEDS:-1 2 3}; do
    name="${p//=/_}_s$seed"
    rm -rf "$out/$name-model" "$out/$name-run"
    envs=() sets=()
    case "$p" in
      native) ;;
      fp32) sets=(--set model.precision=fp32) ;;
      isa=*) envs=(ONEDNN_MAX_CPU_ISA="${p#isa=}") ;;
      threads=*) envs=(OMP_NUM_THREADS="${p#threads=}") ;;
      *) envs=(OPENBLAS_CORETYPE="$p") ;;
    esac
    /usr/bin/time -f "TIME wall %e user %U sys %S" env "${envs[@]}" ./build/rlflow run examples/grpo.toml \
      --set model.path="$out/$name-model" --set logging.dir="$out/$name-run" --set train.seed="$seed" \
      "${sets[@]}" ${SETS:-} > "$out/$name.log" 2>&1
    before=$(sed -n 's/.*validation before training: accuracy \([0-9.]*\).*/\1/p' "$out/$name.log")
    after=$(sed -n 's/.*validation accuracy: [0-9.]* -> \([0-9.]*\).*/\1/p' "$out/$name.log")
    sft=$(sed -n 's/.*sft step \([0-9]*\) | check accuracy.*stopping.*/\1/p' "$out/$name.log")
    t=$(sed -n 's/^TIME wall \([0-9.]*\) user \([0-9.]*\) sys \([0-9.]*\)/\1 \2 \3/p' "$out/$name.log")
    read -r wall user sys <<< "${t:-? 0 0}"
    printf '%s seed %s: sft %s steps, %s -> %s, wall %s s, cpu %.0f s\n' "$p" "$seed" "${sft:-all}" \
      "${before:-?}" "${after:-?}" "$wall" "$(echo "$user + $sys" | bc)"
  done
done
