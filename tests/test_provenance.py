"""Which code trained which epochs: config.json's segments (engine.runlog.with_segment, end_segment) and
the commit found from a code tree hash that leaves reproduction/ out (engine.runlog.commit_of_code_tree),
checked against git's own tree objects (git mktree) as the oracle."""
import json
import subprocess

from engine import runlog
from tests.helpers import REPO


def git(*argv, **kwargs) -> str:
    return subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True, check=True,
                          **kwargs).stdout


def code_tree_by_mktree(commit: str) -> str:
    """The oracle: git itself writes the commit's root tree without its reproduction entry."""
    listing = [line for line in git("ls-tree", commit).splitlines() if line.split("\t")[1] != "reproduction"]
    return git("mktree", "--missing", input="\n".join(listing) + "\n").strip()


def test_tree_without_reproduction_is_gits_own_tree():
    raw = subprocess.run(["git", "-C", str(REPO), "cat-file", "tree", "HEAD^{tree}"], capture_output=True,
                         check=True).stdout
    assert runlog.tree_without(raw, b"reproduction") == code_tree_by_mktree("HEAD")
    assert runlog.tree_without(raw, b"no-such-entry") == git("rev-parse", "HEAD^{tree}").strip()


def test_the_commit_of_a_code_tree_has_that_tree():
    tree = code_tree_by_mktree("HEAD")
    found = runlog.commit_of_code_tree(tree)
    assert found and code_tree_by_mktree(found) == tree
    assert runlog.commit_of_code_tree("0" * 40) is None and runlog.commit_of_code_tree(None) is None


def test_segments_are_appended_and_never_rewritten(tmp_path):
    path = tmp_path / "config.json"
    first = runlog.with_segment(path, {"device": "cpu", "args": {"epochs": 5}}, first_epoch=1)
    runlog.write_config(path, first)
    runlog.end_segment(path, 2)
    second = runlog.with_segment(path, {"device": "cpu", "args": {"epochs": 5}}, first_epoch=3)
    runlog.write_config(path, second)  # a resume: config.json written anew, segments carried over
    segments = json.loads(path.read_text())["segments"]
    assert [(s["first_epoch"], s["last_epoch"]) for s in segments] == [(1, 2), (3, None)]
    assert segments[0] == first["segments"][0] | {"last_epoch": 2}  # the first record as it was, closed
    assert all(s["torch"] and s["device"] == "cpu" and "code_tree" in s for s in segments)
