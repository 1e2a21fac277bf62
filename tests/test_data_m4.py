"""M4 windows, split, standardisation and sMAPE (docs/benchmarks.md)."""
import math

import numpy as np
import pytest
import torch

from data.m4 import destandardise, load_m4, read_series, smape
from common.errors import UserFacingError

from tests.helpers import DATA_DIR  # noqa: E402
from tests.helpers import needs_data as needs  # noqa: E402

needs_data = needs("m4/Weekly-train.csv", "m4/Weekly-test.csv")


@pytest.fixture(scope="module")
def weekly():
    return load_m4(DATA_DIR)


@pytest.fixture(scope="module")
def raw():
    """(train series, test series) as float64 arrays, read independently of load_m4's windowing."""
    return read_series(DATA_DIR / "m4" / "Weekly-train.csv")[1], read_series(DATA_DIR / "m4" / "Weekly-test.csv")[1]


def _reference_windows(train_series):
    """All 26-value windows (20 in + 6 out) in series order, j = 0, 3, ... while j < L - 26."""
    out = []
    for x in train_series:
        z = (x - x.mean()) / x.std()
        for j in range(0, len(z) - 26, 3):
            out.append(z[j : j + 26])
    return np.array(out)


@needs_data
def test_series_lengths(raw):
    train, test = raw
    assert len(train) == len(test) == 359
    assert min(map(len, train)) == 80 and max(map(len, train)) == 2_597
    assert sum(map(len, train)) == 366_912
    assert all(len(t) == 13 for t in test)


@needs_data
def test_counts_and_shapes(weekly):
    d = weekly
    assert d.train_x.shape == (107_384, 20) and d.train_y.shape == (107_384, 6)
    assert d.valid_x.shape == (11_932, 20) and d.valid_y.shape == (11_932, 6)
    assert d.test_x.shape == (359, 20) and d.test_y.shape == (359, 13) and d.horizon == 13
    assert d.test_mean.shape == d.test_std.shape == (359,)
    for t in (d.train_x, d.train_y, d.valid_x, d.valid_y, d.test_x, d.test_y, d.test_mean, d.test_std):
        assert t.dtype == torch.float32


@needs_data
def test_windows_and_split_match_reference(weekly, raw):
    ref = _reference_windows(raw[0])
    assert len(ref) == 119_316
    perm = np.random.RandomState(0).permutation(len(ref))
    got_train = np.concatenate([weekly.train_x, weekly.train_y], axis=1)
    got_valid = np.concatenate([weekly.valid_x, weekly.valid_y], axis=1)
    np.testing.assert_allclose(got_train, ref[perm[:107_384]], rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(got_valid, ref[perm[107_384:]], rtol=1e-6, atol=1e-5)


@needs_data
def test_zscores_use_train_stats_and_test_is_last_window(weekly, raw):
    train, test = raw
    for s in (0, 17, 358):
        x = train[s]
        z = (x - weekly.test_mean[s].item()) / weekly.test_std[s].item()
        assert abs(z.mean()) < 1e-4 and abs(z.std() - 1) < 1e-4  # population std (ddof 0)
        np.testing.assert_allclose(weekly.test_x[s], z[-20:], rtol=1e-5, atol=1e-5)
    # test targets were scaled with the train statistics: undoing it gives the raw test values back
    back = destandardise(weekly.test_y.double(), weekly.test_mean.double(), weekly.test_std.double())
    np.testing.assert_allclose(back.numpy(), np.stack(test), rtol=1e-5)


@needs_data
def test_split_seed_changes_split_only(weekly):
    other = load_m4(DATA_DIR, split_seed=1)
    assert other.train_x.shape == weekly.train_x.shape
    assert not torch.equal(other.train_x[:100], weekly.train_x[:100])
    assert torch.equal(other.test_x, weekly.test_x)


@needs("m4/Hourly-train.csv", "m4/Hourly-test.csv")
def test_hourly_horizon():
    d = load_m4(DATA_DIR, freq="Hourly")
    assert d.test_y.shape == (414, 48) and d.horizon == 48


def test_smape_hand_example():
    pred = torch.tensor([[100.0, 10.0], [3.0, 0.0]])
    target = torch.tensor([[50.0, 10.0], [1.0, 0.0]])
    # 200*50/150, 0, 200*2/4, and 0/0 counted as 0
    expect = (200 * 50 / 150 + 0 + 200 * 2 / 4 + 0) / 4
    assert math.isclose(smape(pred, target), expect, rel_tol=1e-12)
    assert math.isclose(smape(np.array([1.0]), np.array([-1.0])), 200.0)  # the maximum
    with pytest.raises(ValueError):
        smape(torch.zeros(2, 3), torch.zeros(3, 2))


def test_destandardise_is_per_row():
    x = torch.tensor([[0.0, 1.0], [-1.0, 2.0]])
    out = destandardise(x, torch.tensor([10.0, 100.0]), torch.tensor([2.0, 5.0]))
    assert out.tolist() == [[10.0, 12.0], [95.0, 110.0]]


def test_constant_series_and_missing_files(tmp_path):
    folder = tmp_path / "m4"
    folder.mkdir()
    header = ",".join(f'"V{i}"' for i in range(1, 32))
    (folder / "Toy-train.csv").write_text(header + "\n" + '"T1",' + ",".join(["5"] * 30) + "\n")
    (folder / "Toy-test.csv").write_text('"V1","V2","V3"\n"T1",5,7\n')
    d = load_m4(tmp_path, freq="Toy", in_len=4, out_len=2, stride=1)
    assert d.test_std.tolist() == [1.0]  # std 0 -> 1, no division by zero
    assert d.train_x.shape[0] + d.valid_x.shape[0] == 30 - 6  # j < 30 - 4 - 2
    assert d.test_y.tolist() == [[0.0, 2.0]]
    with pytest.raises(UserFacingError) as e:
        load_m4(tmp_path, freq="Daily")
    assert "\n" not in str(e.value) and "Daily-train.csv" in str(e.value)


def test_a_non_numeric_cell_is_one_line_naming_it(tmp_path):
    folder = tmp_path / "m4"
    folder.mkdir()
    header = ",".join(f'"V{i}"' for i in range(1, 32))
    (folder / "Toy-train.csv").write_text(header + "\n" + '"T1",' + ",".join(["5"] * 30) + "\n"
                                          + '"T2",' + ",".join(["5"] * 12 + ["5x"] + ["6"] * 17) + "\n")
    (folder / "Toy-test.csv").write_text('"V1","V2","V3"\n"T1",5,7\n"T2",5,7\n')
    with pytest.raises(UserFacingError) as e:
        load_m4(tmp_path, freq="Toy", in_len=4, out_len=2, stride=1)
    assert str(e.value) == (f"{folder / 'Toy-train.csv'}: line 3 (series T2), column V14 holds '5x', not a number; "
                            "is it a complete, uncorrupted M4 csv? Re-download it with scripts/download_data.sh")
