"""data/hmda.py: the three HMDA sources, their preprocessing, preference order and error messages."""
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from data.hmda import (LAR_CATEGORICAL, LAR_NEVER_USED, LAR_NUMERIC, SAMPLE_COLUMNS, load_hmda,
                       split_80_20)
from common.errors import UserFacingError

from tests.helpers import DATA_DIR as REAL_DATA  # noqa: E402
from tests.helpers import require_data  # noqa: E402

# The 78 columns of the public CFPB hmda_2017_<state>_all-records_labels.csv, in file order.
LAR_2017_HEADER = (
    "as_of_year,respondent_id,agency_name,agency_abbr,agency_code,loan_type_name,loan_type,"
    "property_type_name,property_type,loan_purpose_name,loan_purpose,owner_occupancy_name,owner_occupancy,"
    "loan_amount_000s,preapproval_name,preapproval,action_taken_name,action_taken,msamd_name,msamd,"
    "state_name,state_abbr,state_code,county_name,county_code,census_tract_number,"
    "applicant_ethnicity_name,applicant_ethnicity,co_applicant_ethnicity_name,co_applicant_ethnicity,"
    "applicant_race_name_1,applicant_race_1,applicant_race_name_2,applicant_race_2,applicant_race_name_3,"
    "applicant_race_3,applicant_race_name_4,applicant_race_4,applicant_race_name_5,applicant_race_5,"
    "co_applicant_race_name_1,co_applicant_race_1,co_applicant_race_name_2,co_applicant_race_2,"
    "co_applicant_race_name_3,co_applicant_race_3,co_applicant_race_name_4,co_applicant_race_4,"
    "co_applicant_race_name_5,co_applicant_race_5,applicant_sex_name,applicant_sex,co_applicant_sex_name,"
    "co_applicant_sex,applicant_income_000s,purchaser_type_name,purchaser_type,denial_reason_name_1,"
    "denial_reason_1,denial_reason_name_2,denial_reason_2,denial_reason_name_3,denial_reason_3,rate_spread,"
    "hoepa_status_name,hoepa_status,lien_status_name,lien_status,edit_status_name,edit_status,"
    "sequence_number,population,minority_population,hud_median_family_income,tract_to_msamd_income,"
    "number_of_owner_occupied_units,number_of_1_to_4_family_units,application_date_indicator"
).split(",")
ACTION_NAMES = {1: "Loan originated", 2: "Application approved but not accepted", 3: "Application denied by financial institution",
                4: "Application withdrawn by applicant", 5: "File closed for incompleteness", 6: "Loan purchased by the institution"}


def lar_frame(n: int = 120, seed: int = 1) -> pd.DataFrame:
    """A LAR-2017-schema frame: mixed action_taken, a few blanks in used columns, leaky columns filled."""
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({c: [""] * n for c in LAR_2017_HEADER}, dtype=object)
    df["as_of_year"], df["state_abbr"], df["state_name"] = 2017, "NY", "New York"
    df["action_taken"] = rng.choice([1, 1, 1, 3, 3, 2, 4, 6], size=n)
    df["action_taken_name"] = df["action_taken"].map(ACTION_NAMES)
    df["loan_amount_000s"] = 100 + np.arange(n)            # distinct, so rows are identifiable
    df["applicant_income_000s"] = rng.integers(20, 400, n)
    for col in LAR_NUMERIC[2:]:
        df[col] = np.round(rng.uniform(1, 5000, n), 2)
    for col, k in zip(LAR_CATEGORICAL, [3, 4, 3, 3, 3, 3, 4, 5, 7, 8, 4, 5, 4]):
        df[col] = rng.integers(1, k + 1, n)
    df["loan_type_name"], df["applicant_sex_name"] = "Conventional", "Female"
    # Leaky columns carry the label; if any were read, a perfect feature would appear.
    df["denial_reason_1"] = np.where(df["action_taken"] == 3, "1", "")
    df["purchaser_type"] = np.where(df["action_taken"] == 1, 7, 0)
    df["rate_spread"] = np.where(df["action_taken"] == 1, "1.75", "")
    df["hoepa_status"], df["sequence_number"], df["respondent_id"] = 2, np.arange(n), "0000012345"
    df = df.astype(object)                                  # so blanks can go into numeric columns
    blanks = rng.choice(n, size=12, replace=False)          # missing values in used columns
    for i, row in enumerate(blanks):
        df.loc[row, ["applicant_income_000s", "population", "lien_status"][i % 3]] = ""
    return df


