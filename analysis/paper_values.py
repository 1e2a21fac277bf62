"""The paper's reported values (read off its figures), in one place: the figures draw them
(analysis/plots.py) and the paper-vs-ours tables print them (scripts/reproduction_tables.py)."""

# benchmark -> (the epochs the paper's value is the mean of, {metric: {sorter: value}}); LR-HMDA's are the
# mean of epochs 49 and 50
PAPER_VALUES = {
    "LR-HMDA": ((49, 50), {"train_loss": {"CD-GraB": 0.33546, "D-RR": 0.33724},
                           "test_acc": {"CD-GraB": 0.82371, "D-RR": 0.82279}}),
    "LSTM-Wiki2": ((50,), {"train_loss": {"CD-GraB": 5.311, "D-RR": 5.361},
                           "test_ppl": {"CD-GraB": 223.6, "D-RR": 231.9}}),
    "MLP-M4": ((30,), {"train_loss": {"CD-GraB": 0.0905, "D-RR": 0.0920},
                       "test_smape": {"CD-GraB": 8.51, "D-RR": 8.86}}),
    "GPT2-Wiki103": ((30,), {"train_loss": {"CD-GraB": 4.098, "D-RR": 4.105}}),
}
# the herding simulation (scripts/herding_simulation.py): bound at the last round per method, for n = 5, 10, 20, 50,
# 100 workers
PAPER_HERDING = {"CD-GraB": "2.3-2.7 for every n", "I-B": "4.2, 5.8, 8.5, 12.5, 17.7", "I-PB": "6, 8.5, 12, 18, 24"}


def paper_epoch(benchmark: str) -> float:
    """Where a figure draws the paper's values of `benchmark`: the mean of the epochs they average."""
    epochs = PAPER_VALUES[benchmark][0]
    return sum(epochs) / len(epochs)
