"""Per-step overhead of the suite against a textbook PyTorch loop, measured in one run (issue #7, goals 1-4).

    OMP_NUM_THREADS=1 python bench/step_overhead.py [--data-dir DIR] [--steps 3000] [--rounds 3] [--no-gpt2]
                                                    [--json PATH]

Writes ONE JSON object to bench/results/step-overhead-cpu.json (--json) and prints it: git_commit (of the code
it ran), date, command, torch, threads, and

- "step": microseconds per training step of the textbook loop (index a batch, nn.Module forward,
  loss, zero_grad, backward, torch.optim.SGD(momentum=0.9).step(), loss.item()) and of our engine's
  epoch loop (`engine.train.train`, one process, real data, paper settings) with D-RR and CD-GraB,
  and their ratios to the textbook loop: LR-HMDA (4 workers, B 16) and MLP-M4 in both settings
  (32 workers, B 32; 4 workers, B 16). Rounds are interleaved; each number is the median round.
- "sorter_step": microseconds per CD-GraB `sorter.step` (and D-RR's) at the LR-HMDA and M4 sizes,
  the minimum over windows of 100 steps (the least disturbed by other processes).
- "sign_loop": CD-GraB's CPU sign loop at d = 1,081,792 (the LSTM's d) against one fused
  inner-product-and-update pass over the same difference vectors, microseconds per vector.
- "unit_grads": per-unit gradients (outer products, and vmap) against one plain batched backward of
  the same batch: LR (16 examples), MLP (32 windows), GPT-2 (16 blocks of 128 tokens, full vocabulary).
"""
import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere

from common.paths import default_data_dir  # noqa: E402
from engine import runlog  # noqa: E402
from engine.comm import LocalCommunicator  # noqa: E402
from engine.cli import check_args  # noqa: E402
from engine.functional import FlatModel, unit_gradients  # noqa: E402
from engine.train import train  # noqa: E402
from sorters import build_sorter  # noqa: E402


