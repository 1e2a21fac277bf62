"""What the examples share, so that they need the library (`sorters`), the data loaders (`data/`) and
the suite's ground floor (`common/`: the one-line error and the data folder's default) only, never its
engine: one-line exits for data and settings refused."""
from common.errors import OneLineErrorParser, UserFacingError, exit_with_error  # noqa: F401 (the examples')
from common.paths import default_data_dir  # noqa: F401 (the examples')


def load_or_exit(load, *args, **kwargs):
    """load(*args, **kwargs), or its one-line error (a missing or unreadable data set) and exit 2."""
    try:
        return load(*args, **kwargs)
    except UserFacingError as error:
        exit_with_error(str(error))


def settings_or_exit(settings_class, **fields):
    """settings_class(**fields) (sorters.CDGraBSettings), or its one-line refusal and exit 2: called before
    any data is loaded, so that bad settings print that line and nothing else."""
    try:
        return settings_class(**fields)
    except (TypeError, ValueError) as error:
        exit_with_error(str(error))
