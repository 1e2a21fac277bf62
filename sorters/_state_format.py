"""The format versions of the states the library saves into a user's checkpoint, written in one place.

Every such state is a dict that holds its format under FORMAT_KEY ("format_version"), an integer, one
per kind of state (a kind's number changes only when what that kind saves changes):

- SORTER_STATE_FORMAT: a sorter's state_dict() (every sorter of build_sorter, and ExactCDGraB), which the
  sampler's state holds under "sorter" and the engine's checkpoint.pt under "sorter";
- SAMPLER_STATE_FORMAT: CDGraBSampler.state_dict() (your checkpoint; accelerate's save_state);
- TRAINER_STATE_FORMAT: the HF Trainer's cdgrab_sampler.pt in each checkpoint-N/ folder (sorters.hf);
- LIGHTNING_STATE_FORMAT: CDGraBCallback.state_dict() (Lightning's checkpoint, under the callback).

A state without the key was saved before the versions were recorded (the suite's checkpoints before its
first release): format 0, which holds the same keys as format 1, so it loads as it is. A state of a format
newer than the library's (a later cdgrab-sorters wrote it) is refused with one line that says to
upgrade. A future format that changes a kind's keys adds to that kind's load_state_dict the migration from
the previous format, and passes `oldest` to saved_format, which refuses the formats before it in one line
(a release reads its own format and the previous one: docs/stability.md).
docs/sorters.md ("Saved states") says the same for users.
"""

FORMAT_KEY = "format_version"

SORTER_STATE_FORMAT = 1
SAMPLER_STATE_FORMAT = 1
TRAINER_STATE_FORMAT = 1
LIGHTNING_STATE_FORMAT = 1


def saved_format(owner: str, state: object, current: int, oldest: int = 0) -> int:
    """The format `state` was saved in: state[FORMAT_KEY], or 0 when it has none (saved before the versions
    were recorded; also for a state that is not a dict, which the caller's key check then refuses).
    Raises ValueError (one line) for a format newer than `current`, the format this version of the
    library writes, for one older than `oldest`, the oldest it still reads, and for a value that is not
    a format number."""
    version = state.get(FORMAT_KEY, 0) if isinstance(state, dict) else 0
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"{owner}: state[{FORMAT_KEY!r}] must be a state format (an integer >= 0), got "
                         f"{repr(version)[:40]}; pass a state that state_dict() returned")
    if version > current:
        raise ValueError(f"{owner}: the state was saved by a newer cdgrab-sorters (state format {version}; this "
                         f"version reads formats 0..{current}): upgrade cdgrab-sorters (pip install -U "
                         "cdgrab-sorters) to load it")
    if version < oldest:
        raise ValueError(f"{owner}: the state is of state format {version}, which this cdgrab-sorters no longer "
                         f"reads (it reads formats {oldest}..{current}): load it with the release before this "
                         "one and save it again, or start a new run")
    return version
