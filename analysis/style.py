"""How the figures name metrics, colour curves and scale value axes: one place for analysis/plots.py and
analysis/studies.py."""
import math

from matplotlib.colors import to_hex, to_rgb

from analysis.aggregate import STRUCTURED, SYNC_ORDER

LABELS = {
    "train_loss": "train loss", "test_loss": "test loss", "valid_loss": "validation loss",
    "train_acc": "train accuracy", "test_acc": "test accuracy",
    "train_ppl": "train perplexity", "valid_ppl": "validation perplexity", "test_ppl": "test perplexity",
    "test_smape": "test sMAPE", "herding_bound": "herding bound of the epoch's gradients",
}
BENCHMARK_LABELS = {"MLP-M4": {"train_loss": "train MSE (standardised)"}}
SORTER_COLORS = {"CD-GraB": "tab:red", "D-RR": "tab:blue", "I-B": "tab:green", "I-PB": "tab:orange",
                 "D-SO": "tab:purple", "Fold": "tab:brown", "ALL": "tab:gray", "KH-SGD": "tab:pink",
                 "SBW": "tab:olive", "FlipFlop": "tab:cyan", "SWR": "black", "Greedy": "goldenrod",
                 "MB-GraB": "darkred", "RPB": "limegreen"}
# for sorters without a colour of their own: tab20's light tones
SPARE_COLORS = ["#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2",
                "#dbdb8d", "#9edae5"]
# a sorter's second, third, ... setting: its colour darkened (< 0) or lightened (> 0) by this fraction,
# and a line style of its own, so that a reader tells the settings apart in print too
SHADES = [0.0, -0.45, 0.45, -0.7, 0.7]
LINESTYLES = ["-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1))]
WORKER_LINESTYLES = ["-", "--", ":", "-."]  # the scaling figure's herding panel: a line style per worker count
LOG_RATIO = 10.0  # a value axis is logarithmic only when its values span at least this factor
PART_COLORS = {"sorter_seconds": "tab:red", "comm_seconds": "tab:blue", "compute_seconds": "tab:green",
               "other_seconds": "tab:gray"}  # the time breakdown's stacked parts
# the communication study: a marker per synchronisation rule, a fill per reducer (the colour is the sorter's)
STRATEGY_MARKERS = dict(zip(SYNC_ORDER, "os^vD"))  # every-step o, constant s, qsr ^, linear v, post-local D
REDUCER_FILL = {"dense": "full", "topk": "left", "exdyna": "none"}
# the sketching study: exact CD-GraB and D-RR keep their sorters' colours, each sketch dimension D gets one
# of these (the structured map of a D shares its colour, dashed)
SKETCH_SHADES = ["tab:orange", "tab:purple", "tab:green", "tab:brown", "tab:olive"]


def metric_label(metric: str, benchmark: str | None = None) -> str:
    """A metrics.csv column in words, as the benchmark's figures name it."""
    return BENCHMARK_LABELS.get(benchmark, {}).get(metric) or LABELS.get(metric, metric)


def _shade(color, amount: float) -> str:
    rgb = to_rgb(color)
    target = 0.0 if amount < 0 else 1.0
    return to_hex([c + abs(amount) * (target - c) for c in rgb])


def curve_styles(curves) -> dict:
    """{curve: {"color", "linestyle"}} for curves given as (sorter, anything that tells a sorter's
    settings apart), every curve a colour of its own. A sorter's first curve (callers put the one with the
    paper's settings first) gets the sorter's colour (SORTER_COLORS) and a solid line, as in every other
    figure; its further settings get that colour darkened or lightened (SHADES) and their own line styles.
    Sorters without a colour get SPARE_COLORS, never one a known sorter of these curves uses."""
    curves = list(dict.fromkeys(curves))
    taken = {SORTER_COLORS[s] for s, _ in curves if s in SORTER_COLORS}
    spare = iter([c for c in SPARE_COLORS if c not in taken])
    base, count, styles = {}, {}, {}
    for sorter, key in curves:
        if sorter not in base:
            base[sorter] = SORTER_COLORS.get(sorter) or next(spare, "black")
        i = count[sorter] = count.get(sorter, -1) + 1
        color = _shade(base[sorter], SHADES[i % len(SHADES)]) if i else base[sorter]
        if i >= len(SHADES):  # more settings than shades: a spare colour keeps every curve distinct
            color = next(spare, "black")
        styles[(sorter, key)] = {"color": color, "linestyle": LINESTYLES[i % len(LINESTYLES)]}
    return styles


def sorter_styles(sorters) -> dict:
    """{sorter: {"color", "linestyle"}} for figures with one curve (or point set) per sorter."""
    return {sorter: style for (sorter, _), style in curve_styles((sorter, None) for sorter in sorters).items()}


def sketch_colours(variants) -> dict:
    """{variant without the structured suffix: colour} for the sketching figure's variants, given in
    analysis.aggregate.variant_order: exact CD-GraB red, D-RR blue, each D the next of SKETCH_SHADES, so the
    colours follow D whichever panel draws a variant first."""
    colours = {"CD-GraB exact": "tab:red", "D-RR": "tab:blue"}
    for variant in variants:
        base = variant.removesuffix(STRUCTURED)
        if base not in colours:
            used = set(colours.values())
            colours[base] = next((c for c in SKETCH_SHADES if c not in used), "tab:gray")
    return colours


def sketch_style(variant: str, colours: dict) -> dict:
    """A variant's line style in the sketching figure: its colour (sketch_colours), the CountSketch solid
    with round markers, the structured map (TensorSketch blocks) of the same D dashed with square markers."""
    structured = variant.endswith(STRUCTURED)
    return {"color": colours[variant.removesuffix(STRUCTURED)], "linestyle": "--" if structured else "-",
            "marker": "s" if structured else "o"}


def wants_log_scale(values) -> bool:
    """True when the positive finite `values` span at least LOG_RATIO (an order of magnitude: the
    early epochs of a perplexity, a herding bound falling from hundreds to units), where equal ratios are
    the comparison that matters. Values within a factor of LOG_RATIO go on a linear axis, which draws a
    difference at its size; a log axis over a narrow range magnifies small differences instead."""
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not finite or min(finite) <= 0:
        return False
    return max(finite) / min(finite) >= LOG_RATIO


def scale_value_axis(axes, values) -> str:
    """Put the y axis of every Axes in `axes` (panels sharing one scale) on the scale wants_log_scale
    picks for `values`, the values drawn in them; a linear axis gets plain tick labels (no offset or
    common factor beside the axis, which readers miss), so a difference of 1e-4 reads as 1e-4. Returns
    the scale."""
    scale = "log" if wants_log_scale(values) else "linear"
    for ax in axes:
        ax.set_yscale(scale)
        if scale == "linear":
            ax.ticklabel_format(axis="y", style="plain", useOffset=False)
    return scale
