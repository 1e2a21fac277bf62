"""Autoregressive MLP forecaster on M4 (Weekly) with distributed example ordering (paper section 6.3).

    python main-MLP-M4.py --sorter CD-GraB --seed 0                           # 32 workers, one process
    torchrun --standalone --nproc_per_node=4 main-MLP-M4.py --sorter D-RR     # 32 workers, 4 processes

Every series is z-scored with its own training mean and std and cut into windows (20 inputs, the next
6 values as target, stride 3), split 90/10 into train/valid windows (data/m4.py). The ordering unit is
one training window. Worker split (--partition random, the default): the train window ids are shuffled
with a generator seeded by --seed, the first n*m kept and reshaped to (n, m), m = N // n rounded down to
a multiple of 2 and of B/n; --partition contiguous gives every series to one worker only (whole series
in file order, a worker's last series cut to make m; m shrinks until that fits: data/partition.py). Each
step every worker takes B/n windows (the original silently used one window whatever B was); the update
is the mean gradient over all B windows; per-window gradients come from one backward plus per-window outer
products (engine/functional.py).

Loss: MSE between the 6 autoregressively rolled-out predictions and the targets (standardised scale).
Metrics after every epoch: train_loss / valid_loss = MSE over all used train / all valid windows (every
window weighs the same), test_loss = MSE of a rollout over the test horizon (13 for Weekly) from the last
20 training values of each series, and test_smape on the original scale (predictions and targets
de-standardised per series): sMAPE = mean over series and horizon steps of 200 * |p - t| / (|p| + |t|),
in percent (0 where p = t = 0).
"""
import torch
import torch.nn.functional as F

from common.errors import UserFacingError
from data.m4 import destandardise, load_m4, smape
from data.partition import partition_type, whole_groups
from engine.cli import common_parser, int_flag
from engine.functional import FlatModel
from engine.task import Task, eval_batches, sum_over_processes, unit_multiple, units_per_worker
from engine.entry import run_entry_point
from models.mlp import AutoregressiveMLP, window_gradients

BENCHMARK = "MLP-M4"
# the original README command: --sorter CD-GraB --node_cnt 32 --B 32 --lr 1e-3 (momentum 0.9, lr x0.25
# after epochs 10, 20, ...); 50 epochs like the other benchmarks (the original default was 30)
DEFAULTS = dict(sorter="CD-GraB", seed=0, lr=1e-3, momentum=0.9, weight_decay=0.0, B=32, node_cnt=32, epochs=50)
OUT_LEN, STRIDE = 6, 3
EVAL_CHUNK = 4096  # windows per evaluation forward; a fixed grid, split across processes


