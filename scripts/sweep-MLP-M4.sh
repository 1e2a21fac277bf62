#!/usr/bin/env bash
# MLP-M4 sweep: MLP forecaster on M4 Weekly, lr 1e-3, 50 epochs, in the setting of the paper's figure:
# 4 workers, B=16 (the authors' M4 notebook). M4_SETTING=readme runs the original README's
# command instead: 32 workers, B=32. The run names show node_cnt and B, so both can share RESULTS.
#   SEEDS="0 1" EPOCHS=2 scripts/sweep-MLP-M4.sh --max-train-examples 512     (see --help)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/sweep-common.sh"
M4_SETTING=${M4_SETTING:-paper}
variables="  M4_SETTING  paper: --node_cnt 4 --B 16, the paper's figure;
              readme: --node_cnt 32 --B 32, the original README    (default paper)"
if want_help "$@"; then
  sweep_usage MLP-M4 "--lr 1e-3 --node_cnt 4 --B 16 --epochs 50, or with M4_SETTING=readme --node_cnt 32 --B 32" "$variables"
  exit 0
fi
case $M4_SETTING in
  paper) node_cnt=4 B=16 ;;
  readme) node_cnt=32 B=32 ;;
  *) echo "sweep-MLP-M4: M4_SETTING must be paper or readme, got '$M4_SETTING'" >&2; exit 2 ;;
esac
sweep MLP-M4 "$node_cnt" "$B" 1e-3 50 -- "$@"