def kept_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Rows load_hmda must keep from lar_frame, in file order."""
    used = LAR_NUMERIC + LAR_CATEGORICAL
    ok = df["action_taken"].isin([1, 3]) & (df[used] != "").all(axis=1)
    return df[ok].reset_index(drop=True)


def write_lar(folder: Path, df: pd.DataFrame, state: str = "ny", zipped: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    name = f"hmda_2017_{state}_all-records_labels.csv"
    if not zipped:
        df.to_csv(folder / name, index=False)
        return folder / name
    with zipfile.ZipFile(folder / name.replace(".csv", ".zip"), "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(name, df.to_csv(index=False))
    return folder / name.replace(".csv", ".zip")


def write_sample(path: Path, n: int = 50, label: bool = True) -> Path:
    """A tiny file in the HMDA 2018 sample schema."""
    rng = np.random.default_rng(2)
    df = pd.DataFrame({"row_id": np.arange(n)})
    for col in SAMPLE_COLUMNS:
        df[col] = rng.integers(0, 2, n).astype(float) if not col.endswith("_std") else rng.normal(size=n)
    df.loc[: n // 4, ["male", "female"]] = np.nan
    if label:
        df["high_priced"] = rng.integers(0, 2, n)
    path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(path, index=False)
    return path


def write_pt_pair(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save((torch.randn(8, 3), torch.randn(2, 3)), folder / "features-processed-NY-2017.pt")
    torch.save((torch.ones(8), torch.zeros(2)), folder / "targets-processed-NY-2017.pt")


# ------------------------------------------------------------------------------------------ (b)


@pytest.fixture(scope="module")
def lar(tmp_path_factory):
    df = lar_frame()
    root = tmp_path_factory.mktemp("lar")
    write_lar(root / "hmda", df)
    return root, df, load_hmda(root)


def test_lar_rows_labels_and_split(lar):
    _, df, data = lar
    kept = kept_rows(df)
    n = len(kept)
    assert 0 < n < len(df) and data.source == "cfpb-lar-2017"
    assert (len(data.train_y), len(data.test_y)) == (n * 4 // 5, n - n * 4 // 5)
    # Row identity via the distinct loan amounts: same rows, right labels, split as split_80_20 says.
    train_idx, test_idx = split_80_20(n)
    amount = kept["loan_amount_000s"].astype(float).to_numpy()
    label = (kept["action_taken"] == 1).to_numpy(np.float32)
    j = data.feature_names.index("loan_amount_000s")
    tr_amount = amount[train_idx.numpy()]
    mean, std = tr_amount.mean(), tr_amount.std()
    assert np.allclose(data.train_x[:, j].numpy(), (tr_amount - mean) / std, atol=1e-5)
    assert np.allclose(data.test_x[:, j].numpy(), (amount[test_idx.numpy()] - mean) / std, atol=1e-5)
    assert torch.equal(data.train_y, torch.from_numpy(label[train_idx.numpy()]))
    assert torch.equal(data.test_y, torch.from_numpy(label[test_idx.numpy()]))


def test_lar_standardisation_and_one_hot(lar):
    _, df, data = lar
    num = data.train_x[:, : len(LAR_NUMERIC)].double()
    assert data.feature_names[: len(LAR_NUMERIC)] == LAR_NUMERIC
    assert num.mean(0).abs().max() < 1e-5 and (num.std(0, unbiased=False) - 1).abs().max() < 1e-4
    assert data.test_x[:, : len(LAR_NUMERIC)].mean(0).abs().max() > 1e-3   # test stats not re-centred
    kept = kept_rows(df)
    train_rows = kept.iloc[split_80_20(len(kept))[0].numpy()]
    width = len(LAR_NUMERIC) + sum(train_rows[c].nunique() for c in LAR_CATEGORICAL)
    assert data.train_x.shape[1] == data.test_x.shape[1] == len(data.feature_names) == width
    onehot = data.train_x[:, len(LAR_NUMERIC):]
    assert set(onehot.unique().tolist()) == {0.0, 1.0}
    assert torch.equal(onehot.sum(1), torch.full((len(onehot),), float(len(LAR_CATEGORICAL))))
    assert not torch.isnan(data.train_x).any() and not torch.isnan(data.test_x).any()


def test_lar_never_reads_leaking_columns(lar):
    _, _, data = lar
    bases = {name.split("=")[0] for name in data.feature_names}
    assert bases == set(LAR_NUMERIC) | set(LAR_CATEGORICAL)
    assert not bases & set(LAR_NEVER_USED) and not any(b.endswith("_name") for b in bases)


def test_lar_unseen_test_category_is_all_zeros(tmp_path):
    df = lar_frame()
    kept_index = df.index[df["action_taken"].isin([1, 3]) & (df[LAR_NUMERIC + LAR_CATEGORICAL] != "").all(axis=1)]
    first_test = kept_index[split_80_20(len(kept_index))[1][0].item()]
    df.loc[first_test, "loan_type"] = 9                         # a code only this test row has
    data = load_hmda(tmp_path, hmda_file=write_lar(tmp_path, df))
    assert "loan_type=9" not in data.feature_names
    cols = [i for i, n in enumerate(data.feature_names) if n.startswith("loan_type=")]
    assert data.test_x[0, cols].sum() == 0 and data.test_x[1:, cols].sum(1).eq(1).all()


def test_lar_zip_deterministic_and_ny_preferred(lar, tmp_path):
    _, df, data = lar
    write_lar(tmp_path / "hmda", df, zipped=True)
    write_lar(tmp_path / "hmda", lar_frame(seed=7), state="ca")          # another state: not chosen
    zipped = load_hmda(tmp_path)
    assert zipped.files[0].endswith("hmda_2017_ny_all-records_labels.zip")
    for a, b in [(data, zipped), (zipped, load_hmda(tmp_path))]:
        assert a.feature_names == b.feature_names
        for name in ("train_x", "train_y", "test_x", "test_y"):
            assert torch.equal(getattr(a, name), getattr(b, name))


# ------------------------------------------------------------------------------------------ (c)


@pytest.fixture(scope="module")
def real():
    require_data("hmda/raw/hmda_train_preprocessed.zip")
    return load_hmda(REAL_DATA)


def test_real_sample(real):
    assert real.source == "hmda-2018-sample"   # the features .pt is absent, so (a) is skipped
    assert (len(real.train_y), len(real.test_y)) == (128_270, 32_068)
    assert real.train_x.shape == (128_270, 25) and real.test_x.shape == (32_068, 25)
    assert real.feature_names == SAMPLE_COLUMNS + ["race_missing", "ethnicity_missing", "sex_missing", "age_missing"]
    assert real.train_x.dtype == real.train_y.dtype == torch.float32
    assert not torch.isnan(real.train_x).any() and not torch.isnan(real.test_x).any()
    y = torch.cat([real.train_y, real.test_y])
    assert set(y.unique().tolist()) == {0.0, 1.0} and int(y.sum()) == 15_505
    assert abs(y.mean().item() - 0.0967) < 5e-4
    sex_missing = torch.cat([real.train_x, real.test_x])[:, real.feature_names.index("sex_missing")]
    assert int(sex_missing.sum()) == 73_801


def test_real_sample_deterministic(real):
    again = load_hmda(REAL_DATA)
    assert torch.equal(real.train_x, again.train_x) and torch.equal(real.test_y, again.test_y)


# ------------------------------------------------------------------------------------ preference


def test_authors_pair_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("CDGRAB_VERIFY_DATA", "0")  # fabricated files under the published names
    write_pt_pair(tmp_path / "hmda")
    write_lar(tmp_path / "hmda", lar_frame())
    write_sample(tmp_path / "hmda" / "raw" / "hmda_train_preprocessed.csv")
    data = load_hmda(tmp_path)
    assert data.source == "authors-processed-NY-2017"
    assert data.train_x.shape == (8, 3) and data.test_y.shape == (2,) and data.feature_names == ["f0", "f1", "f2"]


def test_targets_only_falls_back_to_sample(tmp_path, monkeypatch):
    monkeypatch.setenv("CDGRAB_VERIFY_DATA", "0")  # fabricated files under the published names
    (tmp_path / "hmda").mkdir()
    torch.save((torch.ones(8), torch.zeros(2)), tmp_path / "hmda" / "targets-processed-NY-2017.pt")
    write_sample(tmp_path / "hmda" / "raw" / "hmda_train_preprocessed.csv")
    data = load_hmda(tmp_path)
    assert data.source == "hmda-2018-sample" and (len(data.train_y), len(data.test_y)) == (40, 10)
    assert data.train_x.shape[1] == 25 and not torch.isnan(data.train_x).any()


def test_hmda_file_picks_kind(tmp_path, monkeypatch):
    monkeypatch.setenv("CDGRAB_VERIFY_DATA", "0")  # fabricated files under the published names
    write_pt_pair(tmp_path / "hmda")
    sample = write_sample(tmp_path / "elsewhere" / "s.csv")
    assert load_hmda(tmp_path, hmda_file=sample).source == "hmda-2018-sample"
    pt = load_hmda(tmp_path, hmda_file=tmp_path / "hmda" / "features-processed-NY-2017.pt")
    assert pt.source == "authors-processed-NY-2017" and len(pt.files) == 2


# ----------------------------------------------------------------------------------------- errors


def assert_one_line_error(call, *needles):
    with pytest.raises(UserFacingError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message


def test_missing_data_dir(tmp_path):
    assert_one_line_error(lambda: load_hmda(tmp_path / "nope"), "features-processed-NY-2017.pt",
                          "targets-processed-NY-2017.pt", "all-records_labels", "hmda_train_preprocessed.zip",
                          "download_data.sh")


def test_bad_files(tmp_path):
    garbled = tmp_path / "garbled.csv"
    garbled.write_bytes(b"\x00\xff\xfe garbage\n\x01,\x02\n")
    assert_one_line_error(lambda: load_hmda(tmp_path, hmda_file=garbled), str(garbled))
    bad_zip = tmp_path / "hmda_2017_ny_all-records_labels.zip"
    bad_zip.write_bytes(b"PK not really a zip")
    assert_one_line_error(lambda: load_hmda(tmp_path, hmda_file=bad_zip), "cannot read")
    unlabelled = write_sample(tmp_path / "hmda_test_preprocessed.csv", label=False)
    assert_one_line_error(lambda: load_hmda(tmp_path, hmda_file=unlabelled), "hmda_train_preprocessed")
    truncated = lar_frame().drop(columns=["lien_status"])
    path = write_lar(tmp_path / "t", truncated)
    assert_one_line_error(lambda: load_hmda(tmp_path, hmda_file=path), "lien_status")
    targets = tmp_path / "targets-processed-NY-2017.pt"
    torch.save((torch.ones(8), torch.zeros(2)), targets)
    assert_one_line_error(lambda: load_hmda(tmp_path, hmda_file=targets), "features-processed-NY-2017.pt")
    (tmp_path / "features-processed-NY-2017.pt").write_bytes(b"not a torch file")
    assert_one_line_error(lambda: load_hmda(tmp_path, hmda_file=targets), "cannot load")
    assert_one_line_error(lambda: load_hmda(tmp_path, hmda_file=tmp_path / "absent.csv"), "absent.csv")
