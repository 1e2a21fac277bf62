"""How a missing or altered data file is reported (where the data sets live: common/paths.py)."""
from pathlib import Path

from common.errors import UserFacingError
from data.checksums import verify

DOWNLOAD_HINT = "run scripts/download_data.sh DATA_DIR (needs the internet) or pass --data-dir"


def require_files(folder: Path, names: list[str], what: str) -> list[Path]:
    """Return folder/name for each name, or raise one clear error naming every missing file (or the first
    file that is not the published one: data/checksums.py)."""
    paths = [Path(folder) / n for n in names]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise UserFacingError(f"{what} not found: missing {', '.join(missing)}; {DOWNLOAD_HINT}")
    for path in paths:
        verify(path)
    return paths
