"""Here, on the files a call brought back (--unpack): each run into reproduction/<benchmark>/<run>/ as
unpack_decision says (a shipped checkpoint goes only for a newer one of its run or when the run
finished; a finished shipped run changes only with --replace-finished), every run's record and log as it
came into the session's folder, the bench's JSON and the profile into bench/results/."""
import gzip
import io
import json
import os
import re
import shutil
import tarfile
from pathlib import Path

from engine.rundir import metrics_rows  # no torch: the epochs a run's metrics.csv holds
from scripts.gpu_kit.base import ROOT, fail, write_atomically
from scripts.gpu_kit.grid import packed_checkpoint_name

def checkpoint_epoch(path: Path) -> int | None:
    """The epoch a (gzipped) checkpoint was taken at, read from the checkpoint itself; None without one."""
    if not path.exists():
        return None
    import torch
    with gzip.open(path, "rb") as f:
        return int(torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=False)["epoch"])


def shipped_state(target: Path) -> dict:
    """What reproduction/<benchmark>/<run>/ holds: epochs, whether finished, its checkpoint's epoch."""
    rows = metrics_rows(target / "metrics.csv")
    try:
        epochs = json.loads((target / "config.json").read_text())["args"]["epochs"]
    except (OSError, ValueError, KeyError):
        epochs = None
    return {"rows": rows, "finished": epochs is not None and rows >= epochs,
            "checkpoint": checkpoint_epoch(target / "checkpoint.pt.gz")}


def unpack_decision(shipped: dict, came: dict, replace_finished: bool = False) -> str:
    """What --unpack does with a run a call brought back, given what is shipped (shipped_state) and what
    came (rows, finished, checkpoint: its packed checkpoint's epoch or None): "keep" the shipped files,
    "replace" them (records, and the checkpoint by the call's), or "finish" (records replaced, the
    checkpoint removed). A shipped checkpoint goes only for a newer one of the run or when it finished;
    a finished shipped run changes only with replace_finished; the longer record wins where neither
    side has a checkpoint; a run that can go on (a checkpoint) wins over one that cannot."""
    if shipped["finished"] and not replace_finished:
        return "keep"
    if came["finished"]:
        return "finish"
    if came["checkpoint"] is not None:
        return "replace" if shipped["checkpoint"] is None or came["checkpoint"] >= shipped["checkpoint"] else "keep"
    if shipped["checkpoint"] is not None:
        return "keep"  # the call's epochs past it came without a checkpoint: the next session redoes them
    return "replace" if came["rows"] > shipped["rows"] else "keep"


def unpack_run(tar, key: str, entry: dict, source: Path, into: Path, session_dir: Path, replace_finished: bool) -> None:
    benchmark, name = key.split("/")
    target = into / benchmark / name
    packed = source / packed_checkpoint_name(benchmark, name)
    came = {"rows": entry["epochs_done"], "finished": entry["finished"], "checkpoint": checkpoint_epoch(packed)}
    shipped = shipped_state(target)
    decision = unpack_decision(shipped, came, replace_finished)
    if decision == "keep":
        why = "finished" if shipped["finished"] else f"{shipped['rows']} epochs" + (
            f", checkpoint of epoch {shipped['checkpoint']}" if shipped["checkpoint"] is not None else "")
        print(f"{target}: kept as shipped ({why}); this call's run reached {entry['epochs_done']} epochs"
              f"{'' if came['checkpoint'] is None else ', checkpoint of epoch ' + str(came['checkpoint'])} "
              f"(its record: {session_dir / 'runs.tar.gz'})")
        return
    if came["rows"] < shipped["rows"]:  # a record longer than the one replacing it stays in the session folder
        keep_aside = session_dir / "replaced" / f"{benchmark}--{name}.tar.gz"  # packed, as keep_records says why
        keep_aside.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(keep_aside, "w:gz") as aside:
            for file in ("config.json", "metrics.csv"):
                aside.add(target / file, arcname=f"{key}/{file}")
    target.mkdir(parents=True, exist_ok=True)
    for file in ("config.json", "metrics.csv"):
        write_atomically(target / file, tar.extractfile(f"{key}/{file}").read())
    if decision == "replace" and came["checkpoint"] is not None:
        shutil.copy(packed, target / ".checkpoint.pt.gz.tmp")
        os.replace(target / ".checkpoint.pt.gz.tmp", target / "checkpoint.pt.gz")
    elif decision == "finish":
        (target / "checkpoint.pt.gz").unlink(missing_ok=True)
    state = "finished" if entry["finished"] else f"epoch {entry['epochs_done']}/{entry['epochs']}"
    print(f"{target}: {state}{', checkpoint kept' if (target / 'checkpoint.pt.gz').exists() else ''}")


def keep_records(archive: Path, session_dir: Path) -> None:
    """Every run's config.json, metrics.csv and log as the call brought them back, and the bench's and the
    profile's logs: the call's runs.tar.gz, byte for byte, in the session's folder. Kept packed, so that
    the analysis, which reads every run folder under reproduction/, never meets a second copy of a run."""
    shutil.copy(archive, session_dir / "runs.tar.gz")


def unpack(source: Path, into: Path, bench_json: Path, sessions: Path, replace_finished: bool = False) -> None:
    """Runs -> into/<benchmark>/<run>/ (unpack_decision); gpu-epochs.json -> bench_json as it came; the
    profile -> gpu-profile-<device>-<date>.txt beside it; session.json, tests.log and every run's record
    and log -> sessions/<started>/."""
    from engine import runlog
    archive = source / "runs.tar.gz"
    if not archive.exists():
        fail(f"{source} holds no runs.tar.gz: pass the folder the device call's files came back in")
    with tarfile.open(archive, "r:gz") as tar:
        manifest = json.loads(tar.extractfile("session.json").read())
        if manifest["tiny"] and into.resolve() == (ROOT / "reproduction").resolve():
            fail("these are a --tiny dry run's runs: unpack them with --into somewhere other than reproduction/")
        session_dir = sessions / manifest["started"].replace(" ", "T").replace(":", "")
        session_dir.mkdir(parents=True, exist_ok=True)
        names = set(tar.getnames())
        for key, entry in manifest["runs"].items():
            if f"{key}/metrics.csv" in names and "epochs_done" in entry:  # else never started
                unpack_run(tar, key, entry, source, into, session_dir, replace_finished)
        keep_records(archive, session_dir)
        manifest["commit"] = runlog.commit_of_code_tree(manifest.get("tree"))
        (session_dir / "session.json").write_text(json.dumps(manifest, indent=1) + "\n")
        if "gpu-profile.txt" in names:
            device = re.sub(r"[^A-Za-z0-9]+", "-", manifest["device"].split(",")[0]).strip("-")
            profile = bench_json.parent / f"gpu-profile-{device}-{manifest['started'][:10]}.txt"
            profile.write_bytes(tar.extractfile("gpu-profile.txt").read())
    if (source / "tests.log").exists():
        shutil.copy(source / "tests.log", session_dir / "tests.log")
    if (source / "gpu-epochs.json").exists():
        report = json.loads((source / "gpu-epochs.json").read_text())
        bench_json.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / "gpu-epochs.json", bench_json)
        found = runlog.commit_of_code_tree(report.get("code_tree"))
        if found == runlog.UNKNOWN_COMMIT:
            found = "an unknown commit (no code tree in the report, or no git history here to look it up in)"
        print(f"{bench_json}: the bench of {found or 'a code tree no commit here has (commit it, then look again)'}")
