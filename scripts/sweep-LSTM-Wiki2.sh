#!/usr/bin/env bash
# LSTM-Wiki2 sweep: LSTM on WikiText-2, the paper's settings (lr 5.0, 4 workers, B=16, 50 epochs), with
# the hidden state carried from step to step (--carry-hidden), as the original code that made the
# paper's curves did, and the averaged gradient clipped to norm 0.25 (--clip 0.25), as that code did at
# the paper's time: with it, two sorters whose epoch-1 order is the same agree at epoch 1, so the
# benchmark measures order (REPRODUCTION.md, LSTM-Wiki2). LSTM_STATE=zero runs the zero-state variant
# instead (every chunk starts from zeros); LSTM_CLIP=none the original's HEAD (no clipping). The run
# names end in -<carry|zero>-hidden[-clip0.25]-seed<N>.
#   SEEDS="0 1" EPOCHS=2 scripts/sweep-LSTM-Wiki2.sh --max-train-examples 512     (see --help)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/sweep-common.sh"
LSTM_STATE=${LSTM_STATE:-carry}
LSTM_CLIP=${LSTM_CLIP:-0.25}
variables="  LSTM_STATE  carry: --carry-hidden, the state carried from step to step (the paper's);
              zero: every chunk starts from a zero state          (default carry)
  LSTM_CLIP   0.25: --clip 0.25, the original's setting at the paper's time;
              none: no clipping (the original's HEAD)             (default 0.25)"
if want_help "$@"; then
  sweep_usage LSTM-Wiki2 "--lr 5.0 --node_cnt 4 --B 16 --epochs 50 --carry-hidden --clip 0.25" "$variables" \
    "<carry|zero>-hidden[-clip0.25]"
  exit 0
fi
case $LSTM_STATE in
  carry) state_flags=(--carry-hidden) ;;
  zero) state_flags=() ;;
  *) echo "sweep-LSTM-Wiki2: LSTM_STATE must be carry or zero, got '$LSTM_STATE'" >&2; exit 2 ;;
esac
case $LSTM_CLIP in
  0.25) state_flags+=(--clip 0.25); clip_tag=-clip0.25 ;;
  none) clip_tag="" ;;
  *) echo "sweep-LSTM-Wiki2: LSTM_CLIP must be 0.25 or none, got '$LSTM_CLIP'" >&2; exit 2 ;;
esac
sweep_tag=$LSTM_STATE-hidden$clip_tag
sweep LSTM-Wiki2 4 16 5.0 50 "${state_flags[@]}" -- "$@"
