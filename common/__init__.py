"""The ground floor: what every other room of the suite (data/, engine/, analysis/, the entry scripts)
may import, and which imports none of them: the one-line error (errors.py) and where the data sets live
(paths.py). The pip library (sorters/) stands apart and imports nothing of the suite."""
