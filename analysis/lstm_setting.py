"""Which setting the LSTM-Wiki2 grid runs in (issue #44, goal 7), decided from the shipped runs.

Epoch 1 uses the same seeded order for every sorter, so two runs of one seed that differ only in their
sorter must agree at epoch 1; where they do not, the benchmark measures float rounding (amplified by
lr 5 with momentum 0.9), not order. The rule: the grid's setting is the one in which seed 0's D-RR and
CD-GraB runs agree at epoch 1 to within TOLERANCE in train loss; if both settings do, or neither, it is
`--clip 0.25`, the original code's setting at the paper's time (its 2023 release clipped the averaged
gradient to norm 0.25; its HEAD does not). A setting without both runs at epoch 1 does not agree (yet);
the decision is provisional when those runs could still change it.

    python -m analysis.lstm_setting [RESULTS_DIR]      # default: the shipped reproduction/
"""
import json
import sys
from pathlib import Path
from typing import NamedTuple

from analysis.paper_values import PAPER_SETTINGS, has_paper_settings
from engine.flags import with_added_defaults

TOLERANCE = 0.01  # train loss at epoch 1
PAPER_CLIP = PAPER_SETTINGS["LSTM-Wiki2"]["clip"]  # runs in the paper's settings but for --clip compete
SEED = 0
PAIR = ("D-RR", "CD-GraB")
# --clip value (config.json's args.clip) -> how the setting is named
SETTINGS = {None: "no clipping (the original's HEAD)", 0.25: "`--clip 0.25` (the original's 2023 release)"}
DEFAULT = 0.25


class Decision(NamedTuple):
    clip: float | None     # the chosen --clip (None: no clipping)
    reason: str
    provisional: bool      # the runs a setting lacks at epoch 1 could still change the choice
    losses: dict           # clip -> {sorter: epoch-1 train loss}


def epoch1_losses(results_dir) -> dict:
    """clip -> {sorter: epoch-1 train loss} of seed 0's D-RR and CD-GraB runs of LSTM-Wiki2 in the
    paper's settings but for --clip (results_dir/LSTM-Wiki2/<run>/: config.json, metrics.csv)."""
    found = {clip: {} for clip in SETTINGS}
    for config_path in sorted(Path(results_dir).glob("LSTM-Wiki2/*/config.json")):
        try:
            args = with_added_defaults(json.loads(config_path.read_text())["args"], "LSTM-Wiki2")
            rows = (config_path.parent / "metrics.csv").read_text().splitlines()
        except (OSError, ValueError, KeyError):
            continue
        clip = args.get("clip")
        if args.get("sorter") not in PAIR or args.get("seed") != SEED or clip not in SETTINGS \
                or not has_paper_settings("LSTM-Wiki2", {**args, "clip": PAPER_CLIP}) or len(rows) < 2:
            continue
        header, first = rows[0].split(","), rows[1].split(",")
        if first[header.index("epoch")] == "1":
            found[clip][args["sorter"]] = float(first[header.index("train_loss")])
    return found


def pick(agree: set):
    """The rule: the one setting (--clip value) whose two runs agree, else DEFAULT."""
    agreeing = [clip for clip in SETTINGS if clip in agree]
    return agreeing[0] if len(agreeing) == 1 else DEFAULT


def decide(results_dir) -> Decision:
    losses = epoch1_losses(results_dir)
    measured = {clip: abs(l[PAIR[0]] - l[PAIR[1]]) for clip, l in losses.items() if set(PAIR) <= set(l)}
    agree = {clip for clip, gap in measured.items() if gap <= TOLERANCE}
    missing = [clip for clip in SETTINGS if clip not in measured]
    clip = pick(agree)
    if len(agree) == 1:
        why = f"only there do the two runs agree at epoch 1 (within {TOLERANCE})"
    else:
        why = (f"{'both settings agree' if agree else 'neither setting agrees'} at epoch 1 (within {TOLERANCE}), "
               "so the original's setting at the paper's time")
    # what the missing settings could still show: every subset of them agreeing
    outcomes = {pick(agree | {c for i, c in enumerate(missing) if mask >> i & 1}) for mask in range(2 ** len(missing))}
    provisional = len(outcomes) > 1
    if missing:
        names = ", ".join(SETTINGS[c] for c in missing)
        why += (f"; provisional: {names} not run to epoch 1 yet" if provisional else
                f"; {names} not run to epoch 1 yet, which changes the reason but not the choice")
    return Decision(clip, why, provisional, losses)


def markdown(decision: Decision) -> list[str]:
    """The decision as a table and the sentence under it (scripts/reproduction_tables.py prints them)."""
    lines = [f"| LSTM-Wiki2, epoch 1, seed {SEED} | D-RR train loss | CD-GraB train loss | difference | "
             f"within {TOLERANCE} |", "|---|---|---|---|---|"]
    for clip, name in SETTINGS.items():
        l = decision.losses[clip]
        cells = [f"{l[s]:.5f}" if s in l else "not run yet" for s in PAIR]
        gap = abs(l[PAIR[0]] - l[PAIR[1]]) if set(PAIR) <= set(l) else None
        cells += ["-", "-"] if gap is None else [f"{gap:.5f}", "yes" if gap <= TOLERANCE else "no"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    chosen = "`--clip 0.25`" if decision.clip == 0.25 else "no clipping"
    lines.append(f"The grid's setting: {chosen}: {decision.reason}.")
    return lines


if __name__ == "__main__":
    from analysis.load import SHIPPED_RESULTS
    print("\n".join(markdown(decide(sys.argv[1] if len(sys.argv) > 1 else SHIPPED_RESULTS))))
