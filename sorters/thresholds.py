"""Which layer weights a structured sketch makes TensorSketch blocks: the fewest entries of such a weight.

A Linear / Conv1D / Embedding weight with at least this many entries is sketched as a block (its
per-example gradients are never formed); a smaller one is formed per example (B x its size floats) and
CountSketched. The choice trades memory against the variance of the sketch's inner products, and the two
users of structured sketches weigh them differently, so the table has one row per use:

| use      | value | why (docs/sketching.md measures both)                                             |
|----------|-------|-----------------------------------------------------------------------------------|
| library  | 2**16 | LayerSketch, PerExampleGrads(structured=True), the framework glue: memory first;  |
|          |       | GPT-2 small in the Trainer, D = 1024: 2**16 costs 1.08x the plain step's memory,  |
|          |       | 2**20 1.20x (its 13 smaller weights formed per example)                           |
| engine   | 2**20 | the entry scripts' --sketch-min-numel: variance first; a TensorSketch block's     |
|          |       | inner products vary more than the plain CountSketch's, and the engine's records   |
|          |       | path costs the same time and memory at 2**20 as at 2**14 (GPT-2: wte alone)       |

Both count entries of one weight and must be >= 1 (a weight has at least one entry): check_min_numel is
that one check, for every door the setting comes in by (LayerSketch, PerExampleGrads, CDGraBSettings, the
engine's --sketch-min-numel).
"""
from sorters.checks import check_int

STRUCTURED_MIN_NUMEL_BY_USE = {"library": 2**16, "engine": 2**20}
STRUCTURED_MIN_NUMEL = STRUCTURED_MIN_NUMEL_BY_USE["library"]
ENGINE_STRUCTURED_MIN_NUMEL = STRUCTURED_MIN_NUMEL_BY_USE["engine"]
MIN_NUMEL_FLOOR = 1  # a threshold of 1 already makes every 2-D weight a block: lower ones mean nothing else


def check_min_numel(owner: str, value: object, name: str = "min_numel") -> int:
    """value as an int >= MIN_NUMEL_FLOOR, else one line (TypeError: not an integer; ValueError: too small)."""
    return check_int(owner, name, value, MIN_NUMEL_FLOOR)
