"""--compile: the training step's gradient computation through torch.compile (issue #62, goal 3).

A task names the methods that make its data-parallel step's gradients (Task.compiled_methods: pure
tensor functions of their arguments and the model's parameters, such as LR-HMDA's closed-form
gradients, MLP-M4's loss, whose backward AOTAutograd then compiles too, and its per-window gradients),
and compile_step replaces each by its torch.compile'd version on the task instance. CD-GraB's Gram sign
step (`--sign-loop gram`, the path a GPU takes) is compiled too (`CDGraB.compile_sign_step`, which
engine/run_setup.py calls). What the engine does around them (the exchange, the rest of the sorter, the
optimizer) stays eager.

Why: on a GPU every operator of a step is a kernel launch, and at the paper's small models the
launches, not the arithmetic, set a step's time (bench/dispatch_count.py counts them on the CPU: its
"compiled" runs). Inductor fuses a step's pointwise operators into a few kernels; "aot_eager" traces
the same graphs but runs them operator by operator (no code generation: no C compiler needed, the
eager step's arithmetic exactly), which is how the tests check the traced step on a plain CPU.
"""
import torch

from common.errors import UserFacingError

# --compile's values: off (eager), inductor (torch.compile's default backend: fused kernels; needs a C
# compiler on the CPU), aot_eager (the traced graphs run by eager operators: a check of the tracing)
COMPILE_CHOICES = ("off", "inductor", "aot_eager")
# the benchmarks whose Task has compiled_methods (checked before any data loads; tests/test_compiled_step.py
# checks it against the tasks)
COMPILED_BENCHMARKS = ("LR-HMDA", "MLP-M4")


def check_compile_args(args, benchmark: str) -> None:
    """One-line errors for --compile: it compiles the data-parallel step's gradients of the exact per-unit
    (or batch) path, so the paths it does not reach are refused rather than silently left eager."""
    if getattr(args, "compile", "off") == "off":
        return
    if benchmark not in COMPILED_BENCHMARKS:
        raise UserFacingError(f"--compile: {benchmark} has no compiled step ({' and '.join(COMPILED_BENCHMARKS)} "
                              "have one); drop --compile")
    clashes = [("--sync " + args.sync, args.sync != "every-step"),
               ("--reducer " + args.reducer, args.reducer != "dense"), ("--sketch-dim", args.sketch_dim > 0),
               ("--unit-grads vmap", args.unit_grads == "vmap"),
               ("--exact-low-memory on", getattr(args, "exact_low_memory", "off") != "off")]
    for flag, clash in clashes:
        if clash:
            raise UserFacingError(f"--compile {args.compile} compiles the data-parallel step's gradients; it does not "
                                  f"go with {flag}: drop one of them")


def compile_step(task, backend: str) -> None:
    """Replace each of task.compiled_methods on the task instance by torch.compile of it (backend: one of
    COMPILE_CHOICES; "off" leaves the task as it is). A task without compiled methods is refused in one line."""
    if backend == "off":
        return
    if not task.compiled_methods:
        raise UserFacingError(f"--compile: {task.name} has no compiled step ({' and '.join(COMPILED_BENCHMARKS)} "
                              "have one); drop --compile")
    for name in task.compiled_methods:
        # dynamic=False: a step's shapes are the same every step, so one graph per shape and no symbolic sizes
        setattr(task, name, torch.compile(getattr(task, name), backend=backend, dynamic=False))
