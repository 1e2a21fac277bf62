"""Seconds per training epoch of every benchmark alone on one GPU: a textbook PyTorch loop, our engine
with D-RR, and our engine with CD-GraB.

    python bench/gpu_epochs.py [--data-dir DIR] [--benchmarks NAME ...] [--steps N | NAME=N ...] [--json PATH]

Each benchmark runs in a process of its own (`--one NAME`), one after the other, so the GPU runs one
benchmark at a time and peak memory is per benchmark. Settings are the paper's: LR-HMDA its defaults
(4 workers, B 16), MLP-M4 the figure's 4 workers and B 16, LSTM-Wiki2 --carry-hidden, GPT2-Wiki103
with WikiText-2 train as the stand-in for WikiText-103 train. Three runs per benchmark, each from the
same initial parameters:

- textbook: a copy of the benchmark's nn.Module, torch.optim with the benchmark's optimizer and
  hyper-parameters (SGD with momentum 0.9 for LR, MLP and LSTM, AdamW for GPT-2; gradient clipping only
  where the settings clip, which the paper's do not), no ordering: step t takes the batch the engine
  would take at step t in the identity order, sliced from the task's tensors. Like the engine it reads
  the loss on the host every engine.progress.LOSS_CHECK_EVERY steps, so the two differ by the engine's work,
  not by a read of the loss. The LSTM runs on cuDNN in both (TF32 off, as the suite sets it).
- D-RR and CD-GraB: `engine.train.train` in the same process, on the benchmark's Task.

Every run trains on the benchmark's Task cut with --max-train-examples to `steps` steps per epoch: one
epoch (for the textbook loop: one pass over the same batches) of warm-up, then one timed, then on CUDA
a third, untimed one with torch.cuda.set_sync_debug_mode("warn") that counts host synchronisations
(a counted synchronisation costs a Python warning, which is kept out of the timing). The engine's time
is the training seconds it logs for its second epoch (epoch_seconds: evaluation excluded; on CUDA it
ends after a device synchronisation); the textbook loop's is its second pass between two
torch.cuda.synchronize(). seconds_per_epoch = seconds per timed step x the benchmark's real steps per
epoch (its whole training set with these settings), so work done once per epoch (CD-GraB's and D-RR's
sort) is counted steps_per_epoch / steps times over. Peak GPU memory is
torch.cuda.max_memory_allocated while training (evaluation excluded), the task's data included.

Writes one JSON object to bench/results/gpu-epochs.json (--json) and prints it: device, torch, cuda,
git_commit, git_clean (false when `git status --porcelain` lists anything but the report's own file),
code_tree (engine.runlog.code_tree: the commit, found from it, where the machine's .git is older),
command, steps_note, goals (the issue's upper bounds of the ratios), wall_seconds, and per benchmark
seconds_per_epoch, ratios, meets_goals, host_syncs_per_step, peak_gpu_memory_gib, steps_timed,
steps_warmup, steps_per_epoch, seconds_per_step, split_seconds_per_epoch (the engine's sorter / comm /
compute regions), textbook (its optimizer and losses: the first step's, the mean of the warm-up and of
the timed pass) and engine_train_loss_after_epoch. `--device cpu` runs the same on the CPU, a smoke
test: GPU memory and synchronisation counts are then null.
"""
import argparse
import copy
import gc
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere

from bench.step_overhead import entry_module  # noqa: E402
from common.paths import default_data_dir  # noqa: E402
from common.errors import OneLineErrorParser  # noqa: E402
from engine.cli import check_args  # noqa: E402
from engine import runlog  # noqa: E402
from engine.comm import LocalCommunicator  # noqa: E402
from engine.compiled import COMPILE_CHOICES, COMPILED_BENCHMARKS  # noqa: E402
from engine.device import set_tf32, setup_device  # noqa: E402
from common.errors import UserFacingError  # noqa: E402
from engine.progress import LOSS_CHECK_EVERY  # noqa: E402
from engine.train import train  # noqa: E402

