#!/usr/bin/env bash
# LSTM-Wiki2 sweep: LSTM on WikiText-2, the paper's settings (lr 5.0, 4 workers, B=16, 50 epochs).
#   SEEDS="0 1" EPOCHS=2 scripts/sweep-LSTM-Wiki2.sh --max-train-examples 512     (see --help)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/sweep-common.sh"
if want_help "$@"; then sweep_usage LSTM-Wiki2 "--lr 5.0 --node_cnt 4 --B 16 --epochs 50"; exit 0; fi
sweep LSTM-Wiki2 4 16 5.0 50 -- "$@"
