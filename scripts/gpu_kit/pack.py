"""Packing: $OUT holds, at every moment of a call, what the device tool brings back (Packer), so a call
cut at its limit returns every finished epoch; checkpoints travel slimmed and gzipped (slim_checkpoint)."""
import gzip
import io
import json
import tarfile
import time
from pathlib import Path

from scripts.gpu_kit.base import MAX_FILE_BYTES, MAX_FILES, MAX_TOTAL_BYTES, MIB, log, write_atomically
from scripts.gpu_kit.grid import BENCHMARKS, packed_checkpoint_name

def slim_checkpoint(path: Path) -> bytes:
    """checkpoint.pt, gzipped, with what the next epoch resets zeroed: taken at an epoch end, the
    balancers' running sums are replaced by zeros at the next epoch's start (sorters.base.PairBalancer),
    so zeros resume the same run and compress to almost nothing."""
    import torch
    state = torch.load(path, map_location="cpu", weights_only=False)
    sorter = state.get("sorter") or {}
    for key in ("running_sum", "running_sums"):
        if torch.is_tensor(sorter.get(key)) and sorter.get("pending") is None:
            sorter[key] = torch.zeros_like(sorter[key])
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return gzip.compress(buffer.getvalue(), compresslevel=6)


class Packer:
    """Keeps $OUT what the device tool brings back at every moment of the call: pack() rewrites it from
    the runs' files (at each epoch end, at most every --pack-every seconds, and at the end), so a call
    cut at its limit returns every finished epoch. Within at most 8 files of at most 16 MiB: runs.tar.gz
    (every run's config.json, metrics.csv and log, bench.log, gpu-profile.txt, session.json), tests.log,
    gpu-epochs.json, and one checkpoint per unfinished run whose checkpoint can travel, most valuable
    first. A checkpoint is gzipped only when it changed and has a slot; one that cannot travel (a GPT-2
    run's) is never gzipped."""

    def __init__(self, work: Path, out: Path):
        self.work, self.out = work, out
        self.gzipped = {}  # run key -> (checkpoint.pt's mtime_ns, gzipped bytes)
        self.written = {}  # file name in $OUT -> the mtime_ns of the checkpoint.pt it packs
        self.last = None   # time.monotonic() of the last pack
        self.epochs = None  # the runs' epochs at the last pack

    def due(self, runs, now: float, every: float) -> bool:
        """An epoch ended (or a run exited) since the last pack, and the last one is `every` seconds old."""
        epochs = [(r.epochs_done(), r.process is not None and r.process.poll() is None) for r in runs]
        return epochs != self.epochs and (self.last is None or now - self.last >= every)

    def pack(self, runs, manifest: dict) -> None:
        out = self.out
        out.mkdir(parents=True, exist_ok=True)
        self.epochs = [(r.epochs_done(), r.process is not None and r.process.poll() is None) for r in runs]
        self.last = time.monotonic()
        others = [p for p in out.iterdir() if p.name not in ("tests.log", "gpu-epochs.json", "runs.tar.gz")
                  and not p.name.startswith(("ckpt-", "."))]  # what the caller wrote there takes slots too
        files = [name for name in ("tests.log", "gpu-epochs.json") if self.copy_small(name)]
        slots = MAX_FILES - len(others) - len(files) - 1  # runs.tar.gz
        room = MAX_TOTAL_BYTES - MIB - sum(p.stat().st_size for p in others if p.is_file()) - \
            sum((out / name).stat().st_size for name in files) - 2 * MIB  # runs.tar.gz's share, generously
        keep = self.pack_checkpoints(runs, manifest, slots, room)
        for stale in out.glob("ckpt-*"):  # a run that finished since, or lost its slot
            if stale.name not in keep:
                stale.unlink()
        write_atomically(out / "runs.tar.gz", self.archive(runs, manifest))
        log(f"packed {len(files) + 1 + len(keep)} files into {out}: {', '.join(files + ['runs.tar.gz'] + keep)}")

    def copy_small(self, name: str) -> bool:
        source = self.work / name
        if not source.exists() or source.stat().st_size > MAX_FILE_BYTES:
            return False
        write_atomically(self.out / name, source.read_bytes())
        return True

    def pack_checkpoints(self, runs, manifest: dict, slots: int, room: int) -> list[str]:
        """Writes the checkpoints that fit (most valuable first) and notes in the manifest where each went;
        returns their file names."""
        kept = []
        for run in runs:
            path = run.dir / "checkpoint.pt"
            if run.finished() or not path.exists():
                continue
            entry = manifest["runs"][run.key]
            if not BENCHMARKS[run.benchmark]["checkpoint_travels"]:
                entry["checkpoint"] = "left on this machine: it cannot travel (packed, larger than a file may be)"
                continue
            if len(kept) >= slots:
                entry["checkpoint"] = "left on this machine: no file slot left"
                continue
            data = self.gzip(run, path)
            if len(data) > MAX_FILE_BYTES or len(data) > room:
                entry["checkpoint"] = f"left on this machine: {len(data) / MIB:.1f} MiB packed does not fit"
                continue
            name = packed_checkpoint_name(run.benchmark, run.name)
            if self.written.get(name) != self.gzipped[run.key][0] or not (self.out / name).exists():
                write_atomically(self.out / name, data)
                self.written[name] = self.gzipped[run.key][0]
            kept.append(name)
            room -= len(data)
            entry["checkpoint"] = f"{name} ({len(data) / MIB:.1f} MiB, epoch {run.epochs_done()})"
        return kept

    def gzip(self, run, path: Path) -> bytes:
        """The run's packed checkpoint, made again only when checkpoint.pt changed."""
        stamp = path.stat().st_mtime_ns
        if run.key not in self.gzipped or self.gzipped[run.key][0] != stamp:
            self.gzipped[run.key] = (stamp, slim_checkpoint(path))
        return self.gzipped[run.key][1]

    def archive(self, runs, manifest: dict) -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for run in runs:
                for name in ("config.json", "metrics.csv", "log.txt"):
                    if (run.dir / name).exists():
                        tar.add(run.dir / name, arcname=f"{run.benchmark}/{run.name}/{name}")
            for name in ("bench.log", "profile.log", "gpu-profile.txt"):
                if (self.work / name).exists():
                    tar.add(self.work / name, arcname=name)
            data = json.dumps(manifest, indent=1).encode()
            info = tarfile.TarInfo("session.json")
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))
        return buffer.getvalue()