# benchmark -> its entry script's flags for the paper's settings ({data}: --data-dir)
SETTINGS = {
    "LR-HMDA": [],
    "MLP-M4": ["--node_cnt", "4", "--B", "16"],
    "LSTM-Wiki2": ["--carry-hidden"],
    "GPT2-Wiki103": ["--train-file", "{data}/wikitext-2/train.txt"],
}
# timed steps per run; with warm-up and counting every run trains 3x as many. Multiples of
# LOSS_CHECK_EVERY, so the loss is read as often as in a real epoch
DEFAULT_STEPS = {"LR-HMDA": 400, "MLP-M4": 400, "LSTM-Wiki2": 200, "GPT2-Wiki103": 50}
GOALS = {"D-RR/textbook": 1.1, "CD-GraB/D-RR": 1.15}  # the issue's: at most these ratios of seconds per epoch
RUNS = ("textbook", "D-RR", "CD-GraB")
TIMED_EPOCH = 2  # the engine's epoch 1 is the warm-up
EVAL_UNITS = 256  # --max-eval-examples: the evaluation between epochs is not measured, so keep it short
DEFAULT_JSON = REPO / "bench" / "results" / "gpu-epochs.json"
SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's warning for each host synchronisation


# ------------------------------------------------------------------ building a benchmark's Task
def entry_point(benchmark: str):
    """(parser, build) of main-<benchmark>.py: its command line and its Task class, as its main()
    hands them to run_entry_point."""
    module = entry_module(benchmark)
    captured = {}
    module.run_entry_point = lambda name, parser, build: captured.update(parser=parser, build=build)
    module.main()
    return captured["parser"], captured["build"]


def benchmark_args(benchmark: str, parser, data_dir: str, extra: list[str]):
    """The entry script's args for the paper's settings plus `extra` flags."""
    flags = [flag.format(data=data_dir) for flag in SETTINGS[benchmark]]
    args = parser.parse_args([*flags, "--data-dir", data_dir, "--max-eval-examples", str(EVAL_UNITS), *extra])
    check_args(args, benchmark)
    return args


def real_steps_per_epoch(benchmark: str, data_dir: str) -> int:
    """Steps in one epoch of the benchmark's whole training set with the paper's settings (builds its
    Task on the CPU, which also fails early, in one line, when its data is missing)."""
    parser, build = entry_point(benchmark)
    args = benchmark_args(benchmark, parser, data_dir, [])
    task = build(args, torch.device("cpu"))
    return task.n_units // task.units_per_step


def build_task(benchmark: str, steps: int, data_dir: str, device: torch.device, extra: list[str]):
    """(args, Task) of the benchmark cut to `steps` steps per epoch, built as run_entry_point builds it."""
    parser, build = entry_point(benchmark)
    args = benchmark_args(benchmark, parser, data_dir, ["--device", device.type, *extra])
    # --max-train-examples counts bptt chunks of all B columns for the LSTM (one per step), else
    # examples (windows, blocks): B per step
    args.max_train_examples = steps if benchmark == "LSTM-Wiki2" else steps * args.B
    set_tf32(args.tf32)  # off, as run_entry_point sets it: the textbook loop and the engine alike
    torch.manual_seed(args.seed)  # the model's initialisation, as in run_entry_point
    task = build(args, device)
    if task.n_units // task.units_per_step != steps:
        raise UserFacingError(f"{benchmark}: --steps {steps} gives {task.n_units // task.units_per_step} steps per "
                              "epoch; use an even number of steps")
    return args, task


# ------------------------------------------------------------------ what a run records on CUDA
class SyncCounter:
    """Counts the host synchronisations torch reports on CUDA between start() and stop()
    (torch.cuda.set_sync_debug_mode("warn") turns each into a warning)."""

    def start(self) -> None:
        self._catching = warnings.catch_warnings(record=True)
        self._records = self._catching.__enter__()
        warnings.simplefilter("always")  # every synchronisation, not only the first from each line
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> int:
        torch.cuda.set_sync_debug_mode("default")
        self._catching.__exit__(None, None, None)
        syncs = [record for record in self._records if SYNC_WARNING in str(record.message)]
        for record in self._records:  # the other warnings are shown as usual
            if SYNC_WARNING not in str(record.message):
                warnings.warn_explicit(record.message, record.category, record.filename, record.lineno)
        return len(syncs)