class MLPM4(Task):
    name = BENCHMARK
    metric_columns = ("valid_loss", "test_smape")
    vmap_over_workers = True
    linear_stack = True  # local steps: every worker's gradient from one batched pass (engine/linear_stack.py)
    # --compile (engine/compiled.py): the batch gradient's rollout with its backward, and the per-window gradients
    compiled_methods = ("loss", "_window_gradients")
    lr_decay_every = 10
    lr_decay_gamma = 0.25

    def __init__(self, args, device):
        data = load_m4(args.data_dir, freq=args.freq, in_len=args.in_len, out_len=OUT_LEN, stride=STRIDE)
        train_x, train_y = data.train_x, data.train_y
        if args.max_train_examples:
            train_x, train_y = train_x[:args.max_train_examples], train_y[:args.max_train_examples]
        n, k = args.node_cnt, args.B // args.node_cnt
        m = units_per_worker(len(train_x), n, k, "training windows", even_steps=False)
        multiple = unit_multiple(k, even_steps=False)  # what m is a multiple of: even, whole steps
        series = data.train_series[:len(train_x)]
        if args.partition == "contiguous":  # whole series per worker: m may shrink
            ids = whole_groups(series, n, multiple, m)
            m = ids.shape[1]
            if m == 0:
                raise UserFacingError(f"--partition contiguous: {len(train_x)} training windows cannot give "
                                      f"{n} workers {multiple} windows each from whole series; use more windows "
                                      f"or fewer workers")
        else:  # random: windows shuffled over all workers
            ids = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(args.seed))[: n * m]
        ids = ids.reshape(n, m)
        series_sets = [torch.unique(series[row]) for row in ids]  # the distinct series of each worker
        self.n_workers, self.n_units, self.units_per_step, self.global_batch = n, m, k, args.B
        self.worker_x = train_x[ids].reshape(n, m, -1).to(device)  # (n, m, in_len)
        self.worker_y = train_y[ids].reshape(n, m, -1).to(device)  # (n, m, 6)
        self.unit_tables = (self.worker_x, self.worker_y)  # a step's units: (x (U, in_len), y (U, 6))
        cap = args.max_eval_examples
        self.valid_x, self.valid_y = data.valid_x[:cap].to(device), data.valid_y[:cap].to(device)
        self.test_x, self.test_y = data.test_x[:cap].to(device), data.test_y[:cap].to(device)
        self.test_mean, self.test_std = data.test_mean[:cap].to(device), data.test_std[:cap].to(device)
        self.horizon = data.horizon
        self.model = FlatModel(AutoregressiveMLP(args.in_len, args.hidden, args.layers)).to(device)
        self.data_info = {
            "source": f"M4 {args.freq}",
            "files": [f"{args.data_dir}/m4/{args.freq}-{s}.csv" for s in ("train", "test")],
            "in_len": args.in_len, "out_len": OUT_LEN, "stride": STRIDE, "test_horizon": data.horizon,
            "train_windows_available": len(data.train_x), "train_windows_used": n * m,
            "valid_windows": len(self.valid_x), "test_series": len(self.test_x),
            "partition": args.partition,
            "worker_series_counts": [len(worker_series) for worker_series in series_sets],
            "series_on_several_workers": int(torch.cat(series_sets).bincount().gt(1).sum()),
        }

    def loss(self, flat, batch):
        x, y = batch  # (U, in_len), (U, 6)
        return F.mse_loss(self.model(flat, x, y.shape[-1]), y), None

    def unit_losses(self, flat, batch):
        x, y = batch
        return (self.model(flat, x, y.shape[-1]) - y).square().mean(dim=1)  # (U,)

    def unit_grads(self, flat, batch, n_local, k):
        """Per-window gradients (n_local, k, d) and losses (n_local, k): the rollout's backward written out
        (models.mlp.window_gradients: no autograd graph, no module calls), into the reused buffer; the
        general paths where outer products do not apply (a vmap tracer, --unit-grads vmap)."""
        if not self.outer_products_apply(flat):
            return super().unit_grads(flat, batch, n_local, k)
        grads = self._unit_grad_buffer(n_local * k)
        losses = self._window_gradients(*batch, out=grads)
        return grads.view(n_local, k, -1), losses.view(n_local, k)

    def _window_gradients(self, x, y, out):
        """models.mlp.window_gradients of the module (x (U, in_len), y (U, horizon) into out (U, d); the losses
        (U,)), a method of its own so that --compile can wrap it."""
        return window_gradients(self.model.module, x, y, out=out)

    def _squared_error_sum(self, flat, x, y, comm):
        """Sum of squared errors of a rollout of len y over all rows; fixed chunks split over processes."""
        total = 0.0
        for rows in eval_batches(len(x), EVAL_CHUNK, comm):
            pred = self.model(flat, x[rows], y.shape[-1])
            total += F.mse_loss(pred, y[rows], reduction="sum").double().item()
        return total

    def evaluate(self, flat, comm):
        train = (self.worker_x.flatten(0, 1), self.worker_y.flatten(0, 1))
        sums = [self._squared_error_sum(flat, x, y, comm)
                for x, y in (train, (self.valid_x, self.valid_y), (self.test_x, self.test_y))]
        train_sse, valid_sse, test_sse = sum_over_processes(sums, comm)
        # the 359 test series are few: every process computes sMAPE on all of them
        pred = self.model(flat, self.test_x, self.horizon)
        return {
            "train_loss": train_sse / train[1].numel(),
            "valid_loss": valid_sse / self.valid_y.numel(),
            "test_loss": test_sse / self.test_y.numel(),
            "test_smape": smape(destandardise(pred, self.test_mean, self.test_std),
                                destandardise(self.test_y, self.test_mean, self.test_std)),
        }


def make_parser():
    """The command line: the common flags with this benchmark's defaults, and its own flags."""
    parser = common_parser(BENCHMARK, __doc__, DEFAULTS, help_texts={
        "max_train_examples": "use only the first N training windows (before the worker split); quick runs",
        "max_eval_examples": "evaluate only the first N validation windows and the first N test series"})
    parser.add_argument("--freq", default="Weekly",
                        choices=("Hourly", "Daily", "Weekly", "Monthly", "Quarterly", "Yearly"),
                        help="M4 frequency: <data-dir>/m4/<freq>-{train,test}.csv")
    parser.add_argument("--in-len", type=int_flag(1), default=20, help="input window length (the original's --in_seq)")
    parser.add_argument("--hidden", type=int_flag(1), default=64, help="hidden width (the original's --nhid)")
    parser.add_argument("--layers", type=int_flag(2), default=3,
                        help="Linear layers including input and output (the original's --nlayers)")
    parser.add_argument("--partition", default="random", metavar="{random,contiguous}",
                        type=partition_type(("random", "contiguous"), why=" (M4 windows have no class label, "
                                            "so label-sorted and dirichlet do not apply)"),
                        help="how training windows are split over the workers: random (default: shuffled over "
                             "all workers by --seed, every worker sees almost every series) or contiguous (whole "
                             "series per worker, so workers see different series)")
    parser.epilog = ("test_smape = mean over series s and horizon steps h of 200 * |p - t| / (|p| + |t|) (percent), "
                     "p and t de-standardised with the series' training mean and std; 0 where p = t = 0.")
    return parser


def main():
    run_entry_point(BENCHMARK, make_parser(), MLPM4)


if __name__ == "__main__":
    main()
