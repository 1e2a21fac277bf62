"""Tiny GPT-2 on WikiText-103 with distributed example ordering (the paper's simulated 64-worker run).

    python main-GPT2-Wiki103.py --sorter CD-GraB --seed 0 --train-file DATA/wikitext-2/train.txt
    torchrun --standalone --nproc_per_node=4 main-GPT2-Wiki103.py --sorter D-RR --train-file ...

The ordering unit is one block of --max-seq-length tokens; by default 64 workers each take one block
per step (B = 64), as the original's single-process simulation. Per-example gradients come from
one backward plus per-block outer products (engine/functional.py); the update uses their mean over all workers (AdamW, one optimizer state for the run).
"""
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # before tokenizers is imported: we fork later

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common.errors import UserFacingError  # noqa: E402
from data.wikitext103 import load_blocks, split_file  # noqa: E402
from engine.cli import common_parser, int_flag  # noqa: E402
from engine.comm import node_leader_first  # noqa: E402
from engine.functional import FlatModel  # noqa: E402
from engine.task import Task, eval_batches, sum_over_processes, units_per_worker  # noqa: E402
from engine.entry import run_entry_point  # noqa: E402

BENCHMARK = "GPT2-Wiki103"
# the original README command: --sorter {CD-GraB|D-RR} --seed 0 (B 64 = node_cnt 64, AdamW 5e-4, wd 0, 50 epochs)
DEFAULTS = dict(sorter="CD-GraB", seed=0, lr=5e-4, weight_decay=0.0, B=64, node_cnt=64, epochs=50)
EVAL_BATCH = 32   # blocks per evaluation forward pass (32 x 128 x 50,257 logits = 0.8 GB in fp32)
# blocks per gradient pass (per-block or batched) on the CPU, where it bounds the intermediates (see unit_grads);
# a GPU holds a step's 64 blocks in one pass, so --grad-chunk auto takes them all there (fewer kernel launches)
GRAD_CHUNK = 16