class EpochProbe:
    """Watches the engine's epochs through the two Task hooks it calls around each epoch's training:
    start_epoch (first thing in an epoch) and evaluate (right after the epoch's last step).

    On CUDA: `peaks` holds each epoch's peak allocated bytes while training, and `syncs` the host
    synchronisations of epoch `count_epoch` (None: not counted)."""

    def __init__(self, task, device: torch.device, count_epoch: int | None):
        self.cuda, self.count_epoch = device.type == "cuda", count_epoch
        self.epoch, self.peaks, self.syncs, self.counter = None, [], None, SyncCounter()
        start_epoch, evaluate = task.start_epoch, task.evaluate

        def start(epoch):
            self.epoch = epoch
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
            if epoch == self.count_epoch:
                self.counter.start()
            start_epoch(epoch)

        def evaluate_after_training(flat, comm):
            if self.epoch == self.count_epoch:
                self.syncs = self.counter.stop()
            if self.cuda:
                self.peaks.append(torch.cuda.max_memory_allocated())
            return evaluate(flat, comm)

        task.start_epoch, task.evaluate = start, evaluate_after_training


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------ the textbook loop
def step_slice(tensor: torch.Tensor, step: int, k: int) -> torch.Tensor:
    """(n, m, ...) per-worker units -> (n * k, ...): units step*k .. step*k + k - 1 of every worker,
    worker-major (the engine's batch at `step` in the identity order)."""
    return tensor[:, step * k:(step + 1) * k].flatten(0, 1)


def logistic_loss(task, model):
    def step_loss(step):
        x, y = step_slice(task.worker_x, step, task.units_per_step), step_slice(task.worker_y, step, task.units_per_step)
        return F.binary_cross_entropy_with_logits(model(x).squeeze(-1), y)  # x (B, F), y (B,)
    return step_loss


def forecast_loss(task, model):
    def step_loss(step):
        x, y = step_slice(task.worker_x, step, task.units_per_step), step_slice(task.worker_y, step, task.units_per_step)
        return F.mse_loss(model(x, y.shape[-1]), y)  # x (B, in_len), y (B, 6): a rollout of 6
    return step_loss


def lstm_loss(task, model):
    """Step t reads bptt chunk t of the (rows, B) training matrix, all B columns at once (the workers'
    column blocks side by side), the hidden state carried from step to step with --carry-hidden."""
    matrix, bptt, state = task.train_matrix, task.bptt, {}

    def step_loss(step):
        if step == 0 or not task.carry_hidden:
            state["hidden"] = model.init_hidden(matrix.shape[1])  # (h, c) each (layers, B, hidden)
        rows = matrix[step * bptt:(step + 1) * bptt + 1]  # (bptt + 1, B): inputs and next-token targets
        log_probs, hidden = model(rows[:-1], state["hidden"])  # (bptt * B, V)
        state["hidden"] = tuple(h.detach() for h in hidden)
        return F.nll_loss(log_probs, rows[1:].reshape(-1))
    return step_loss


def language_model_loss(task, model):
    from models.gpt2 import lm_loss

    def step_loss(step):
        ids = step_slice(task.worker_blocks, step, task.units_per_step)  # (B, T) token ids
        return lm_loss(model(input_ids=ids, use_cache=False).logits, ids)
    return step_loss


TEXTBOOK_LOSS = {"LR-HMDA": logistic_loss, "MLP-M4": forecast_loss, "LSTM-Wiki2": lstm_loss,
                 "GPT2-Wiki103": language_model_loss}


def textbook_optimizer(kind: str, model: torch.nn.Module, args) -> torch.optim.Optimizer:
    """torch.optim's version of the engine's optimizer (engine/optim.py implements the same rules)."""
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)


def textbook_pass(model, optimizer, step_loss, steps: int, clip: float | None) -> list[torch.Tensor]:
    """`steps` training steps; returns each step's loss (0-d, still on the device: read at the end)."""
    device = next(model.parameters()).device
    losses, loss_sum = [], torch.zeros((), dtype=torch.float64, device=device)
    for step in range(steps):
        loss = step_loss(step)
        optimizer.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(loss.detach())
        loss_sum += loss.detach()
        if (step + 1) % LOSS_CHECK_EVERY == 0 or step + 1 == steps:  # the engine's cadence of host reads
            if not math.isfinite(loss_sum.item()):
                raise UserFacingError("the textbook loop's training loss is not finite")
            loss_sum.zero_()
    return losses


def textbook_model(task) -> torch.nn.Module:
    """A copy of the task's module: the same initial parameters, in tensors of its own. The task's flat
    copy of the parameters is dropped, so that it takes no part in the textbook run, nor in its memory."""
    model = copy.deepcopy(task.model.module)
    for module in model.modules():
        if isinstance(module, torch.nn.RNNBase):
            module.flatten_parameters()  # cuDNN wants the weights in one block (the copy made one tensor each)
    task.model = None
    gc.collect()
    return model


