"""M4 forecasting data (Weekly by default) for the autoregressive MLP (docs/benchmarks.md).

Files: `<data_dir>/m4/{freq}-train.csv` and `{freq}-test.csv`, straight from Mcompetitions/M4-methods.
Column V1 is the series id; each row is right-padded with empty cells (NaN after reading).

Pipeline, per series s with training values x_s (length L_s):
  1. z-score with the series' own TRAIN mean and population std (ddof 0; std 0 -> 1).
  2. windows: starts j = 0, stride, 2*stride, ... with j < L_s - in_len - out_len (strict),
     input = z[j : j+in_len], target = z[j+in_len : j+in_len+out_len].
  3. all windows of all series are shuffled with np.random.RandomState(split_seed) and split
     (1 - valid_fraction) / valid_fraction by window (series overlap between train and valid).
  4. test: one item per series, input = the last in_len standardised training values,
     target = the test values (the horizon H: 13 for Weekly, 48 for Hourly), standardised with
     the TRAIN statistics.
Weekly with 20/6/3 gives 119,316 windows -> train 107,384, valid 11,932; 359 test items.
"""
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from common.errors import UserFacingError
from data.files import require_files


@dataclass
class M4Data:
    """Float32 tensors. x: (N, in_len) inputs, y: (N, out_len) targets, all on the standardised scale.

    test_x (S, in_len), test_y (S, horizon); test_mean / test_std (S,) are each series' training
    statistics, needed to go back to the original scale for sMAPE (see `destandardise`);
    train_series (N,) the series (file row 0..S-1) each training window was cut from.
    """
    train_x: torch.Tensor
    train_y: torch.Tensor
    valid_x: torch.Tensor
    valid_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    test_mean: torch.Tensor
    test_std: torch.Tensor
    horizon: int
    train_series: torch.Tensor | None = None  # (N,) int64: index (file row) of the series of each train window


def read_series(path: Path) -> tuple[list[str], list[np.ndarray]]:
    """One M4 csv -> (series ids, list of float64 arrays with the NaN padding removed)."""
    try:
        df = pd.read_csv(path)
    except (ValueError, OSError) as e:  # pandas raises ValueError subclasses for malformed csv
        raise UserFacingError(f"cannot read M4 file {path}: {e}; re-download it") from None
    if "V1" not in df.columns:
        raise UserFacingError(f"{path} has no V1 (series id) column; is it an M4 csv file?")
    ids = df["V1"].astype(str).tolist()
    values = df.drop(columns="V1")
    try:
        values = values.to_numpy(dtype=np.float64)
    except (ValueError, TypeError):
        raise UserFacingError(_first_non_number(path, values, ids)) from None
    return ids, [row[~np.isnan(row)] for row in values]


def _first_non_number(path: Path, values: pd.DataFrame, ids: list[str]) -> str:
    """One line naming the first cell of `values` that is not a number (nor empty)."""
    for column in values.columns:
        cells = values[column]
        bad = pd.to_numeric(cells, errors="coerce").isna() & cells.notna()
        if bad.any():
            row = int(bad.to_numpy().argmax())
            return (f"{path}: line {row + 2} (series {ids[row]}), column {column} holds {cells.iloc[row]!r}, not a "
                    "number; is it a complete, uncorrupted M4 csv? Re-download it with scripts/download_data.sh")
    return f"{path}: a value is not a number; re-download it with scripts/download_data.sh"


def make_windows(z: np.ndarray, in_len: int, out_len: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows of one standardised series: (n, in_len) inputs and (n, out_len) targets,
    starts j = 0, stride, ... with j < len(z) - in_len - out_len (strict, as in the original)."""
    starts = np.arange(0, len(z) - in_len - out_len, stride)
    if len(starts) == 0:  # series too short for a single window
        return np.empty((0, in_len)), np.empty((0, out_len))
    span = np.lib.stride_tricks.sliding_window_view(z, in_len + out_len)  # (L - in - out + 1, in + out)
    w = span[starts]
    return w[:, :in_len], w[:, in_len:]


def load_m4(data_dir, freq: str = "Weekly", in_len: int = 20, out_len: int = 6, stride: int = 3,
            valid_fraction: float = 0.1, split_seed: int = 0) -> M4Data:
    """Read, standardise, window and split one M4 frequency (see the module docstring)."""
    train_path, test_path = require_files(Path(data_dir) / "m4", [f"{freq}-train.csv", f"{freq}-test.csv"],
                                          f"M4 {freq}")
    train_ids, train_series = read_series(train_path)
    test_ids, test_series = read_series(test_path)
    if train_ids != test_ids:
        raise UserFacingError(f"{train_path} and {test_path} list different series; re-download both")
    horizon = len(test_series[0])
    if any(len(t) != horizon for t in test_series):
        raise UserFacingError(f"{test_path}: series have different test lengths; re-download it")

    xs, ys, series_of, test_x, test_y, means, stds = [], [], [], [], [], [], []
    for row, (sid, x, t) in enumerate(zip(train_ids, train_series, test_series)):
        if len(x) < in_len:
            raise UserFacingError(f"M4 series {sid} has {len(x)} training values, fewer than in_len={in_len}")
        mean, std = x.mean(), x.std()  # population std (ddof 0), as numpy's default
        std = std if std > 0 else 1.0  # a constant series would divide by zero
        z = (x - mean) / std
        wx, wy = make_windows(z, in_len, out_len, stride)
        xs.append(wx)
        ys.append(wy)
        series_of.append(np.full(len(wx), row, dtype=np.int64))
        test_x.append(z[-in_len:])
        test_y.append((t - mean) / std)
        means.append(mean)
        stds.append(std)

    all_x, all_y = np.concatenate(xs), np.concatenate(ys)
    perm = np.random.RandomState(split_seed).permutation(len(all_x))
    n_train = int(len(all_x) * (1 - valid_fraction))  # 0.9 * 119,316 = 107,384.4 -> 107,384
    tr, va = perm[:n_train], perm[n_train:]

    f32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    return M4Data(train_x=f32(all_x[tr]), train_y=f32(all_y[tr]), valid_x=f32(all_x[va]), valid_y=f32(all_y[va]),
                  test_x=f32(np.stack(test_x)), test_y=f32(np.stack(test_y)),
                  test_mean=f32(means), test_std=f32(stds), horizon=horizon,
                  train_series=torch.from_numpy(np.concatenate(series_of)[tr]))


def destandardise(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """(S, H) standardised values -> original scale: x * std + mean, per series (row)."""
    return x * std[:, None] + mean[:, None]


def smape(pred, target) -> float:
    """Symmetric MAPE in percent, on the ORIGINAL scale (de-standardise first):

        sMAPE = mean over all values of 200 * |p - t| / (|p| + |t|)

    pred and target have the same shape, e.g. (S, H). A value with p = t = 0 counts as 0 error
    (the 0/0 would otherwise be NaN).
    """
    p = torch.as_tensor(pred, dtype=torch.float64)
    t = torch.as_tensor(target, dtype=torch.float64)
    if p.shape != t.shape:
        raise ValueError(f"smape: pred shape {tuple(p.shape)} != target shape {tuple(t.shape)}")
    num = 200.0 * (p - t).abs()
    den = p.abs() + t.abs()
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num)).mean().item()
