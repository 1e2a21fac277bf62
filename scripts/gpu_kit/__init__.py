"""The GPU session kit behind scripts/gpu_session.py, one module per step of a lent GPU's call:

- base.py     where the kit stands (ROOT), what the device tool brings back (file limits), log and one-line errors
- grid.py     what runs: the benchmarks' settings, the queue (most valuable first), run names, --only
- data.py     the data sets: packed here to travel, unpacked on the machine, checked before anything starts
- checks.py   the first call's checks on a machine: the LSTM's cuDNN check, the bench, the profile, the CUDA tests
- plan.py     when a run may start and when it must stop, from measured epoch times; where it goes on from
- run.py      the queue's runs as processes: started, watched, stopped at an epoch end, killed after --grace
- pack.py     $OUT rewritten at epoch ends and at the end: the runs' records, logs and travelling checkpoints
- unpack.py   here: what a call brought back into reproduction/, never losing a checkpoint or a finished run
- session.py  one call, whole: the steps above in order, and why in that order
"""
