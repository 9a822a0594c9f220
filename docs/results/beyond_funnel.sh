#!/usr/bin/env bash
# Beyond the paper, funnel experiment: Monge with m = ∇u(θ), with and without Γ, beside EMA-Monge and
# Identity, all on exact gradients at ℓ = 0.003 (Identity: its own ℓ = 0.001), both α² rules.
#
# Scaled-down defaults (what docs/results/beyond.md reports); the scale is
#   STEPS=2000000 CHAINS=3 START=reference docs/results/beyond_funnel.sh OUT
# Usage: docs/results/beyond_funnel.sh OUT_DIR
set -euo pipefail
OUT=${1:?output directory}
STEPS=${STEPS:-50000}
CHAINS=${CHAINS:-10}
START=${START:-exact}         # exact draws: the chains start in the target (stationarity check)
C=${C:-1}                     # c of the normalized rule
SGRLD=${SGRLD:-sgrld}
common=(--steps "$STEPS" --chains "$CHAINS" --start "$START" --seed 1 --no-compile
        --no-progress --jobs 1 --exact-metric)
# fixed α² = 0.1 (the paper's funnel Monge): Identity, EMA-Monge, m = ∇u(θ) without Γ ...
"$SGRLD" funnel "${common[@]}" --samplers identity,monge --out "$OUT/funnel-fixed"
# ... and with Γ (Identity again: a --samplers list cannot be empty; same seeds, same numbers)
"$SGRLD" funnel "${common[@]}" --samplers identity --correction --out "$OUT/funnel-fixed-gamma"
# the normalized rule, c = $C: EMA-Monge and m = ∇u(θ) with Γ
"$SGRLD" funnel "${common[@]}" --samplers monge --correction --alpha2-rule normalized \
  --alpha2 "$C" --out "$OUT/funnel-normalized-gamma"
# m = ∇u(θ) at a third of the step, ± Γ: what is left with Γ at ℓ = 0.003 shrinks if it is the
# Euler step's (python, as the CLI keeps the paper's ℓ)
"${PYTHON:-python}" benchmarks/beyond_funnel_lr.py "$OUT" 0.001 "$STEPS" "$CHAINS"