def entry_module(name: str):
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), REPO / f"main-{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ goal 1: whole steps
def textbook_seconds_per_step(model, loss_fn, xs, ys, batch: int, steps: int, lr: float) -> float:
    """The loop a user would write: a fresh shuffled batch each step, torch.optim.SGD with momentum."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    order = torch.randperm(len(xs), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    for step in range(steps):
        idx = order[step * batch:(step + 1) * batch]
        x, y = xs[idx], ys[idx]
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()
    return (time.perf_counter() - start) / steps


def engine_seconds_per_step(module, argv: list[str], tmp: str) -> float:
    """One epoch of our engine in this process; training seconds (evaluation excluded) per step."""
    args = module.make_parser().parse_args(argv + ["--epochs", "1", "--progress", "off", "--max-eval-examples",
                                                   "64", "--out", tempfile.mkdtemp(dir=tmp)])
    check_args(args, module.BENCHMARK)
    device = torch.device("cpu")
    torch.manual_seed(args.seed)
    task = module.__dict__[TASK_CLASS[module.BENCHMARK]](args, device)  # data loading: not timed
    rows = train(task, args, LocalCommunicator(args.node_cnt), device)
    steps = task.n_units // task.units_per_step
    return rows[-1]["epoch_seconds"] / steps


TASK_CLASS = {"LR-HMDA": "LogisticHMDA", "MLP-M4": "MLPM4"}


def bench_steps(data_dir: str, steps: int, rounds: int, tmp: str) -> dict:
    from data.hmda import load_hmda
    from data.m4 import load_m4
    from models.mlp import AutoregressiveMLP

    lr_module, m4_module = entry_module("LR-HMDA"), entry_module("MLP-M4")
    hmda = load_hmda(data_dir)
    m4 = load_m4(data_dir, freq="Weekly", in_len=20, out_len=6, stride=3)
    settings = {
        "LR-HMDA": (lr_module, ["--node_cnt", "4", "--B", "16"], 16,
                    lambda: torch.nn.Linear(hmda.num_features, 1), hmda.train_x, hmda.train_y,
                    lambda out, y: F.binary_cross_entropy_with_logits(out.squeeze(-1), y), 5e-3),
        "MLP-M4 (32 workers, B 32)": (m4_module, ["--node_cnt", "32", "--B", "32"], 32, AutoregressiveMLP,
                                      m4.train_x, m4.train_y, None, 1e-3),
        "MLP-M4 (4 workers, B 16)": (m4_module, ["--node_cnt", "4", "--B", "16"], 16, AutoregressiveMLP,
                                     m4.train_x, m4.train_y, None, 1e-3),
    }
    results = {}
    for name, (module, flags, batch, build, xs, ys, loss_fn, lr) in settings.items():
        if loss_fn is None:  # the M4 rollout: the model needs the horizon
            model = build()
            call = lambda x, model=model: model(x, 6)  # noqa: E731
        else:
            model = call = build()
            model.train()
        times = {"textbook": [], "D-RR": [], "CD-GraB": []}
        engine_argv = flags + ["--max-train-examples", str(steps * batch), "--data-dir", data_dir]
        for _ in range(rounds):
            times["textbook"].append(textbook_seconds_per_step(
                _Wrapped(model, call), loss_fn or F.mse_loss, xs, ys, batch, steps, lr))
            for sorter in ("D-RR", "CD-GraB"):
                times[sorter].append(engine_seconds_per_step(module, engine_argv + ["--sorter", sorter], tmp))
        median = {key: statistics.median(values) for key, values in times.items()}
        results[name] = {
            "steps_per_round": steps, "rounds": rounds,
            **{f"{key}_us": round(1e6 * value, 1) for key, value in median.items()},
            "D-RR_over_textbook": round(median["D-RR"] / median["textbook"], 3),
            "CD-GraB_over_textbook": round(median["CD-GraB"] / median["textbook"], 3),
            "CD-GraB_over_D-RR": round(median["CD-GraB"] / median["D-RR"], 3),
        }
    return results


class _Wrapped(torch.nn.Module):
    """Gives the textbook loop one `model(x)` call for both benchmarks."""

    def __init__(self, model, call):
        super().__init__()
        self.model, self.call = model, call

    def forward(self, x):
        return self.call(x)


# ------------------------------------------------------------------ goal 3: sorter bookkeeping
def bench_sorter_steps() -> dict:
    results = {}
    for label, (n, k, d) in {"LR-HMDA (n=4, k=4, d=26)": (4, 4, 26), "MLP-M4 (n=32, k=1, d=5569)": (32, 1, 5569),
                             "MLP-M4 (n=4, k=4, d=5569)": (4, 4, 5569)}.items():
        m = 4000
        grads = torch.randn(n, k, d, generator=torch.Generator().manual_seed(0))
        entry = {}
        for name in ("CD-GraB", "D-RR"):
            sorter = build_sorter(name, n, m, d, seed=0)
            best = float("inf")
            for _ in range(3):
                sorter.sort()
                for step in range(m // k):
                    if step % 100 == 0:
                        start = time.perf_counter()
                    sorter.step(grads if sorter.uses_grads else None, range(step * k, (step + 1) * k))
                    if step % 100 == 99:
                        best = min(best, (time.perf_counter() - start) / 100)
            entry[f"{name}_us"] = round(1e6 * best, 1)
        if k == 1:  # the floor: CD-GraB must copy the first unit of each pair (the caller reuses its buffer)
            block, copy = grads[:, 0].numpy(), np.empty((n, d), dtype=np.float32)
            start = time.perf_counter()
            for _ in range(1000):
                np.copyto(copy, block)
            entry["copy_of_one_(n,d)_block_us"] = round(1e6 * (time.perf_counter() - start) / 1000, 1)
        results[label] = entry
    return results


def bench_sign_loop(d: int = 1_081_792, vectors: int = 8) -> dict:
    """Our sign loop vs one fused inner-product-and-update pass (the memory-bound floor) per vector."""
    from numba import njit

    from sorters.balance import _MINUS_PLUS_ONE, _pair_signs_cpu

    @njit(fastmath={"reassoc", "contract"}, nogil=True)
    def one_fused_pass(s, firsts, seconds):
        total = 0.0
        for j in range(firsts.shape[0]):
            f, g = firsts[j, 0], seconds[j, 0]
            dot = s[0] - s[0]
            for i in range(s.shape[0]):
                s[i] += f[i] - g[i]
                dot += s[i] * (f[i] - g[i])
            total += dot
        return total

    rng = np.random.default_rng(0)
    firsts = rng.standard_normal((vectors, 1, d), dtype=np.float32)
    seconds = rng.standard_normal((vectors, 1, d), dtype=np.float32)
    s, plus = np.zeros(d), np.empty((1, vectors), dtype=np.bool_)  # one pair per worker
    ours = _pair_signs_cpu()
    runs = {"sign_loop": lambda: ours(s, firsts, 0, seconds, 0, plus, _MINUS_PLUS_ONE),
            "fused_pass": lambda: one_fused_pass(s, firsts, seconds)}
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(5):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], (time.perf_counter() - start) / vectors)
    return {"d": d, "sign_loop_us_per_vector": round(1e6 * best["sign_loop"], 1),
            "fused_pass_us_per_vector": round(1e6 * best["fused_pass"], 1),
            "ratio": round(best["sign_loop"] / best["fused_pass"], 3)}


# ------------------------------------------------------------------ goal 4: per-unit gradients
def bench_unit_grads(data_dir: str, with_gpt2: bool) -> dict:
    from models.mlp import AutoregressiveMLP

    gen = torch.Generator().manual_seed(0)
    cases = {}
    lr = FlatModel(torch.nn.Linear(25, 1))
    x, y = torch.randn(16, 25, generator=gen), (torch.rand(16, generator=gen) > 0.5).float()
    cases["LR (16 examples, d=26)"] = (
        lr, (x, y), lambda f, b: F.binary_cross_entropy_with_logits(lr(f, b[0]).squeeze(-1), b[1]),
        lambda f, b: F.binary_cross_entropy_with_logits(lr(f, b[0]).squeeze(-1), b[1], reduction="none"), 300)
    mlp = FlatModel(AutoregressiveMLP())
    x, y = torch.randn(32, 20, generator=gen), torch.randn(32, 6, generator=gen)
    cases["MLP (32 windows, d=5569)"] = (
        mlp, (x, y), lambda f, b: F.mse_loss(mlp(f, b[0], 6), b[1]),
        lambda f, b: (mlp(f, b[0], 6) - b[1]).square().mean(1), 100)
    if with_gpt2:
        from models.gpt2 import build_gpt2, lm_loss
        gpt2 = FlatModel(build_gpt2())
        ids = torch.randint(0, 50257, (16, 128), generator=gen)
        positions = torch.arange(128).expand(16, 128)

        def gpt2_unit_losses(f, b):
            logits = gpt2(f, input_ids=b, position_ids=positions[:len(b)], use_cache=False).logits
            per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), b[:, 1:].flatten(), reduction="none")
            return per_token.view(len(b), -1).mean(1)

        cases["GPT-2 (16 blocks of 128, d=6846080)"] = (
            gpt2, ids, lambda f, b: lm_loss(gpt2(f, input_ids=b, use_cache=False).logits, b), gpt2_unit_losses, 1)
    results = {}
    for label, (model, batch, mean_loss, unit_losses, reps) in cases.items():
        buffer = torch.empty(len(batch[0]) if isinstance(batch, tuple) else len(batch), model.d)
        runs = {
            "batched_backward": lambda: model.batch_gradient(lambda f, b: (mean_loss(f, b), None), batch),
            "outer_products": lambda: model.outer_unit_gradients(unit_losses, batch, out=buffer),
            "vmap": lambda: unit_gradients(lambda f, b: (mean_loss(f, b), None), model.flat, batch),
        }
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(3):
            for name, run in runs.items():
                run()  # warm-up / allocation
                start = time.perf_counter()
                for _ in range(reps):
                    run()
                best[name] = min(best[name], (time.perf_counter() - start) / reps)
        results[label] = {**{f"{name}_ms": round(1e3 * value, 3) for name, value in best.items()},
                          "outer_over_batched": round(best["outer_products"] / best["batched_backward"], 3),
                          "vmap_over_batched": round(best["vmap"] / best["batched_backward"], 3)}
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=default_data_dir(), help="data sets (default $CDGRAB_DATA)")
    parser.add_argument("--steps", type=int, default=3000, help="training steps per timed round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median is reported)")
    parser.add_argument("--no-gpt2", action="store_true", help="skip the GPT-2 per-unit gradient case (slowest)")
    parser.add_argument("--json", default=str(REPO / "bench" / "results" / "step-overhead-cpu.json"),
                        help="the report (default bench/results/step-overhead-cpu.json)")
    args = parser.parse_args()
    report = {"bench": "bench/step_overhead.py", "git_commit": runlog.git_commit(), "date": time.strftime("%Y-%m-%d"),
              "command": "python bench/step_overhead.py " + " ".join(sys.argv[1:]),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    with tempfile.TemporaryDirectory() as tmp:
        report["step"] = bench_steps(args.data_dir, args.steps, args.rounds, tmp)
    report["sorter_step"] = bench_sorter_steps()
    report["sign_loop"] = bench_sign_loop()
    report["unit_grads"] = bench_unit_grads(args.data_dir, not args.no_gpt2)
    text = json.dumps(report, indent=1)
    Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
