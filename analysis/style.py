"""How the figures name metrics and colour sorters: one table for analysis/plots.py and analysis/studies.py."""

LABELS = {
    "train_loss": "train loss", "test_loss": "test loss", "valid_loss": "validation loss",
    "train_acc": "train accuracy", "test_acc": "test accuracy",
    "train_ppl": "train perplexity", "valid_ppl": "validation perplexity", "test_ppl": "test perplexity",
    "test_smape": "test sMAPE", "herding_bound": "herding bound of the epoch's gradients",
}
BENCHMARK_LABELS = {"MLP-M4": {"train_loss": "train MSE (standardised)"}}
SORTER_COLORS = {"CD-GraB": "tab:red", "D-RR": "tab:blue", "I-B": "tab:green", "I-PB": "tab:orange",
                 "D-SO": "tab:purple", "Fold": "tab:brown", "ALL": "tab:gray", "KH-SGD": "tab:pink",
                 "SBW": "tab:olive"}


def metric_label(metric: str, benchmark: str | None = None) -> str:
    """A metrics.csv column in words, as the benchmark's figures name it."""
    return BENCHMARK_LABELS.get(benchmark, {}).get(metric) or LABELS.get(metric, metric)
