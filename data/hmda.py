"""HMDA mortgage data for the LR-HMDA benchmark (logistic regression), as float32 tensors.

`load_hmda(data_dir)` looks inside ``<data_dir>/hmda/`` and uses the first source that is present:

(a) ``features-processed-NY-2017.pt`` + ``targets-processed-NY-2017.pt`` (source
    ``"authors-processed-NY-2017"``): the CD-GraB authors' files, each a ``torch.save``'d tuple
    ``(train, test)``. Used as is; feature names are ``f0 .. f{F-1}``. Only used when BOTH exist.

(b) ``hmda_2017_<state>_all-records_labels.csv`` or ``.zip`` holding that one csv (source
    ``"cfpb-lar-2017"``): the public CFPB loan/application register for 2017, 78 columns. ``ny`` is
    preferred when several states are present. Preprocessing:

    - keep rows with ``action_taken`` 1 (loan originated -> label 1) or 3 (application denied -> 0);
    - features: the numeric columns ``LAR_NUMERIC`` and the integer code columns ``LAR_CATEGORICAL``
      (the code columns, never their ``*_name`` text twins);
    - drop rows with a missing value in any used column;
    - split 80/20 with ``split_80_20`` (fixed seed 0);
    - numeric columns: standardised with the TRAIN split's mean and (population) std;
    - code columns: one-hot over the codes seen in the TRAIN split, named ``<column>=<code>``; a test
      row with a code unseen in train gets all zeros for that column.

    Outcome-leaking or identifying columns are never read: ``LAR_NEVER_USED`` (``action_taken``
    itself, ``purchaser_type``, ``denial_reason_1..3``, ``rate_spread``, ``hoepa_status``,
    ``edit_status``, ``sequence_number``, ``application_date_indicator``, ``respondent_id``). On NY 2017
    the originated/denied rate (77.6 %) matches the authors' targets (77.0 % ones), which is why this
    label is the best guess for theirs; their exact feature set is unknown.

(c) ``raw/hmda_train_preprocessed.zip`` (or the unzipped ``.csv``) (source ``"hmda-2018-sample"``):
    a real HMDA 2018 sample of originated loans, already preprocessed by its publishers. Label
    ``high_priced`` (1 = high-priced loan; 9.67 % ones), NOT "originated" as in (a)/(b).
    Preprocessing:

    - drop ``row_id``;
    - the demographic one-hot groups ``SAMPLE_GROUPS`` (race: black/asian/white/amind/hipac,
      ethnicity: hispanic/non_hispanic, sex: male/female, age: agegte62/agelt62) are NaN where not
      reported: NaN -> 0 plus one indicator column ``<group>_missing`` per group;
    - the 0/1 columns and the already standardised ``*_std`` columns stay as they are;
    - the publishers' test file has no labels, so the labelled train file is re-split 80/20 with
      ``split_80_20``. F = 21 + 4 = 25 (``SAMPLE_COLUMNS`` then the four ``*_missing`` columns).

``hmda_file`` (the ``--hmda-file`` flag) names one file explicitly instead: a ``.pt`` features (or
targets) file of (a), a LAR 2017 csv/zip, or a 2018-sample csv/zip; csv kinds are told apart by header.
Every bad input raises a one-line ``UserFacingError``.
"""
from __future__ import annotations

import csv
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from common.errors import UserFacingError
from data.checksums import verify
from data.files import DOWNLOAD_HINT, require_files

__all__ = ["HMDAData", "load_hmda", "split_80_20", "LAR_NUMERIC", "LAR_CATEGORICAL", "LAR_NEVER_USED",
           "SAMPLE_COLUMNS", "SAMPLE_GROUPS", "SAMPLE_LABEL"]

FEATURES_PT = "features-processed-NY-2017.pt"
TARGETS_PT = "targets-processed-NY-2017.pt"
LAR_GLOB = "hmda_2017_*_all-records_labels.*"
SAMPLE_FILES = ("raw/hmda_train_preprocessed.zip", "raw/hmda_train_preprocessed.csv")

