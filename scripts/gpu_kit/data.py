"""The data sets on the trip: packed here into one archive to carry (--pack-data), unpacked on the machine
(--data-archive), and checked before a call spends device time (check_inputs)."""
import tarfile
from pathlib import Path

from scripts.gpu_kit.base import MIB, ROOT, fail, log

DATA_FOLDERS = ("wikitext-2", "wikitext-103", "gpt2-tokenizer", "hmda", "m4")  # the runs', the tests' and the bench's


def pack_data(source: Path, archive: Path) -> None:
    """Here: the data sets the session needs, as one gzipped tar (a third of their size), to carry."""
    missing = [name for name in DATA_FOLDERS if not (source / name).is_dir()]
    if missing:
        fail(f"{source} lacks {', '.join(missing)}: pass the data folder (scripts/download_data.sh fills one)")
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for name in DATA_FOLDERS:
            tar.add(source / name, arcname=name)
    print(f"{archive}: {archive.stat().st_size / MIB:.1f} MiB; carry {archive.parent.name} and pass "
          f"--data-archive {archive.relative_to(ROOT) if archive.is_relative_to(ROOT) else archive}")


def unpack_data(archive: Path, data_dir: Path) -> None:
    """On the machine: the carried archive into --data-dir, unless it holds the data already."""
    if all((data_dir / name).is_dir() for name in DATA_FOLDERS):
        return
    if not archive.exists():
        fail(f"no {archive}: make it here with --pack-data DATA and carry its folder")
    data_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(data_dir, filter="data")
    log(f"data sets unpacked from {archive} into {data_dir}")


def check_inputs(args) -> None:
    data = Path(args.data_dir)
    needed = ["wikitext-2/train.txt", "wikitext-2/valid.txt", "wikitext-2/test.txt", "wikitext-103/wiki.valid.tokens",
              "gpt2-tokenizer/vocab.json", "gpt2-tokenizer/merges.txt"]
    missing = [name for name in needed if not (data / name).exists()]
    if missing:
        fail(f"{data} lacks {', '.join(missing)}: copy the data sets there (carry that folder on the device "
             f"machine) or pass --data-dir")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            fail("no CUDA device is visible: run this on the GPU machine, or pass --device cpu (with --tiny)")