class GPT2Wiki103(Task):
    name = BENCHMARK
    metric_columns = ("valid_loss", "train_ppl", "valid_ppl", "test_ppl")
    optimizer = "adamw"  # constant lr, as the original
    # blocks per gradient pass: unit_grads, batch_grad, Task.unit_sketches (--sketch-dim) and Task.unit_records
    # (None: a step's local blocks in one pass); set from --grad-chunk
    grad_chunk: int | None = GRAD_CHUNK

    def __init__(self, args, device):
        self.grad_chunk = grad_chunk(getattr(args, "grad_chunk", "auto"), device)
        block = args.max_seq_length  # >= 2: one input and one target token
        for split in ("train", "valid", "test"):  # a missing file fails in every process alike, before any waiting
            split_file(args.data_dir, split, args.train_file)
        with node_leader_first():  # under torchrun one process per node tokenizes; the others then read its cache
            splits = {split: load_blocks(args.data_dir, split, block, train_file=args.train_file,
                                         cache_dir=args.cache_dir) for split in ("train", "valid", "test")}
        train = splits["train"]
        available = len(train)
        if args.max_train_examples:
            train = train[:args.max_train_examples]
        n, k = args.node_cnt, args.B // args.node_cnt
        # contiguous split like the original: m = last_even(N // n) blocks per worker (for k = 1); in general an
        # even number of steps of k blocks, so that pair sorters see complete pairs
        m = units_per_worker(len(train), n, k, f"training blocks of {block} tokens")
        self.n_workers, self.n_units, self.units_per_step, self.global_batch = n, m, k, args.B
        used = n * self.n_units
        # worker j owns blocks j*m .. (j+1)*m - 1
        self.worker_blocks = train[:used].reshape(n, self.n_units, block).to(device)  # (n, m, T)
        self.eval_blocks = {}
        for split in ("valid", "test"):  # the real WikiText-103 splits (the original reported valid as "test")
            self.eval_blocks[split] = splits[split][:args.max_eval_examples].to(device)
        # imports transformers (seconds): only once the data is there
        from models.gpt2 import build_gpt2, causal_mask, lm_loss
        self.lm_loss = lm_loss
        self.model = FlatModel(build_gpt2(n_positions=block)).to(device)
        self.positions = torch.arange(block, device=device)[None]  # (1, T)
        self.mask = causal_mask(block, self.model.flat.dtype, device)  # (1, 1, T, T), made here: outside torch.func
        self.data_info = {
            "train_file": str(split_file(args.data_dir, "train", args.train_file)),
            "block_size": block, "tokenizer": "GPT-2 byte-level BPE (50,257 ids)",
            "train_blocks_used": used, "train_blocks_available": available,
            "valid_blocks": len(self.eval_blocks["valid"]), "test_blocks": len(self.eval_blocks["test"]),
        }

    def units(self, workers, unit_ids):
        return self.pick_units(self.worker_blocks, workers, unit_ids)  # (U, T)

    def logits(self, flat, ids):
        """(U, T, V) logits of blocks ids (U, T); positions passed per block so that every layer input
        has the blocks on dim 0 (what the outer-product gradients need), with a precomputed causal
        mask (1, 1, T, T) (models.gpt2.causal_mask): without a mask, transformers reads position_ids
        on the host to look for packed sequences, and from a 2-D mask it builds the 4-D one every
        forward (transformers 5.17 with a host synchronisation); on a GPU either waits for every
        kernel queued before it."""
        T = ids.shape[1]
        positions = self.positions[:, :T].expand(ids.shape[0], -1)
        return self.model(flat, input_ids=ids, position_ids=positions, attention_mask=self.mask[:, :, :T, :T],
                          use_cache=False).logits

    def loss(self, flat, ids):
        return self.lm_loss(self.logits(flat, ids), ids), None

    def unit_losses(self, flat, ids):
        """(U,) mean next-token loss of each block."""
        logits = self.logits(flat, ids)
        per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")  # contiguous rows: fast
        return per_token.view(len(ids), -1).mean(1)

    def unit_grads(self, flat, batch, n_local, k):
        """Per-block gradients (n_local, k, d), `grad_chunk` blocks per pass into one reused buffer.

        Each pass is one forward and one backward to the layer outputs, then per-block outer products
        written straight into the buffer rows (engine/functional.py). Chunks bound the intermediates:
        the 50,257-way logits and their gradient are 0.4 GB per 16 blocks. The buffer is reused from
        step to step, so the (U, d) gradients exist once: the returned tensor is valid until the next
        call (the engine and the sorters copy what they keep).
        """
        if not self.outer_products_apply(flat):
            return super().unit_grads(flat, batch, n_local, k)  # vmap, unchunked
        units = len(batch)
        buffer = self._unit_grad_buffer(units)
        if (self.grad_chunk or units) >= units:  # one pass: the losses come out whole
            _, losses = self.model.outer_unit_gradients(self.unit_losses, batch, out=buffer)
            return buffer.view(n_local, k, -1), losses.view(n_local, k)
        losses = torch.empty(units, dtype=flat.dtype, device=flat.device)
        for rows, part in self.grad_passes(batch, units):
            _, losses[rows] = self.model.outer_unit_gradients(self.unit_losses, part, out=buffer[rows])
        return buffer.view(n_local, k, -1), losses.view(n_local, k)

    def batch_grad(self, flat, batch):
        """Mean gradient (d,) over the local blocks, accumulated `grad_chunk` blocks at a time
        (one pass over 64 blocks peaks at 7.5 GiB on the CPU, mostly the 50,257-way logits)."""
        if flat is not self.model.flat:
            return super().batch_grad(flat, batch)  # other parameters: torch.func, unchunked
        if (self.grad_chunk or len(batch)) >= len(batch):  # one pass: the textbook step
            return self.model.batch_gradient(self.loss, batch)
        total_loss = torch.zeros((), dtype=flat.dtype, device=flat.device)
        for start in range(0, len(batch), self.grad_chunk):
            chunk = batch[start:start + self.grad_chunk]
            weight = len(chunk) / len(batch)
            grad, loss, _ = self.model.batch_gradient(self.loss, chunk, scale=weight, accumulate=start > 0)
            total_loss += loss * weight
        return grad, total_loss, None

    def evaluate(self, flat, comm):
        splits = {"train": self.worker_blocks.flatten(0, 1), **self.eval_blocks}
        metrics = {}
        for split, blocks in splits.items():
            loss_sum = 0.0
            for rows in eval_batches(len(blocks), EVAL_BATCH, comm):
                ids = blocks[rows]
                logits = self.logits(flat, ids)
                per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
                loss_sum += per_token.double().sum().item()
                del logits, per_token
            loss_sum, = sum_over_processes([loss_sum], comm)
            mean = loss_sum / (len(blocks) * (blocks.size(1) - 1))  # mean per predicted token
            metrics[f"{split}_loss"] = mean
            metrics[f"{split}_ppl"] = float(torch.tensor(mean, dtype=torch.float64).exp())  # not exp(sum/(N-1))
        return metrics


def grad_chunk(flag: str, device) -> int | None:
    """Blocks per gradient pass for --grad-chunk (None: all of a step's local blocks at once): auto takes
    GRAD_CHUNK on the CPU and all on a GPU."""
    if flag == "auto":
        return GRAD_CHUNK if torch.device(device).type == "cpu" else None
    return None if flag == "all" else int(flag)


def chunk_flag(text: str) -> str:
    """--grad-chunk's argparse type: auto, all or a whole number >= 1, else one line."""
    return text if text in ("auto", "all") else str(int_flag(1)(text))


def make_parser():
    """The command line: the common flags with this benchmark's defaults, and its own flags."""
    parser = common_parser(BENCHMARK, __doc__, DEFAULTS)
    parser.add_argument("--train-file", default=None, metavar="PATH",
                        help="training text in WikiText format, instead of <data-dir>/wikitext-103/wiki.train.* "
                             "(stand-in: <data-dir>/wikitext-2/train.txt, whose articles are in WikiText-103)")
    parser.add_argument("--max-seq-length", type=int_flag(2), default=128, metavar="T",
                        help="tokens per block (one ordering unit); also the model's number of positions")
    parser.add_argument("--grad-chunk", type=chunk_flag, default="auto", metavar="BLOCKS",
                        help=f"blocks per gradient pass (forward and backward): a whole number, 'all' (a step's "
                             f"local blocks in one pass: fewest kernel launches) or 'auto' (default: {GRAD_CHUNK} "
                             "on the CPU, where it bounds memory, all on a GPU); the results agree to float32 "
                             "rounding")
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="folder for the tokenized-block cache; when unset: $CDGRAB_CACHE, else a cache/ "
                             "folder beside each data file, else ~/.cache/cdgrab")
    return parser


def main():
    run_entry_point(BENCHMARK, make_parser(), GPT2Wiki103)


if __name__ == "__main__":
    main()
