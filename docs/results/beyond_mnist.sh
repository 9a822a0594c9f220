#!/usr/bin/env bash
# Beyond the paper, MNIST experiments: Monge's normalized α² rule against the fixed rule, and the
# cyclical schedule against the constant one. One job at a time on one thread.
#
# Scaled-down defaults (what docs/results/beyond.md reports); the paper's scale is
#   EPOCHS=400 SEEDS="0 1 2 3 4 5 6 7 8 9" EVAL="" BURNIN=1000 WIDTHS="400 800" ./beyond_mnist.sh
# Usage: SGRLD_DATA_DIR=DIR docs/results/beyond_mnist.sh OUT_DIR [alpha2|cyclical|all]
set -euo pipefail
OUT=${1:?output directory}
PART=${2:-all}
EPOCHS=${EPOCHS:-4}
SEEDS=${SEEDS:-"0 1"}
WIDTHS=${WIDTHS:-400}
BURNIN=${BURNIN:-500}
EVAL=${EVAL-"--eval-subset 2000"}
DATA=${SGRLD_DATA_DIR:?set SGRLD_DATA_DIR to the folder holding MNIST (or its mnist/ folder)}
SGRLD=${SGRLD:-sgrld}
FIXED_GRID=${FIXED_GRID:-"0 0.1 0.5 1.25 2 3"} # the paper's α² (N=400 grid subset; 0 = SGLD)
C_GRID=${C_GRID:-"0.01 0.03 0.1 0.3"}          # normalized c = α²‖m‖² (‖m‖² ≈ 0.1 here)

run() {  # run NAME ARGS...: skip finished runs, so the script can be restarted
  local dir="$OUT/$1"; shift
  if [[ -f "$dir/results.json" ]] && grep -q '"status": "completed"\|"status": "broken_down"' "$dir/results.json"; then
    return
  fi
  echo "== $dir" >&2
  "$SGRLD" sample --dataset mnist --epochs "$EPOCHS" --burn-in "$BURNIN" $EVAL \
    --data-dir "$DATA" --threads 1 --no-progress --no-plot --resume --out "$dir" "$@" \
    || [[ $? == 3 ]]  # a broken-down chain is a result
}

if [[ $PART == alpha2 || $PART == all ]]; then
  for width in $WIDTHS; do
    for prior in ${PRIORS:-horseshoe gaussian}; do
      lr=$([[ $prior == horseshoe ]] && echo 0.25 || echo 0.05)  # paper's Monge / Identity ℓ
      for seed in $SEEDS; do
        for a in $FIXED_GRID; do
          run "alpha2/$prior-N$width-fixed$a-s$seed" --prior "$prior" --width "$width" \
            --sampler monge --lr "$lr" --alpha2 "$a" --seed "$seed"
        done
        for c in $C_GRID; do
          run "alpha2/$prior-N$width-norm$c-s$seed" --prior "$prior" --width "$width" \
            --sampler monge --lr "$lr" --alpha2 "$c" --alpha2-rule normalized --seed "$seed"
        done
      done
    done
  done
fi

if [[ $PART == cyclical || $PART == all ]]; then
  CYCLES=${CYCLES:-2}
  R=${R:-0.5}
  for seed in $SEEDS; do
    for spec in "identity:identity --lr 0.25" "monge:monge --lr 0.25 --alpha2 1.25" \
        "shampoo:shampoo --lr 0.005" "monge_lr0.1:monge --lr 0.1 --alpha2 1.25"; do
      name=${spec%%:*}
      spec=${spec#*:}
      run "cyclical/$name-constant-s$seed" --prior horseshoe --width 400 --sampler $spec \
        --seed "$seed"
      run "cyclical/$name-cyclical-s$seed" --prior horseshoe --width 400 --sampler $spec \
        --seed "$seed" --schedule cyclical --cycles "$CYCLES" --explore-fraction "$R"
    done
  done
fi