# (b) CFPB LAR 2017: column names as in the public all-records_labels csv.
LAR_LABEL = "action_taken"
LAR_NUMERIC = [
    "loan_amount_000s", "applicant_income_000s", "population", "minority_population",
    "hud_median_family_income", "tract_to_msamd_income", "number_of_owner_occupied_units",
    "number_of_1_to_4_family_units",
]
LAR_CATEGORICAL = [
    "agency_code", "loan_type", "property_type", "loan_purpose", "owner_occupancy", "preapproval",
    "applicant_ethnicity", "co_applicant_ethnicity", "applicant_race_1", "co_applicant_race_1",
    "applicant_sex", "co_applicant_sex", "lien_status",
]
# Decided or known only after the decision (or identifiers): reading them would leak the label.
LAR_NEVER_USED = [
    "action_taken", "purchaser_type", "denial_reason_1", "denial_reason_2", "denial_reason_3",
    "rate_spread", "hoepa_status", "edit_status", "sequence_number", "application_date_indicator",
    "respondent_id",
]

# (c) HMDA 2018 sample.
SAMPLE_LABEL = "high_priced"
SAMPLE_GROUPS = {
    "race": ["black", "asian", "white", "amind", "hipac"],
    "ethnicity": ["hispanic", "non_hispanic"],
    "sex": ["male", "female"],
    "age": ["agegte62", "agelt62"],
}
SAMPLE_COLUMNS = [c for cols in SAMPLE_GROUPS.values() for c in cols] + [
    "term_360", "conforming", "debt_to_income_ratio_missing",
    "loan_amount_std", "loan_to_value_ratio_std", "no_intro_rate_period_std", "intro_rate_period_std",
    "property_value_std", "income_std", "debt_to_income_ratio_std",
]


@dataclass
class HMDAData:
    """One loaded HMDA split; rows are in shuffled (split-permutation) order for (b) and (c)."""
    train_x: torch.Tensor      # (N_train, F) float32
    train_y: torch.Tensor      # (N_train,) float32 in {0., 1.}
    test_x: torch.Tensor       # (N_test, F) float32
    test_y: torch.Tensor       # (N_test,) float32 in {0., 1.}
    feature_names: list[str]   # length F
    source: str                # "authors-processed-NY-2017" | "cfpb-lar-2017" | "hmda-2018-sample"
    files: list[str]           # the file paths actually read

    @property
    def num_features(self) -> int:
        return self.train_x.shape[1]

    def summary(self) -> str:
        """One line for logs: source, sizes and positive rates."""
        return (f"HMDA {self.source}: train {tuple(self.train_x.shape)} "
                f"({self.train_y.mean().item():.2%} ones), test {tuple(self.test_x.shape)} "
                f"({self.test_y.mean().item():.2%} ones)")


