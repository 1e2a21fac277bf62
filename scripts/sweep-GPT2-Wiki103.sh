#!/usr/bin/env bash
# GPT2-Wiki103 sweep: GPT-2 on WikiText-103, the paper's settings (lr 5e-4, 64 workers, B=64, 50 epochs).
# Without the WikiText-103 train split ($DATA/wikitext-103/wiki.train.{raw,tokens}) the runs train on
# WikiText-2's train.txt instead (--train-file), as the entry script's docs suggest.
#   SEEDS="0 1" EPOCHS=2 scripts/sweep-GPT2-Wiki103.sh --max-train-examples 512     (see --help)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/sweep-common.sh"
if want_help "$@"; then
  sweep_usage GPT2-Wiki103 "--lr 5e-4 --node_cnt 64 --B 64 --epochs 50; --train-file \$DATA/wikitext-2/train.txt when the WikiText-103 train split is absent"
  exit 0
fi
train_file=()
if [[ ! -f $DATA/wikitext-103/wiki.train.raw && ! -f $DATA/wikitext-103/wiki.train.tokens ]]; then
  train_file=(--train-file "$DATA/wikitext-2/train.txt")
  echo "[sweep-GPT2-Wiki103] no WikiText-103 train split in $DATA/wikitext-103: training on ${train_file[1]}"
fi
sweep GPT2-Wiki103 64 64 5e-4 50 "${train_file[@]}" -- "$@"
