"""--sketch-dim D: the balancing sorters run on CountSketches of the per-unit gradients.

Each process sketches its own workers' (n_local, k, d) unit gradients to (n_local, k, D) before the
all-gather (engine.comm.GradientExchange), the sorter is built for D-dimensional gradients, and the
update is all-reduced as D-RR's is: n * (d + k * D) floats per step instead of n * k * d. The map is
sorters.GradientSketch(d, D, seed=--seed), the same in every process (docs/sketching.md).
"""
from common.errors import UserFacingError
from sorters import SORTERS, GradientSketch
from sorters.thresholds import ENGINE_STRUCTURED_MIN_NUMEL as STRUCTURED_MIN_NUMEL  # the engine's row: why there
from sorters.thresholds import MIN_NUMEL_FLOOR


def sketch_settings(args) -> tuple[int, int]:
    """(--sketch-dim, --sketch-min-numel) of a run's args, read in this one place: args without them (a
    script or test that builds its own, a checkpoint older than the flags) mean no sketch (0) and the
    engine's threshold."""
    return getattr(args, "sketch_dim", 0), getattr(args, "sketch_min_numel", STRUCTURED_MIN_NUMEL)


def check_sketch_args(args) -> None:
    """One-line errors for --sketch-dim and --sketch-min-numel (before any data is loaded)."""
    dim, min_numel = sketch_settings(args)
    if dim < 0:
        raise UserFacingError(f"--sketch-dim must be >= 0 (0: exact balancing), got {dim}")
    if min_numel < MIN_NUMEL_FLOOR:  # the library's floor of the setting (sorters/thresholds.py), in the flag's words
        raise UserFacingError(f"--sketch-min-numel must be >= {MIN_NUMEL_FLOOR} (the fewest entries of a "
                              f"tensor-sketched weight), got {min_numel}")
    if min_numel != STRUCTURED_MIN_NUMEL and not dim:
        raise UserFacingError("--sketch-min-numel applies to a sketch: add --sketch-dim D, or drop --sketch-min-numel")
    if dim and not SORTERS[args.sorter].uses_grads:
        balancing = ", ".join(name for name, cls in SORTERS.items() if cls.uses_grads)
        raise UserFacingError(f"--sketch-dim applies to the sorters that balance gradients ({balancing}); "
                              f"--sorter {args.sorter} uses none: drop --sketch-dim")


def make_sketch(args, d: int, model=None):
    """The run's GradientSketch, or None when there is none to apply (--sketch-dim 0, or D >= d,
    where the sketch would be the identity: the run is then exact balancing, bit for bit).

    model (an engine.functional.FlatModel, optional): its layer weights of at least --sketch-min-numel
    (default STRUCTURED_MIN_NUMEL) entries (GPT-2: the tied 50,257 x 128 wte/lm_head) become TensorSketch
    blocks of the map (FlatModel.sketch_blocks: the library's sorters.layer_rules.Layout.blocks), so that the
    per-unit sketches come from the layer records without forming those weights' per-unit gradients
    (Task.unit_sketches; blocks of at most engine.functional.formed_block_numel entries are formed there
    all the same, which costs less). Every other coordinate, and every model without such a weight (LR,
    MLP, LSTM), keeps the plain CountSketch. The map depends only on (model structure, D, seed): every
    process and every gradient path apply the same one."""
    dim, min_numel = sketch_settings(args)
    if not dim:
        return None
    blocks = model.sketch_blocks(min_numel) if model is not None and dim < d else []
    sketch = GradientSketch(d, dim, seed=args.seed, blocks=blocks)
    return None if sketch.is_identity else sketch


def sketch_config(args, sketch) -> dict:
    """config.json's record of the sketch actually applied."""
    dim, min_numel = sketch_settings(args)
    if sketch is None:
        return {"sketch_dim": dim, "applied": False}
    return {"sketch_dim": sketch.dim, "applied": True, "family": sketch.family, "seed": sketch.seed,
            "min_numel": min_numel, "blocks": [[block.offset, block.rows, block.cols] for block in sketch.blocks]}
