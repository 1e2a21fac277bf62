"""What the kit runs: each benchmark's entry script and settings (the sweeps'), the queue, most valuable
first, the run names (the sweeps'), and --only's choice among them."""
from scripts.gpu_kit.base import fail

# benchmark -> entry script, the paper's settings (as scripts/sweep-<benchmark>.sh runs them), the grid's
# setting beyond them (extra arguments of the sweep), the run name's pattern (the sweep's, with {tag} for a
# variant's tag) and the tiny slice of the dry run. The LSTM grid runs with --clip 0.25: the setting
# analysis.lstm_setting picks from the shipped runs (without clipping, seed 0's D-RR and CD-GraB runs part
# at epoch 1, whose order is the same for both); the unclipped runs shipped so far (the original's HEAD)
# keep their names, which this queue does not touch.
BENCHMARKS = {
    "LSTM-Wiki2": {
        "script": "main-LSTM-Wiki2.py",
        "args": ["--lr", "5.0", "--node_cnt", "4", "--B", "16", "--carry-hidden"],
        "setting": ["--clip", "0.25"],
        "epochs": 50,
        "name": "{sorter}-node4-B16-lr5-carry-hidden-clip0.25{tag}-seed{seed}",
        "checkpoint_travels": True,  # parameters and momentum: 8 MiB packed
        "tiny": ["--node_cnt", "2", "--B", "4", "--bptt", "8", "--max-train-examples", "8",
                 "--max-eval-examples", "2"],
    },
    "GPT2-Wiki103": {  # the notebook's 30 epochs; WikiText-2 train stands in for WikiText-103 train
        "script": "main-GPT2-Wiki103.py",
        "args": ["--lr", "5e-4", "--node_cnt", "64", "--B", "64", "--train-file", "{data}/wikitext-2/train.txt"],
        "setting": [],
        "epochs": 30,
        "name": "{sorter}-node64-B64-lr0.0005{tag}-seed{seed}",
        "checkpoint_travels": False,  # parameters and AdamW's two moments: 73 MiB packed
        "tiny": ["--node_cnt", "2", "--B", "2", "--max-seq-length", "16", "--max-train-examples", "8",
                 "--max-eval-examples", "2", "--train-file", "{data}/wikitext-103/wiki.valid.tokens"],
    },
}
# a queued sorter name -> (the --sorter it runs, its extra arguments, the tag they add to the run name, as
# the sweeps name it: scripts/run_tag.py); a plain sorter name runs that sorter as it is
VARIANTS = {"CD-GraB-sketch1024": ("CD-GraB", ["--sketch-dim", "1024"], "-sketch-dim1024"),
            # Greedy keeps every unit's gradient of the last epoch: a sketch's, at these sizes (docs/sorters.md)
            "Greedy-sketch4096": ("Greedy", ["--sketch-dim", "4096"], "-sketch-dim4096"),
            "Greedy-sketch1024": ("Greedy", ["--sketch-dim", "1024"], "-sketch-dim1024"),
            "RPB-sketch1024": ("RPB", ["--sketch-dim", "1024"], "-sketch-dim1024")}
# most valuable first (issue #44, goals 7-8): seed 0's LSTM D-RR and CD-GraB, whose epoch 1 shows whether
# the grid's setting measures order, and its Fold (the Fold question); then GPT-2 seed 0; then seeds 1 and
# 2 alike; then GPT-2 with sketched CD-GraB (D 1024). A GPT-2 run must finish in the call it starts in (its
# checkpoint cannot travel), so the plan starts one only where it can (start_refusal); the LSTM runs go
# on from session to session.
SEED_RUNS = (("LSTM-Wiki2", "D-RR"), ("LSTM-Wiki2", "CD-GraB"), ("LSTM-Wiki2", "Fold"),
             ("GPT2-Wiki103", "CD-GraB"), ("GPT2-Wiki103", "D-RR"))
# After them, issue #60's orderers (the leaderboard's), seed 0 of every one first: the gradient-free FlipFlop
# and SWR, MB-GraB (each worker's step gradient), RPB and Greedy (per-example gradients; on GPT-2 RPB
# balances sketches as the sketched CD-GraB run does, and Greedy keeps sketches on both). Not MB-GraB on
# GPT-2: with 64 workers and B 64 a worker's step is one example, and a one-example micro-batch is CD-GraB.
ORDERER_RUNS = (("LSTM-Wiki2", "FlipFlop"), ("LSTM-Wiki2", "SWR"), ("LSTM-Wiki2", "MB-GraB"), ("LSTM-Wiki2", "RPB"),
                ("LSTM-Wiki2", "Greedy-sketch4096"), ("GPT2-Wiki103", "FlipFlop"), ("GPT2-Wiki103", "SWR"),
                ("GPT2-Wiki103", "RPB-sketch1024"), ("GPT2-Wiki103", "Greedy-sketch1024"))
QUEUE = [(benchmark, sorter, seed) for seed in (0, 1, 2) for benchmark, sorter in SEED_RUNS] + \
        [("GPT2-Wiki103", "CD-GraB-sketch1024", 0)] + \
        [(benchmark, sorter, seed) for seed in (0, 1, 2) for benchmark, sorter in ORDERER_RUNS]
CUDA_TESTS = ["tests/test_cuda.py", "tests/test_host_sync.py", "tests/test_overlap_cuda.py"]
LSTM_CHECK = ["tests/test_cuda.py::test_gradients_and_evaluation_agree_with_the_cpu[LSTM-Wiki2]"]  # cuDNN, the runs' units
TINY_EPOCHS = 6


def select_queue(only) -> list:
    """The QUEUE entries that --only names, in QUEUE's order (most valuable first). Each entry of `only` is
    BENCHMARK, BENCHMARK/SORTER or BENCHMARK/SORTER/SEED; one that names no queued run is refused, since
    a typo would otherwise spend a call of device time on nothing."""
    if not only:
        return list(QUEUE)
    keys = [(b, s, str(seed)) for b, s, seed in QUEUE]
    wanted = [tuple(entry.split("/")) for entry in only]  # a prefix of a key; 4 parts match none
    for entry, parts in zip(only, wanted):
        if not any(key[:len(parts)] == parts for key in keys):
            runs = sorted({f"{b}/{s}" for b, s, _ in QUEUE})
            fail(f"--only {entry!r} names no queued run: give BENCHMARK[/SORTER[/SEED]], one of "
                 f"{', '.join(runs)}, seeds {QUEUE[0][2]}-{QUEUE[-1][2]}")
    return [q for q, key in zip(QUEUE, keys) if any(key[:len(parts)] == parts for parts in wanted)]


def variant(queued: str) -> tuple[str, list, str]:
    """A queued sorter name's (--sorter, extra arguments, run-name tag)."""
    return VARIANTS.get(queued, (queued, [], ""))


def run_name(benchmark: str, queued: str, seed: int) -> str:
    sorter, _, tag = variant(queued)
    return BENCHMARKS[benchmark]["name"].format(sorter=sorter, tag=tag, seed=seed)


def packed_checkpoint_name(benchmark: str, name: str) -> str:
    return f"ckpt-{benchmark}--{name}.pt.gz"
