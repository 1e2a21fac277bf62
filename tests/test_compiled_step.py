"""--compile (engine/compiled.py, issue #62 goal 3): the torch.compile'd step equals the eager one.

In this process, on LR-HMDA's real data (a few steps): with backend aot_eager (the traced graphs run by the
eager operators: no C compiler, a second of tracing) the orders and losses are the eager run's bit for bit;
with inductor (fused kernels, generated C++: about 20 s of compiling) the orders bit for bit and the losses
to float32 rounding, a release check, as is MLP-M4 (its unrolled rollout takes aot_eager 13 s to trace).
"""
import pytest
import torch

from engine.compiled import COMPILED_BENCHMARKS
from tests.helpers import entry_point, entry_task, needs_data, release_check

pytestmark = needs_data("hmda/raw/hmda_train_preprocessed.zip")
SCRIPTS = {"LR-HMDA": "main-LR-HMDA.py", "MLP-M4": "main-MLP-M4.py"}
TINY = {"LR-HMDA": ["--max-train-examples", "320", "--max-eval-examples", "64"],  # 20 steps of B = 16
        "MLP-M4": ["--max-train-examples", "256", "--max-eval-examples", "16"]}


def train_in_process(benchmark: str, sorter: str, compile_backend: str, out) -> tuple[list[dict], list, int]:
    """(metrics rows, the epochs' orders, graphs torch.compile made) of a 2-epoch run in this process; sorter
    "CD-GraB gram": CD-GraB with --sign-loop gram (the GPU's path, whose sign step --compile compiles too)."""
    flags = ["--sorter", "CD-GraB", "--sign-loop", "gram"] if sorter == "CD-GraB gram" else ["--sorter", sorter]
    import torch._dynamo

    from engine.comm import LocalCommunicator
    from engine.train import train

    torch._dynamo.reset()  # each run compiles its own task's methods
    torch._dynamo.utils.counters.clear()
    task, args = entry_task(SCRIPTS[benchmark], torch.device("cpu"), *flags, "--epochs", "2",
                            "--progress", "off", "--record-orders", "--out", out, "--compile", compile_backend,
                            *TINY[benchmark])
    rows = train(task, args, LocalCommunicator(args.node_cnt), torch.device("cpu"))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return rows, torch.load(out / "orders.pt"), graphs


def assert_same_training(eager, compiled, exact: bool) -> None:
    (eager_rows, eager_orders, eager_graphs), (rows, orders, graphs) = eager, compiled
    assert eager_graphs == 0 and graphs >= 1  # the compiled run did run compiled graphs
    assert len(orders) == len(eager_orders) == 2
    assert all(torch.equal(a, b) for a, b in zip(orders, eager_orders))
    for row, eager_row in zip(rows, eager_rows, strict=True):
        for column in ("train_loss", "test_loss"):
            if exact:
                assert row[column] == eager_row[column], (column, row, eager_row)
            else:
                assert row[column] == pytest.approx(eager_row[column], rel=1e-5), (column, row, eager_row)


@pytest.mark.parametrize("sorter", ["D-RR", "CD-GraB", "CD-GraB gram"])
def test_the_traced_step_equals_the_eager_step_bit_for_bit(tmp_path, sorter):
    """aot_eager runs the traced graphs' operators, the eager step's own: orders and losses equal to the bit;
    with the Gram sign loop its sign step is a compiled graph of its own (more graphs than the gradients')."""
    eager = train_in_process("LR-HMDA", sorter, "off", tmp_path / "eager")
    compiled = train_in_process("LR-HMDA", sorter, "aot_eager", tmp_path / "compiled")
    assert_same_training(eager, compiled, exact=True)
    if sorter == "CD-GraB gram":
        gradients_only = train_in_process("LR-HMDA", "CD-GraB", "aot_eager", tmp_path / "gradients")
        assert compiled[2] > gradients_only[2]


@release_check
@needs_data("m4/Weekly-train.csv", "m4/Weekly-test.csv")
@pytest.mark.parametrize("benchmark", ["LR-HMDA", "MLP-M4"])
@pytest.mark.parametrize("sorter", ["D-RR", "CD-GraB", "CD-GraB gram"])
def test_the_inductor_step_equals_the_eager_step(tmp_path, benchmark, sorter):
    """inductor's fused kernels: the orders bit for bit, losses to float32 rounding."""
    eager = train_in_process(benchmark, sorter, "off", tmp_path / "eager")
    assert_same_training(eager, train_in_process(benchmark, sorter, "inductor", tmp_path / "compiled"), exact=False)


def test_the_benchmarks_with_a_compiled_step_are_the_tasks_with_compiled_methods():
    """engine.compiled.COMPILED_BENCHMARKS (checked before any data loads) names exactly the entry scripts
    whose Task has methods to compile, and each of those methods exists."""
    with_methods = []
    for script in ("main-LR-HMDA.py", "main-MLP-M4.py", "main-LSTM-Wiki2.py", "main-GPT2-Wiki103.py"):
        benchmark, _, task_class = entry_point(script)
        if task_class.compiled_methods:
            with_methods.append(benchmark)
            assert all(callable(getattr(task_class, name, None)) for name in task_class.compiled_methods)
    assert tuple(with_methods) == COMPILED_BENCHMARKS