def textbook_passes(one_pass, device: torch.device) -> dict:
    """one_pass() trains over the same steps each time and returns their losses: a warm-up pass, the
    timed pass, and on CUDA a third that counts host synchronisations."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    warmup = one_pass()
    synchronize(device)
    start = time.perf_counter()
    timed = one_pass()
    synchronize(device)
    seconds = time.perf_counter() - start
    peak, syncs = None, None
    if device.type == "cuda":
        peak, counter = torch.cuda.max_memory_allocated(), SyncCounter()
        counter.start()
        one_pass()
        syncs = counter.stop()
    return {"seconds": seconds, "peak_bytes": peak, "host_syncs": syncs,
            "warmup_losses": torch.stack(warmup).tolist(), "timed_losses": torch.stack(timed).tolist()}


def textbook_run(benchmark: str, steps: int, data_dir: str, device: torch.device) -> dict:
    args, task = build_task(benchmark, steps, data_dir, device, [])
    model = textbook_model(task)
    optimizer = textbook_optimizer(task.optimizer, model, args)
    step_loss, clip = TEXTBOOK_LOSS[benchmark](task, model), task.clip_grad_norm
    measured = textbook_passes(lambda: textbook_pass(model, optimizer, step_loss, steps, clip), device)
    warmup, timed = measured["warmup_losses"], measured["timed_losses"]
    settings = {key: optimizer.defaults[key] for key in ("lr", "momentum", "betas", "eps", "weight_decay")
                if key in optimizer.defaults}
    return {"seconds_per_step": measured["seconds"] / steps, "host_syncs": measured["host_syncs"],
            "peak_bytes": measured["peak_bytes"], "optimizer": type(optimizer).__name__,
            "optimizer_settings": settings, "clip_grad_norm": clip, "loss_first_step": warmup[0],
            "loss_warmup_pass_mean": sum(warmup) / steps, "loss_timed_pass_mean": sum(timed) / steps}


# ------------------------------------------------------------------ the engine
def engine_run(benchmark: str, sorter: str, steps: int, data_dir: str, device: torch.device,
               compile_backend: str = "off") -> dict:
    count = device.type == "cuda"
    epochs = TIMED_EPOCH + 1 if count else TIMED_EPOCH
    # --compile: the benchmarks with a compiled step only (engine/compiled.py); epoch 1, the warm-up, compiles
    compiled = ["--compile", compile_backend] if benchmark in COMPILED_BENCHMARKS else []
    with tempfile.TemporaryDirectory() as out:
        args, task = build_task(benchmark, steps, data_dir, device, ["--sorter", sorter, "--epochs", str(epochs),
                                                                    "--out", out, "--progress", "off", *compiled])
        probe = EpochProbe(task, device, count_epoch=TIMED_EPOCH + 1 if count else None)
        rows = train(task, args, LocalCommunicator(args.node_cnt, device), device)
    timed = rows[TIMED_EPOCH - 1]
    return {"seconds_per_step": timed["epoch_seconds"] / steps, "host_syncs": probe.syncs,
            "peak_bytes": max(probe.peaks) if probe.peaks else None,
            "split_seconds_per_step": {region: timed[f"{region}_seconds"] / steps
                                       for region in ("sorter", "comm", "compute")},
            "train_loss_after_epoch": [row["train_loss"] for row in rows]}


def measure_one(benchmark: str, steps: int, data_dir: str, device_choice: str, compile_backend: str = "off") -> dict:
    """The three runs of one benchmark, in this process, one after the other."""
    device, _ = setup_device(device_choice, None)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
              "steps_timed": steps, "runs": {}}
    result["runs"]["textbook"] = textbook_run(benchmark, steps, data_dir, device)
    for sorter in RUNS[1:]:
        gc.collect()  # the previous run's tensors are gone before this one's peak memory is taken
        result["runs"][sorter] = engine_run(benchmark, sorter, steps, data_dir, device, compile_backend)
    return result


# ------------------------------------------------------------------ the report
def significant(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else float(f"{value:.{digits}g}")


def benchmark_entry(measured: dict, steps_per_epoch: int) -> dict:
    """The report of one benchmark from its process's measurements."""
    runs, steps = measured["runs"], measured["steps_timed"]
    per_step = {name: significant(run["seconds_per_step"]) for name, run in runs.items()}
    per_epoch = {name: significant(seconds * steps_per_epoch) for name, seconds in per_step.items()}
    ratios = {"D-RR/textbook": round(per_epoch["D-RR"] / per_epoch["textbook"], 3),
              "CD-GraB/D-RR": round(per_epoch["CD-GraB"] / per_epoch["D-RR"], 3)}
    textbook = runs["textbook"]
    return {
        "seconds_per_epoch": per_epoch,
        "ratios": ratios,
        "meets_goals": {key: ratio <= GOALS[key] for key, ratio in ratios.items()},
        "host_syncs_per_step": {name: None if run["host_syncs"] is None else round(run["host_syncs"] / steps, 4)
                                for name, run in runs.items()},
        "peak_gpu_memory_gib": {name: None if run["peak_bytes"] is None else round(run["peak_bytes"] / 2**30, 3)
                                for name, run in runs.items()},
        "steps_timed": steps,
        "steps_warmup": steps,
        "steps_per_epoch": steps_per_epoch,
        "seconds_per_step": per_step,
        "split_seconds_per_epoch": {sorter: {region: significant(seconds * steps_per_epoch, 4) for region, seconds
                                             in runs[sorter]["split_seconds_per_step"].items()}
                                    for sorter in RUNS[1:]},
        "textbook": {key: textbook[key] for key in ("optimizer", "optimizer_settings", "clip_grad_norm",
                                                    "loss_first_step", "loss_warmup_pass_mean",
                                                    "loss_timed_pass_mean")},
        "engine_train_loss_after_epoch": {sorter: runs[sorter]["train_loss_after_epoch"] for sorter in RUNS[1:]},
    }


