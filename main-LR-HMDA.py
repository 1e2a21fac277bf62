"""Logistic regression on HMDA mortgage data with distributed example ordering (paper section 6.1).

    python main-LR-HMDA.py --sorter CD-GraB --seed 0                          # 4 workers, one process
    torchrun --standalone --nproc_per_node=4 main-LR-HMDA.py --sorter D-RR    # 4 workers, 4 processes

The ordering unit is one example: each worker takes B / node_cnt examples per step, per-example
gradients come from one backward plus per-example outer products (engine/functional.py), and the update uses their mean over all workers.
"""
import torch
import torch.nn.functional as F

from data.hmda import load_hmda
from data.partition import partition_type, split_by_labels
from engine.cli import common_parser
from engine.functional import FlatModel
from engine.task import Task, eval_batches, sum_over_processes, units_per_worker
from engine.entry import run_entry_point

BENCHMARK = "LR-HMDA"
# the original README command: --lr 5e-3 --node_cnt 4 --B 16 --epochs 50 (momentum 0.9, constant lr)
DEFAULTS = dict(sorter="CD-GraB", seed=0, lr=5e-3, momentum=0.9, weight_decay=0.0, B=16, node_cnt=4, epochs=50)
EVAL_CHUNK = 8192


class LogisticHMDA(Task):
    name = BENCHMARK
    metric_columns = ("train_acc", "test_acc")
    vmap_over_workers = True
    linear_stack = True  # local steps: every worker's gradient in closed form (stacked_gradients)
    compiled_methods = ("batch_grad", "_closed_form")  # --compile: both closed forms (engine/compiled.py)

    def __init__(self, args, device):
        data = load_hmda(args.data_dir, args.hmda_file)
        train_x, train_y = data.train_x, data.train_y
        if args.max_train_examples:
            train_x, train_y = train_x[:args.max_train_examples], train_y[:args.max_train_examples]
        n, k = args.node_cnt, args.B // args.node_cnt
        m = units_per_worker(len(train_x), n, k, "training examples")
        used = n * m
        self.n_workers, self.n_units, self.units_per_step, self.global_batch = n, m, k, args.B
        # the first `used` rows, split by --partition (data/partition.py); the default, contiguous, is the
        # original's: worker r owns rows r*m .. (r+1)*m - 1
        rows = split_by_labels(train_y[:used], self.n_workers, args.partition, args.seed)  # (n, m)
        self.worker_x = train_x[rows].to(device)  # (n, m, F)
        self.worker_y = train_y[rows].to(device)  # (n, m)
        self.unit_tables = (self.worker_x, self.worker_y)  # a step's units: (x (U, F), y (U,))
        self.test_x, self.test_y = data.test_x[:args.max_eval_examples].to(device), data.test_y[:args.max_eval_examples].to(device)
        self.model = FlatModel(torch.nn.Linear(data.num_features, 1)).to(device)
        self.data_info = {"source": data.source, "files": data.files, "features": data.num_features,
                          "train_examples_used": used, "train_examples_available": len(data.train_x),
                          "test_examples": len(self.test_x), "train_positive_rate": float(train_y[:used].mean()),
                          "partition": args.partition,
                          "worker_positive_rates": [round(float(r), 6) for r in train_y[rows].mean(dim=1)]}

    def loss(self, flat, batch):
        x, y = batch  # (U, F), (U,)
        logits = self.model(flat, x).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logits, y), None

    def unit_losses(self, flat, batch):
        x, y = batch
        return F.binary_cross_entropy_with_logits(self.model(flat, x).squeeze(-1), y, reduction="none")  # (U,)

    def unit_grads(self, flat, batch, n_local, k):
        """Per-example gradients in closed form, (n_local, k, d) and losses (n_local, k): for
        loss = BCE(w.x + b, y) the gradient is (sigmoid(w.x + b) - y) * [x, 1] (the layout of `flat`:
        the weight row, then the bias). No autograd at all: at d = 26 its bookkeeping is the cost.
        Other parameters (e.g. a vmap tracer) and --unit-grads vmap take the general path."""
        if not self.outer_products_apply(flat):
            return super().unit_grads(flat, batch, n_local, k)
        grads, losses = self._closed_form(flat, batch, self._unit_grad_buffer(len(batch[0])))
        return grads.view(n_local, k, -1), losses.view(n_local, k)

    def batch_grad(self, flat, batch):
        """The mean gradient (d,) of the batch's loss in closed form, with the loss and aux (None), for
        D-RR and the other sorters without per-unit gradients: r = (sigmoid(w.x + b) - y) / U per example,
        the weight's gradient r^T X and the bias's sum(r), into the model's gradient buffer (valid until the
        next gradient call, as Task.batch_grad's). No autograd graph: at d = 26 building and walking it cost
        more than the arithmetic, which made D-RR's step dearer than CD-GraB's closed-form one. The operators
        are the ones autograd's backward of the module runs (the module's own forward, BCE's backward
        (sigmoid(z) - y) / U, the Linear's mm and sum), in the same order, so the gradient is the same to the
        bit. Other parameters and --unit-grads vmap take the general (autograd) path."""
        if not self.outer_products_apply(flat):
            return super().batch_grad(flat, batch)
        x, y = batch  # (U, F), (U,)
        grad = self.model.grad
        with torch.no_grad():
            logits = self.model(flat, x).squeeze(-1)  # (U,): the module's forward (addmm), as autograd's path
            loss = F.binary_cross_entropy_with_logits(logits, y)
            residual = torch.sigmoid(logits).sub_(y).div_(len(y))  # BCE's backward, mean reduction
            torch.mm(residual[None], x, out=grad[:-1].view(1, -1))  # (1, U) @ (U, F): the weight row
            torch.sum(residual, 0, keepdim=True, out=grad[-1:])  # the bias
        return grad, loss, None

    def stacked_gradients(self, params, batch, k, per_unit):
        """Local steps: the closed form of unit_grads, worker j's units at its own row of params (n_local, d)."""
        n_local = params.shape[0]
        grads, losses = self._closed_form(params, batch, torch.empty(len(batch[0]), params.shape[1],
                                                                     dtype=params.dtype, device=params.device))
        grads, losses = grads.view(n_local, k, -1), losses.view(n_local, k)
        return grads.mean(1), grads if per_unit else None, losses.mean(1)

    @staticmethod
    def _closed_form(params, batch, out):
        """Per-example gradients into out (U, F + 1) and losses (U,) at params (F + 1,) shared, or
        (n_local, F + 1) with worker j's units (worker-major) at row j."""
        x, y = batch  # (U, F), (U,)
        with torch.no_grad():
            if params.dim() == 1:
                logits = torch.addmv(params[-1:], x, params[:-1])  # (U,)
            else:  # (n_local, k, F) @ (n_local, F, 1) + (n_local, 1, 1)
                rows = x.view(params.shape[0], -1, x.shape[1])
                logits = torch.baddbmm(params[:, None, -1:], rows, params[:, :-1, None]).view(-1)
            losses = F.binary_cross_entropy_with_logits(logits, y, reduction="none")
            if torch.compiler.is_compiling():  # one store of [x r, r] fuses with the rest (out= does not)
                residual = torch.sigmoid(logits).sub_(y)
                out.copy_(torch.cat([x * residual[:, None], residual[:, None]], dim=1))
            else:  # the residual made in the bias's column, where it is that gradient: no copy
                residual = torch.sigmoid(logits, out=out[:, -1]).sub_(y)
                torch.mul(x, residual[:, None], out=out[:, :-1])
        return out, losses

    def evaluate(self, flat, comm):
        train = (self.worker_x.flatten(0, 1), self.worker_y.flatten())
        metrics = {}
        for split, (x, y) in (("train", train), ("test", (self.test_x, self.test_y))):
            loss_sum, correct = 0.0, 0.0
            for rows in eval_batches(len(x), EVAL_CHUNK, comm):
                xb, yb = x[rows], y[rows]
                logits = self.model(flat, xb).squeeze(-1)
                loss_sum += F.binary_cross_entropy_with_logits(logits, yb, reduction="sum").double().item()
                correct += ((logits > 0).float() == yb).double().sum().item()
            loss_sum, correct = sum_over_processes([loss_sum, correct], comm)
            metrics[f"{split}_loss"], metrics[f"{split}_acc"] = loss_sum / len(x), correct / len(x)
        return metrics


def make_parser():
    """The command line: the common flags with this benchmark's defaults, and its own flags."""
    parser = common_parser(BENCHMARK, __doc__, DEFAULTS)
    parser.add_argument("--hmda-file", default=None,
                        help="use this HMDA file instead of searching <data-dir>/hmda/ (authors' .pt pair, "
                             "CFPB LAR 2017 csv/zip, or the HMDA 2018 sample csv/zip)")
    parser.add_argument("--partition", type=partition_type(), default="contiguous",
                        metavar="{contiguous,random,label-sorted,dirichlet:ALPHA}",
                        help="how the first n*m training rows are split over the workers: contiguous (default; "
                             "the original: worker r owns rows r*m..(r+1)*m-1), random (shuffled by --seed), "
                             "label-sorted (sorted by label: maximal label skew), dirichlet:ALPHA (each worker's "
                             "label mix drawn from Dirichlet(ALPHA), seeded by --seed; small ALPHA = strong skew). "
                             "Exact procedures: data/partition.py")
    return parser


def main():
    run_entry_point(BENCHMARK, make_parser(), LogisticHMDA)


if __name__ == "__main__":
    main()
