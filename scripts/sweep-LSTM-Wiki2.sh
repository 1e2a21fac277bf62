#!/usr/bin/env bash
# LSTM-Wiki2 sweep: LSTM on WikiText-2, the paper's settings (lr 5.0, 4 workers, B=16, 50 epochs), with
# the hidden state carried from step to step (--carry-hidden), as the original code that made the
# paper's curves did. LSTM_STATE=zero runs the zero-state variant instead (every chunk starts from
# zeros); the run names end in -carry-hidden-seed<N> or -zero-hidden-seed<N>.
#   SEEDS="0 1" EPOCHS=2 scripts/sweep-LSTM-Wiki2.sh --max-train-examples 512     (see --help)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/sweep-common.sh"
LSTM_STATE=${LSTM_STATE:-carry}
variables="  LSTM_STATE  carry: --carry-hidden, the state carried from step to step (the paper's);
              zero: every chunk starts from a zero state          (default carry)"
if want_help "$@"; then
  sweep_usage LSTM-Wiki2 "--lr 5.0 --node_cnt 4 --B 16 --epochs 50 --carry-hidden" "$variables" "<carry|zero>-hidden"
  exit 0
fi
case $LSTM_STATE in
  carry) state_flags=(--carry-hidden) ;;
  zero) state_flags=() ;;
  *) echo "sweep-LSTM-Wiki2: LSTM_STATE must be carry or zero, got '$LSTM_STATE'" >&2; exit 2 ;;
esac
sweep_tag=$LSTM_STATE-hidden
sweep LSTM-Wiki2 4 16 5.0 50 "${state_flags[@]}" -- "$@"