def steps_note(device: str) -> str:
    timing = ("torch.cuda.synchronize() before reading the clock, never inside the timed steps" if device == "cuda"
              else "the host clock")
    return (f"seconds_per_epoch = seconds_per_step x steps_per_epoch: each run trains steps_timed steps after "
            f"steps_warmup warm-up steps (the engine: epoch {TIMED_EPOCH} of a Task cut to steps_timed steps per "
            f"epoch, epoch 1 the warm-up; the textbook loop: a second pass over the same batches), timed with "
            f"{timing}; steps_per_epoch is the benchmark's real number of steps in one epoch of its whole "
            "training set, so once-per-epoch work is counted steps_per_epoch / steps_timed times over. "
            "host_syncs_per_step: synchronisations counted in a third, untimed epoch (pass) with "
            "torch.cuda.set_sync_debug_mode('warn'), per step; the engine reads the loss every "
            f"{LOSS_CHECK_EVERY} steps and so does the textbook loop")


def check_inputs(args, steps: dict) -> dict:
    """One-line errors, before any run starts, for what would fail later: no GPU, missing data, more
    steps than an epoch has. Returns benchmark -> its real steps per epoch."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserFacingError("--device cuda: no CUDA device is visible; run this on a GPU machine "
                              "(or pass --device cpu for a smoke test)")
    if not Path(args.data_dir).is_dir():
        raise UserFacingError(f"--data-dir {args.data_dir} is not a folder; point it (or $CDGRAB_DATA) at the data sets")
    real_steps = {}
    for benchmark in args.benchmarks:
        try:
            real_steps[benchmark] = real_steps_per_epoch(benchmark, args.data_dir)
        except UserFacingError as error:
            raise UserFacingError(f"{benchmark}: {error}") from None
        if steps[benchmark] > real_steps[benchmark]:
            raise UserFacingError(f"--steps {steps[benchmark]} for {benchmark} is more than the "
                                  f"{real_steps[benchmark]} steps of its epoch")
    return real_steps


def measure_in_own_process(benchmark: str, steps: int, args, folder: str) -> dict | None:
    """`--one benchmark` in a new process; its measurements, or None when it failed (its messages are
    on stderr)."""
    measured = Path(folder) / f"{benchmark}.json"
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one", benchmark, "--steps", str(steps),
                           "--device", args.device, "--data-dir", args.data_dir, "--json", str(measured),
                           "--compile", args.compile],
                          stdout=sys.stderr)  # this process's stdout carries the report alone
    return None if done.returncode else json.loads(measured.read_text())


def run_all(args, steps: dict) -> int:
    """Measure every benchmark, one after the other, each in a process of its own; write and print the
    report. Returns the exit status: 1 when a benchmark's process failed, else 0."""
    began = time.perf_counter()
    real_steps = check_inputs(args, steps)
    json_path = Path(args.json)
    commit, clean = runlog.git_state(json_path)  # ("unknown commit", None) without a git checkout
    report = {"device": None, "torch": torch.__version__, "cuda": torch.version.cuda, "git_commit": commit,
              "git_clean": clean, "code_tree": runlog.code_tree(),  # finds the commit where .git is older
              "command": " ".join(["python", *sys.argv]), "steps_note": steps_note(args.device),
              "compile": {"backend": args.compile, "benchmarks": [name for name in args.benchmarks
                                                                  if name in COMPILED_BENCHMARKS]},
              "goals": GOALS, "benchmarks": {}}
    with tempfile.TemporaryDirectory() as folder:
        for benchmark in args.benchmarks:
            print(f"gpu_epochs: {benchmark}, {steps[benchmark]} timed steps per run", file=sys.stderr, flush=True)
            measured = measure_in_own_process(benchmark, steps[benchmark], args, folder)
            if measured is None:
                report["benchmarks"][benchmark] = {"error": "its process failed; see its messages on stderr"}
                continue
            report["device"] = report["device"] or measured["device"]
            report["benchmarks"][benchmark] = {
                "settings": [flag.format(data=args.data_dir) for flag in SETTINGS[benchmark]],
                **benchmark_entry(measured, real_steps[benchmark])}
    report["wall_seconds"] = round(time.perf_counter() - began, 1)
    text = json.dumps(report, indent=1)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(text + "\n")
    print(text)
    return 1 if any("error" in entry for entry in report["benchmarks"].values()) else 0