def split_80_20(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed-seed random split of range(n): (train_idx (n*4//5,), test_idx (n - n*4//5,)) int64.

    n*4//5 reproduces the authors' sizes (244,107 -> 195,285 + 48,822).
    """
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    n_train = n * 4 // 5
    return perm[:n_train], perm[n_train:]


def load_hmda(data_dir: str | Path, hmda_file: str | Path | None = None) -> HMDAData:
    """Load HMDA from ``<data_dir>/hmda/`` (sources (a) > (b) > (c)) or from ``hmda_file``."""
    folder = Path(data_dir) / "hmda"
    if hmda_file is not None:
        return _load_named_file(Path(hmda_file), folder)

    if (folder / FEATURES_PT).is_file() and (folder / TARGETS_PT).is_file():
        return _load_processed(folder / FEATURES_PT, folder / TARGETS_PT)
    lar = _find_lar(folder)
    if lar is not None:
        return _load_lar(lar)
    for name in SAMPLE_FILES:
        if (folder / name).is_file():
            return _load_sample(folder / name)
    raise UserFacingError(
        f"no HMDA data in {folder}: expected (a) {FEATURES_PT} + {TARGETS_PT}, or "
        f"(b) hmda_2017_<state>_all-records_labels.csv (or .zip), or (c) {SAMPLE_FILES[0]} (or .csv); "
        f"or pass --hmda-file FILE; {DOWNLOAD_HINT}")


# ----------------------------------------------------------------------------------------- finding


def _find_lar(folder: Path) -> Path | None:
    """The LAR 2017 csv/zip in folder, preferring New York; None when there is none."""
    if not folder.is_dir():
        return None
    found = sorted(p for p in folder.glob(LAR_GLOB) if p.suffix.lower() in (".csv", ".zip") and p.is_file())
    ny = [p for p in found if p.name.lower().startswith("hmda_2017_ny_")]
    return (ny or found or [None])[0]


def _load_named_file(path: Path, folder: Path) -> HMDAData:
    """--hmda-file: a path as given, else relative to <data_dir>/hmda/; kind told by suffix/header."""
    if not path.is_file() and not path.is_absolute() and (folder / path).is_file():
        path = folder / path
    require_files(path.parent, [path.name], "--hmda-file")

    if path.suffix.lower() == ".pt":
        if "features" in path.name:
            features, targets = path, path.with_name(path.name.replace("features", "targets"))
        elif "targets" in path.name:
            features, targets = path.with_name(path.name.replace("targets", "features")), path
        else:
            raise UserFacingError(f"{path}: a .pt HMDA file must be named features-*.pt or targets-*.pt "
                                  f"(the pair {FEATURES_PT} + {TARGETS_PT})")
        require_files(path.parent, [features.name, targets.name], "HMDA processed pair")
        return _load_processed(features, targets)

    columns = set(_read_header(path))
    if LAR_LABEL in columns:
        return _load_lar(path)
    if SAMPLE_LABEL in columns or set(SAMPLE_COLUMNS) <= columns:
        return _load_sample(path)
    raise UserFacingError(
        f"{path} is neither a CFPB LAR 2017 file (no '{LAR_LABEL}' column) nor the HMDA 2018 sample "
        f"(no '{SAMPLE_LABEL}' column); pass a LAR 2017 csv/zip, raw/hmda_train_preprocessed.zip "
        f"or {FEATURES_PT}")


# ----------------------------------------------------------------------------------------- reading


def _one_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _read_csv(path: Path, **kwargs) -> pd.DataFrame:
    """pd.read_csv (a .zip must hold one csv) with every parse failure turned into one clear line."""
    try:
        return pd.read_csv(path, **kwargs)
    except (ValueError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError,
            EOFError, zipfile.BadZipFile, csv.Error) as err:
        raise UserFacingError(f"cannot read HMDA csv {path}: {_one_line(err)}; "
                              f"is it a complete, uncorrupted download?") from None


def _read_header(path: Path) -> list[str]:
    return [str(c).strip() for c in _read_csv(path, nrows=0).columns]


def _require_columns(path: Path, header: set[str], columns: list[str], kind: str) -> None:
    missing = [c for c in columns if c not in header]
    if missing:
        raise UserFacingError(f"{path} does not look like {kind}: missing columns {', '.join(missing)}")


def _to_data(x: np.ndarray, y: np.ndarray, names: list[str], source: str, files: list[Path],
             train_idx: torch.Tensor, test_idx: torch.Tensor) -> HMDAData:
    """Assemble HMDAData from x (N, F) and y (N,) already in a consistent row order."""
    # np.require copies only when needed; pandas 3 (copy-on-write) hands out read-only arrays.
    x_t = torch.from_numpy(np.require(x, np.float32, ["C", "W"]))
    y_t = torch.from_numpy(np.require(y, np.float32, ["C", "W"]))
    return HMDAData(x_t[train_idx], y_t[train_idx], x_t[test_idx], y_t[test_idx], names, source,
                    [str(f) for f in files])


def _check_split_size(n: int, path: Path, what: str) -> None:
    if n * 4 // 5 < 1 or n - n * 4 // 5 < 1:
        raise UserFacingError(f"{path}: only {n} usable rows ({what}); need at least 2 to split 80/20")


# ----------------------------------------------------------------------------------------- (a)


def _load_processed(features: Path, targets: Path) -> HMDAData:
    """(a): the authors' (train, test) tuples, used as is."""
    verify(features)
    verify(targets)
    train_x, test_x = _load_pair(features)
    train_y, test_y = _load_pair(targets)
    train_y, test_y = train_y.reshape(-1), test_y.reshape(-1)   # tolerate (N, 1) targets
    if train_x.ndim != 2 or test_x.ndim != 2 or train_x.shape[1] != test_x.shape[1]:
        raise UserFacingError(f"{features}: expected two 2-D feature tensors with the same width, got "
                              f"{tuple(train_x.shape)} and {tuple(test_x.shape)}")
    if len(train_y) != len(train_x) or len(test_y) != len(test_x):
        raise UserFacingError(f"{features} and {targets} disagree on row counts: features "
                              f"{len(train_x)}/{len(test_x)}, targets {len(train_y)}/{len(test_y)}")
    ys = torch.cat([train_y, test_y]).float()
    if not bool(((ys == 0) | (ys == 1)).all()):
        raise UserFacingError(f"{targets}: targets must be 0/1")
    return HMDAData(train_x.float().contiguous(), train_y.float().contiguous(), test_x.float().contiguous(),
                    test_y.float().contiguous(), [f"f{i}" for i in range(train_x.shape[1])],
                    "authors-processed-NY-2017", [str(features), str(targets)])


def _load_pair(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for a truncated/garbled file; all are bad input
        raise UserFacingError(f"cannot load {path}: {_one_line(err)}; re-download it") from None
    if not (isinstance(obj, (tuple, list)) and len(obj) == 2 and all(isinstance(t, torch.Tensor) for t in obj)):
        raise UserFacingError(f"{path}: expected a torch.save'd tuple (train, test) of two tensors")
    return obj[0], obj[1]


# ----------------------------------------------------------------------------------------- (b)


def _load_lar(path: Path) -> HMDAData:
    """(b): CFPB LAR 2017 -> originated (1) vs denied (0); see the module docstring."""
    verify(path)  # (not in data/checksums.py's table: checks nothing unless it joins it)
    used = LAR_NUMERIC + LAR_CATEGORICAL + [LAR_LABEL]
    _require_columns(path, set(_read_header(path)), used, "a CFPB LAR 2017 all-records_labels file")
    # Codes are small integers but may be blank, so everything is read as float64 (NaN = missing).
    df = _read_csv(path, usecols=used, dtype={c: "float64" for c in used})
    df = df[df[LAR_LABEL].isin([1.0, 3.0])].dropna().reset_index(drop=True)
    n = len(df)
    _check_split_size(n, path, "originated/denied rows with no missing value")
    train_idx, test_idx = split_80_20(n)
    tr = train_idx.numpy()

    numeric = df[LAR_NUMERIC].to_numpy(np.float64)
    mean, std = numeric[tr].mean(axis=0), numeric[tr].std(axis=0)
    std[std == 0] = 1.0   # a constant train column would otherwise become NaN
    blocks, names = [(numeric - mean) / std], list(LAR_NUMERIC)
    for col in LAR_CATEGORICAL:
        codes = df[col].to_numpy()
        seen = np.unique(codes[tr])   # categories from the train split only: no test peeking
        blocks.append(codes[:, None] == seen[None, :])
        names += [f"{col}={c:g}" for c in seen]
    x = np.concatenate([b.astype(np.float32) for b in blocks], axis=1)
    y = (df[LAR_LABEL].to_numpy() == 1.0)
    return _to_data(x, y, names, "cfpb-lar-2017", [path], train_idx, test_idx)


# ----------------------------------------------------------------------------------------- (c)


def _load_sample(path: Path) -> HMDAData:
    """(c): HMDA 2018 sample, label high_priced; NaN demographics -> 0 + <group>_missing."""
    verify(path)  # the published zip / csv: a csv cut short inside a valid zip changes the zip's bytes
    header = set(_read_header(path))
    if SAMPLE_LABEL not in header and set(SAMPLE_COLUMNS) <= header:
        raise UserFacingError(f"{path} has no '{SAMPLE_LABEL}' labels (it is the unlabelled test file); "
                              f"use hmda_train_preprocessed.zip")
    used = SAMPLE_COLUMNS + [SAMPLE_LABEL]
    _require_columns(path, header, used, "the HMDA 2018 sample (hmda_train_preprocessed)")
    df = _read_csv(path, usecols=used, dtype={c: "float32" for c in used})

    group_cols = [c for cols in SAMPLE_GROUPS.values() for c in cols]
    other = [c for c in used if c not in group_cols]
    df = df.dropna(subset=other).reset_index(drop=True)   # none in the real file; only groups have NaN
    y = df[SAMPLE_LABEL].to_numpy()
    if not np.isin(y, [0.0, 1.0]).all():
        raise UserFacingError(f"{path}: column '{SAMPLE_LABEL}' must be 0/1")
    n = len(df)
    _check_split_size(n, path, "labelled rows")

    missing = {f"{g}_missing": df[cols].isna().any(axis=1).to_numpy() for g, cols in SAMPLE_GROUPS.items()}
    x = np.concatenate([df[SAMPLE_COLUMNS].fillna(0.0).to_numpy(np.float32),
                        np.stack(list(missing.values()), axis=1).astype(np.float32)], axis=1)
    train_idx, test_idx = split_80_20(n)
    return _to_data(x, y, SAMPLE_COLUMNS + list(missing), "hmda-2018-sample", [path], train_idx, test_idx)
