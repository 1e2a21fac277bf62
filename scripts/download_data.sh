#!/usr/bin/env bash
# Fetch every data set this suite reads into DATA_DIR, from its public source (usage: --help).
set -euo pipefail
usage() {
  cat <<'USAGE'
usage: scripts/download_data.sh [DATA_DIR]

Fetches every data set this suite reads into DATA_DIR (default: $CDGRAB_DATA, else ./datasets), from
its public source. Needs the internet, curl and unzip; files already present are kept, so a rerun
fetches only what is missing.

Layout written (what the entry scripts look for):
  hmda/targets-processed-NY-2017.pt                 authors' targets (their features file is not public)
  hmda/hmda_2017_ny_all-records_labels.zip          CFPB LAR 2017, New York (source (b) of data/hmda.py)
  hmda/raw/hmda_train_preprocessed.zip              HMDA 2018 sample (source (c))
  wikitext-2/{train,valid,test}.txt                 pytorch/examples word-level copy
  wikitext-103/wiki.{train,valid,test}.raw          WikiText-103 raw v1, the paper's variant (about 190 MB zipped)
  m4/{Weekly,Hourly}-{train,test}.csv               M4 competition
  gpt2-tokenizer/{vocab.json,merges.txt}            OpenAI GPT-2 BPE encodings
USAGE
}
case ${1:-} in
  -h|--help) usage; exit 0 ;;
  -*) echo "error: unknown option '$1'; see scripts/download_data.sh --help" >&2; exit 2 ;;
esac
if (($# > 1)); then
  echo "error: one DATA_DIR at most, got $#: $*; see scripts/download_data.sh --help" >&2
  exit 2
fi
DATA_DIR="${1:-${CDGRAB_DATA:-./datasets}}"
mkdir -p "$DATA_DIR"
cd "$DATA_DIR"

fetch() {  # fetch URL DEST [SHA256]
  local url=$1 dest=$2 sum=${3:-}
  if [ -s "$dest" ]; then echo "have $dest"; return; fi
  mkdir -p "$(dirname "$dest")"
  echo "get  $dest"
  curl -fL --retry 3 -o "$dest.part" "$url"
  if [ -n "$sum" ] && command -v sha256sum >/dev/null; then
    echo "$sum  $dest.part" | sha256sum -c --quiet - || { echo "checksum mismatch for $dest" >&2; exit 1; }
  fi
  mv "$dest.part" "$dest"
}

GH=https://raw.githubusercontent.com
fetch $GH/GarlGuo/CD-GraB/main/data/HMDA/targets-processed-NY-2017.pt hmda/targets-processed-NY-2017.pt \
  9e5f8df65ab94dcad7812ab14313c01d127f6786b35ea2750a5904c9cb617d5c
fetch https://files.consumerfinance.gov/hmda-historic-loan-data/hmda_2017_ny_all-records_labels.zip \
  hmda/hmda_2017_ny_all-records_labels.zip
fetch $GH/jphall663/GWU_rml/master/assignments/data/hmda_train_preprocessed.zip hmda/raw/hmda_train_preprocessed.zip \
  74b1c145b692f7f97814ddab2989b4ade7a5f4c384c3f8c0f84ae482f226add8

for split in train valid test; do
  fetch $GH/pytorch/examples/main/word_language_model/data/wikitext-2/$split.txt wikitext-2/$split.txt
done

# the raw variant (no <unk>, original casing and punctuation), as the paper's Hugging Face run_clm
# setting (wikitext-103-raw-v1); data/wikitext103.py prefers wiki.<split>.raw over .tokens
if [ ! -s wikitext-103/wiki.train.raw ]; then
  fetch https://wikitext.smerity.com/wikitext-103-raw-v1.zip wikitext-103/wikitext-103-raw-v1.zip
  unzip -o -j wikitext-103/wikitext-103-raw-v1.zip -d wikitext-103 && rm wikitext-103/wikitext-103-raw-v1.zip
fi

for freq in Weekly Hourly; do
  fetch $GH/Mcompetitions/M4-methods/master/Dataset/Train/$freq-train.csv m4/$freq-train.csv
  fetch $GH/Mcompetitions/M4-methods/master/Dataset/Test/$freq-test.csv m4/$freq-test.csv
done

fetch https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json gpt2-tokenizer/vocab.json \
  196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783
fetch https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe gpt2-tokenizer/merges.txt \
  1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5
echo "data sets are in $DATA_DIR"