# ------------------------------------------------------------------ command line
def parse_steps(values: list[str] | None, benchmarks: list[str]) -> dict:
    """--steps values (N for every benchmark, or NAME=N) -> benchmark -> timed steps."""
    steps = dict(DEFAULT_STEPS)
    for value in values or []:
        name, _, number = value.rpartition("=")
        if name and name not in SETTINGS:
            raise UserFacingError(f"--steps {value}: unknown benchmark {name}; choose from {', '.join(SETTINGS)}")
        try:
            count = int(number)
        except ValueError:
            raise UserFacingError(f"--steps {value}: expected N or NAME=N with N an integer") from None
        for benchmark in [name] if name else list(SETTINGS):
            steps[benchmark] = count
    for benchmark in benchmarks:
        if steps[benchmark] < 2 or steps[benchmark] % 2:
            raise UserFacingError(f"--steps {steps[benchmark]} for {benchmark}: use an even number >= 2 (CD-GraB "
                                  "pairs the steps of an epoch)")
    return steps


def make_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--data-dir", default=default_data_dir(),
                        help="folder holding the data sets (default: $CDGRAB_DATA, else ./datasets)")
    parser.add_argument("--benchmarks", nargs="+", default=list(SETTINGS), choices=list(SETTINGS), metavar="NAME",
                        help=f"which benchmarks, in this order (default: all: {', '.join(SETTINGS)})")
    parser.add_argument("--steps", nargs="+", metavar="N|NAME=N",
                        help="timed steps per run, even; the same number again is the warm-up, and on CUDA "
                             "again for counting synchronisations. N for every benchmark, NAME=N for one "
                             "(default: " + ", ".join(f"{name}={n}" for name, n in DEFAULT_STEPS.items()) +
                             f"); multiples of {LOSS_CHECK_EVERY} read the loss as often as a real epoch")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default), or cpu for a smoke test (no GPU memory or synchronisation counts)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help=f"where the report goes (default: {DEFAULT_JSON.relative_to(REPO)} in the repository); "
                             "with --one, where that benchmark's measurements go")
    parser.add_argument("--compile", choices=COMPILE_CHOICES, default="off",
                        help="the engine's runs with --compile (engine/compiled.py) on the benchmarks that have a "
                             f"compiled step ({', '.join(COMPILED_BENCHMARKS)}), compiled in the warm-up epoch; the "
                             "textbook loop stays eager. Write to another --json to keep the eager report")
    parser.add_argument("--one", choices=list(SETTINGS), metavar="NAME",
                        help="measure only this benchmark, in this process, and write its raw measurements to "
                             "--json (what the command runs for each benchmark)")
    return parser


def main():
    parser = make_parser()
    args = parser.parse_args()
    args.benchmarks = list(dict.fromkeys(args.benchmarks))  # each once
    try:
        steps = parse_steps(args.steps, [args.one] if args.one else args.benchmarks)
        if args.one:
            if args.json is None:
                raise UserFacingError("--one needs --json PATH for its measurements")
            measured = measure_one(args.one, steps[args.one], args.data_dir, args.device, args.compile)
            Path(args.json).write_text(json.dumps(measured))
            return
        args.json = args.json or str(DEFAULT_JSON)
        sys.exit(run_all(args, steps))
    except UserFacingError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
