"""2-layer LSTM language model on WikiText-2 with distributed example ordering (paper section 6.2).

    python main-LSTM-Wiki2.py --sorter CD-GraB --seed 0                          # 4 workers, one process
    torchrun --standalone --nproc_per_node=4 main-LSTM-Wiki2.py --sorter D-RR    # 4 workers, 4 processes

The training split is batchified into B contiguous token streams (columns); worker r owns columns
[r*B/n, (r+1)*B/n). The ordering unit is one bptt chunk: rows [bptt*i, bptt*(i+1)) of the worker's
columns, the same chunk index space 0..m-1 on every worker (m = number of chunks rounded down to even).
Each step every worker takes ONE chunk; CD-GraB pairs consecutive steps. Loss: NLL, mean over the
bptt * B/n tokens of the chunk; the update averages the workers' gradients.

Hidden state: by default every chunk starts from a zero state (chunks are reordered, so the state of
the previous step belongs to an unrelated place in the text). --carry-hidden reproduces the original
(zeros at the start of each epoch, then each worker carries its detached state from step to step).

--order-unit example makes one column of one chunk (bptt tokens of one stream, zero initial state)
the ordering unit: worker r owns m * B/n units (unit u = chunk u // (B/n), column r*B/n + u % (B/n))
and takes B/n of them per step, so a step sees the same number of tokens; gradient sorters then
get one gradient per sequence and CD-GraB pairs units inside a step. With a balancing sorter a step
gathers and balances B/n times the gradients of the chunk unit; D-RR costs the same in both.
Not with --carry-hidden: a worker's units are no longer one stream whose state could be carried.

Evaluation after every epoch: mean per-token NLL (train_loss / valid_loss / test_loss) and
perplexity exp(mean NLL) on the used training chunks, the validation and the test split. Like the
original LM_test, each split is batchified with the same B columns, read in order with the hidden
state carried from chunk to chunk (zeros at the start of the split). The columns form n fixed blocks of
B/n (one per worker), split across processes; a process runs its blocks side by side in one forward
(fewer when one chunk of them exceeds EVAL_TOKENS tokens), several chunks per forward up to
EVAL_TOKENS. Per-token losses are summed in float64 on the device and read on the host once per
evaluation (after the sum over processes); since the columns are independent streams, the numbers do
not depend on the grouping, and one-process and torchrun runs give the same values (up to rounding).
"""
import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from common.errors import UserFacingError
from data.wikitext2 import batchify, load_wikitext2, n_chunks
from engine.cli import MAX_LR, common_parser, float_flag, int_flag
from engine.functional import FlatModel, products_into_slots
from engine.task import Task, shard, sum_over_processes
from engine.entry import run_entry_point
from models.lstm import LSTMModel, unit_gradients, without_cudnn

BENCHMARK = "LSTM-Wiki2"
# the original README command: --sorter CD-GraB --lr 5.0 --B 16 --node_cnt 4 --epochs 50
# (momentum 0.9, weight decay 0, lr x0.1 after epochs 10, 20, 30, 40)
DEFAULTS = dict(sorter="CD-GraB", seed=0, lr=5.0, momentum=0.9, weight_decay=0.0, B=16, node_cnt=4, epochs=50)
EMBED, HIDDEN, LAYERS = 32, 32, 2
EVAL_TOKENS = 1024  # tokens per evaluation forward (one chunk of one column block when that is more)
# units per pass of the batched per-unit gradients: the block-diagonal LSTM's weights grow as its square
UNITS_PER_PASS = 16


class LSTMWiki2(Task):
    name = BENCHMARK
    metric_columns = ("valid_loss", "train_ppl", "valid_ppl", "test_ppl")
    lr_decay_every = 10
    lr_decay_gamma = 0.1
    units_per_pass = UNITS_PER_PASS  # 0: one backward per unit (the reference path of the tests)

    def __init__(self, args, device):
        if args.carry_hidden and args.order_unit == "example":
            raise UserFacingError("--carry-hidden needs --order-unit chunk: with one column per unit, the units "
                                  "of a worker are no longer one stream whose state could be carried")
        corpus = load_wikitext2(args.data_dir)
        self.bptt, self.B, self.n_workers = args.bptt, args.B, args.node_cnt
        self.mb = args.B // args.node_cnt  # columns per worker
        self.carry_hidden, self.order_unit = args.carry_hidden, args.order_unit
        self.clip_grad_norm = args.clip
        self.device = device
        self.cudnn = getattr(args, "cudnn", "on") == "on"  # see _gradient_kernels; callers may predate --cudnn

        available = self._load_training_chunks(corpus.train, args.max_train_examples)
        self.eval_matrices = self._evaluation_matrices(corpus, args.max_eval_examples)
        if self.order_unit == "chunk":
            self.n_units, self.units_per_step = self.n_chunks, 1
        else:
            self.n_units, self.units_per_step = self.n_chunks * self.mb, self.mb
        self.global_batch = self.B
        self.model = FlatModel(LSTMModel(corpus.vocab_size, EMBED, HIDDEN, LAYERS)).to(device)
        self.hidden = None          # carried (h, c), each (n, layers, mb, hidden), with --carry-hidden
        self._local_workers = None  # the workers of the current step (set by `units`)
        self._pending_hidden = None  # new states computed in unit_grads, installed by end_step
        self.data_info = self._describe_data(args.data_dir, corpus, available)

    def _load_training_chunks(self, tokens, max_chunks) -> int:
        """The training split as B columns cut into bptt chunks: sets n_chunks (rounded down to even: the
        pair sorters need m even; at most max_chunks), train_matrix (the rows those chunks read, on the
        device) and chunk_tokens (bptt + 1, n, m, mb): [:, j, i] is worker j's view of chunk i, its input rows
        and the one extra target row. Returns the number of chunks available."""
        train = batchify(tokens, self.B)  # (rows, B)
        available = n_chunks(train.size(0), self.bptt)
        chunks = min(available, max_chunks or available) // 2 * 2
        if chunks == 0:
            limit = f" (--max-train-examples {max_chunks})" if max_chunks else ""
            raise UserFacingError(f"WikiText-2 train with --B {self.B} --bptt {self.bptt} gives {available} chunk(s)"
                                  f"{limit}; need at least 2")
        self.n_chunks = chunks
        # only the rows the used chunks read (inputs and their next-token targets)
        self.train_matrix = train[: chunks * self.bptt + 1].to(self.device)
        rows = self.train_matrix.unfold(0, self.bptt + 1, self.bptt)[:chunks]  # (m, B, bptt + 1)
        rows = rows.reshape(chunks, self.n_workers, self.mb, self.bptt + 1)
        # time-major in memory: a step's units, picked along dims 1-2, are then (bptt + 1, U, mb) tokens in the
        # LSTM's own time-major order, and the loss reads them without a copy
        self.chunk_tokens = rows.permute(3, 1, 0, 2).contiguous()
        return available

    def _evaluation_matrices(self, corpus, max_chunks) -> dict:
        """{split: ((rows, B) token matrix on the device, chunks evaluated)} for valid, test (at most
        max_chunks chunks) and train (the chunks trained on)."""
        matrices = {}
        for split in ("valid", "test"):
            matrix = batchify(getattr(corpus, split), self.B)
            n_split = min(n_chunks(matrix.size(0), self.bptt), max_chunks or matrix.size(0))
            if n_split == 0:
                raise UserFacingError(f"WikiText-2 {split} with --B {self.B} --bptt {self.bptt} has no full chunk")
            matrices[split] = (matrix[: n_split * self.bptt + 1].to(self.device), n_split)
        matrices["train"] = (self.train_matrix, self.n_chunks)
        return matrices

    def _describe_data(self, data_dir, corpus, available: int) -> dict:
        """config.json's "data": the files, the sizes and how units and evaluation are cut."""
        return {
            "source": "wikitext-2 (pytorch/examples word level)", "files": [f"{data_dir}/wikitext-2/{s}.txt"
                                                                           for s in ("train", "valid", "test")],
            "vocab_size": corpus.vocab_size,
            "tokens": {s: len(getattr(corpus, s)) for s in ("train", "valid", "test")},
            "bptt": self.bptt, "columns": self.B, "columns_per_worker": self.mb,
            "train_chunks_available": available, "train_chunks_used": self.n_chunks,
            "valid_chunks": self.eval_matrices["valid"][1], "test_chunks": self.eval_matrices["test"][1],
            "order_unit": self.order_unit, "hidden_state": "carried" if self.carry_hidden else "zero per chunk",
            "clip_grad_norm": self.clip_grad_norm,
            "evaluation": f"B={self.B} columns, in order, hidden carried; a process's blocks of {self.mb} "
                          f"columns side by side, up to {EVAL_TOKENS} tokens per forward; NLL summed in "
                          "float64; ppl = exp(mean NLL)",
        }

    # ------------------------------------------------------------------ training units
    def units(self, workers, unit_ids):
        """-> (inputs (U, bptt, w), targets (U, bptt, w), h0 (U, layers, w, hidden), c0 likewise), where
        U = n_local * k and w = B/n columns per unit (chunk) or 1 (example). The tokens are views of one index's
        result, time-major in memory: units then columns for the batch's LSTM (`loss`), columns then units
        when the run's steps form per-unit gradients (`per_unit_steps`: unit_gradients' order)."""
        if list(workers) != list(range(workers[0], workers[0] + len(workers))):
            raise ValueError(f"units: the workers of one call must be consecutive, got {list(workers)}")
        # the carried states of these workers, as a slice: indexing with a list would copy it to the GPU
        self._local_workers = slice(workers[0], workers[0] + len(workers))
        chunks = self.chunk_tokens
        unit_ids, rows = unit_ids.to(chunks.device), self.worker_rows(workers, chunks.device)
        if self.order_unit == "chunk" and self.per_unit_steps:
            # (bptt + 1, mb, U): the block-diagonal LSTM's token order (time, column, unit), which unit_gradients
            # reads without a copy; the same tokens as below, laid out otherwise
            seq = chunks.permute(0, 3, 1, 2)[:, :, rows, unit_ids].flatten(2, 3).permute(0, 2, 1)
        elif self.order_unit == "chunk":
            seq = chunks[:, rows, unit_ids].flatten(1, 2)  # (bptt + 1, U, mb), worker-major units
        else:
            chunk, column = unit_ids // self.mb, unit_ids % self.mb
            seq = chunks[:, rows, chunk, column].flatten(1, 2).unsqueeze(-1)  # (bptt + 1, U, 1)
        seq = seq.permute(1, 0, 2)  # (U, bptt + 1, w): a view, time-major in memory
        inputs, targets = seq[:, :-1], seq[:, 1:]
        if self.carry_hidden:
            h0, c0 = (state[self._local_workers] for state in self.hidden)  # k == 1: one unit per worker
        else:
            h0 = inputs.new_zeros((seq.size(0), LAYERS, seq.size(2), HIDDEN), dtype=self.model.flat.dtype)
            c0 = h0
        return inputs, targets, h0, c0

    def loss(self, flat, batch):
        """Mean NLL over all tokens of the units; the units' columns run side by side through the LSTM
        (columns are independent). aux: the final (h, c) per unit with --carry-hidden, else None."""
        inputs, targets, h0, c0 = batch
        U, T, w = inputs.shape
        x = inputs.permute(1, 0, 2).reshape(T, U * w)                    # time-major, column = (unit, col)
        state = tuple(s.permute(1, 0, 2, 3).reshape(LAYERS, U * w, HIDDEN).contiguous() for s in (h0, c0))  # cuDNN
        log_probs, (h, c) = self.model(flat, x, state)                   # (T * U * w, V)
        loss = F.nll_loss(log_probs, targets.permute(1, 0, 2).reshape(-1))
        if not self.carry_hidden:
            return loss, None
        back = lambda s: s.reshape(LAYERS, U, w, HIDDEN).permute(1, 0, 2, 3).detach()
        return loss, (back(h), back(c))

    def unit_grads(self, flat, batch, n_local, k):
        """Per-unit gradients (n_local, k, d) and losses (n_local, k) into one reused (U, d) buffer, valid
        until the next call: the units side by side in one pass (models.lstm.unit_gradients: a block-diagonal
        LSTM, UNITS_PER_PASS units at a time), or, through torch.func or with `units_per_pass` 0, one plain
        backward per unit (torch.vmap has no batching rule for the CPU LSTM kernel)."""
        units = n_local * k
        buffer = self._unit_grad_buffer(units)
        losses, states = [], []  # per pass, or per unit
        with self._gradient_kernels(flat):
            if flat is self.model.flat and self.units_per_pass:
                for start in range(0, units, self.units_per_pass):
                    rows = slice(start, min(start + self.units_per_pass, units))
                    pass_losses, aux = unit_gradients(self.model.module, *(t[rows] for t in batch), out=buffer[rows],
                                                      into_slots=products_into_slots(buffer.device))
                    losses.append(pass_losses)
                    states.append(aux)
            else:
                for u in range(units):
                    g, loss, aux = self.batch_grad(flat, tree_map(lambda t, u=u: t[u:u + 1], batch))
                    buffer[u].copy_(g)
                    losses.append(loss.view(1))
                    states.append(aux)
        if self.carry_hidden:
            self._pending_hidden = tuple(_joined([s[i] for s in states]) for i in range(2))
        return buffer.view(n_local, k, -1), _joined(losses).view(n_local, k)

    def batch_grad(self, flat, batch):
        with self._gradient_kernels(flat):
            return super().batch_grad(flat, batch)

    def _gradient_kernels(self, flat):
        """cuDNN's LSTM on CUDA, except through torch.func (parameters other than the model's own, e.g. a
        vmap tracer), where it fails (models.lstm.without_cudnn) and PyTorch's own kernels run. cuDNN
        computes in full float32: the suite turns its TF32 default off unless --tf32 (engine/device.py).
        Nothing changes on the CPU."""
        through_func = flat is not self.model.flat
        return without_cudnn() if self.device.type == "cuda" and (through_func or not self.cudnn) else nullcontext()

    def start_epoch(self, epoch):
        if self.carry_hidden:  # (n, layers, mb, hidden), layer-major in memory as `loss` reads it
            zeros = torch.zeros(LAYERS, self.n_workers, self.mb, HIDDEN, device=self.device,
                                dtype=self.model.flat.dtype).permute(1, 0, 2, 3)
            self.hidden = (zeros, zeros.clone())

    def end_step(self, aux):
        if not self.carry_hidden:
            return
        if aux is None:  # the unit_grads path: states were kept aside there
            aux, self._pending_hidden = self._pending_hidden, None
        if self._local_workers == slice(0, self.n_workers):
            # every worker's state is new: keep the step's own tensors, in the memory layout the step made (its
            # next step reads them without a copy)
            self.hidden = tuple(new.detach() for new in aux)
        else:
            for carried, new in zip(self.hidden, aux):
                carried[self._local_workers] = new.detach()

    # ------------------------------------------------------------------ evaluation
    def _eval_column_groups(self, comm) -> list[tuple[int, int]]:
        """This process's columns as (first, stop) column ranges, evaluated one after the other: its
        share of the n fixed blocks of B/n columns (shard), the blocks of a group side by side, as many
        as one bptt chunk of EVAL_TOKENS tokens holds (at least one block)."""
        mine = shard(self.n_workers, comm)
        per_group = max(1, EVAL_TOKENS // (self.bptt * self.mb))
        return [(first * self.mb, min(first + per_group, mine.stop) * self.mb)
                for first in range(mine.start, mine.stop, per_group)]

    def _nll_sum(self, flat, matrix, chunks, comm) -> torch.Tensor:
        """Summed per-token NLL of chunks 0..chunks-1 of this process's columns of a (rows, B) matrix:
        a 0-dim float64 tensor on flat's device, not read on the host here (evaluate reads it).

        Each column group runs as one (T, b) input per forward, b its columns side by side (columns are
        independent streams, so a column's result does not depend on its neighbours, up to rounding),
        T = bptt * (chunks per forward), with the (layers, b, hidden) state carried from forward to
        forward in chunk order. Per-token losses are summed in float64, so the total does not depend on
        how tokens are grouped into forwards, groups or processes beyond float64 rounding."""
        total = torch.zeros((), dtype=torch.float64, device=flat.device)
        for first, stop in self._eval_column_groups(comm):
            columns = matrix[:, first:stop]
            width = stop - first
            per_forward = max(1, EVAL_TOKENS // (self.bptt * width))  # bounds the (T * b, V) log-probs
            state = self.model.module.init_hidden(width)
            state = tuple(s.to(device=flat.device, dtype=flat.dtype) for s in state)
            for start in range(0, chunks, per_forward):
                stop_chunk = min(start + per_forward, chunks)
                rows = columns[start * self.bptt: stop_chunk * self.bptt + 1]
                log_probs, state = self.model(flat, rows[:-1], state)
                token_nll = F.nll_loss(log_probs, rows[1:].reshape(-1), reduction="none")  # (T * b,)
                total += token_nll.sum(dtype=torch.float64)
        return total

    def evaluate(self, flat, comm):
        splits = ("train", "valid", "test")
        with self._gradient_kernels(flat):  # only --cudnn off changes the kernels here
            sums = torch.stack([self._nll_sum(flat, *self.eval_matrices[split], comm) for split in splits])
        totals = sum_over_processes(sums, comm)  # the evaluation's one host read
        metrics = {}
        for split, total in zip(splits, totals):
            loss = total / (self.eval_matrices[split][1] * self.bptt * self.B)
            metrics[f"{split}_loss"] = loss
            metrics[f"{split}_ppl"] = math.exp(loss) if loss < 700 else math.inf
        return metrics


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts concatenated along dim 0; one part as it is (one pass: no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def make_parser():
    """The command line: the common flags with this benchmark's defaults, and its own flags."""
    parser = common_parser(BENCHMARK, __doc__, DEFAULTS, help_texts={
        "max_train_examples": "use only the first N bptt chunks of the B-column training matrix (rounded down to "
                              "even; also with --order-unit example); the train evaluation uses the same chunks",
        "max_eval_examples": "evaluate only the first N bptt chunks of the validation and test matrices"})
    parser.add_argument("--bptt", type=int_flag(1), default=35, help="tokens per stream per chunk (sequence length)")
    parser.add_argument("--clip", type=float_flag(0, MAX_LR, low_open=True), nargs="?", const=0.25, default=None, metavar="NORM",
                        help="clip the averaged (global-batch) gradient to this L2 norm, as torch's "
                             "clip_grad_norm_; '--clip' alone means 0.25 (the v1 code); None: no clipping "
                             "(as at HEAD)")
    parser.add_argument("--carry-hidden", action="store_true",
                        help="carry each worker's detached hidden state from step to step (zeros once per epoch), "
                             "as the original, although consecutive chunks are unrelated; without it every chunk "
                             "starts from zeros")
    parser.add_argument("--cudnn", choices=("on", "off"), default="on",
                        help="on CUDA, train and evaluate the LSTM with cuDNN's kernels (on), or with PyTorch's own "
                             "(off: the fallback when cuDNN fails the CUDA-vs-CPU check of tests/test_cuda.py); "
                             "through torch.func PyTorch's own run either way; no effect on the CPU")
    parser.add_argument("--order-unit", choices=("chunk", "example"), default="chunk",
                        help="ordering unit: one bptt chunk of the worker's B/n columns (the paper), or one "
                             "column of one chunk (B/n units per worker per step, zero initial state each; "
                             "about 2x slower per step with gradient sorters; not with --carry-hidden)")
    return parser


def main():
    run_entry_point(BENCHMARK, make_parser(), LSTMWiki2)


if __name__ == "__main__":
    main()
