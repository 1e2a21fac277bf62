"""Which code trained which epochs: config.json's segments (engine.runlog.with_segment, end_segment) and
the commit found from a code tree hash that leaves reproduction/ out (engine.runlog.commit_of_code_tree),
checked against git's own tree objects (git mktree) as the oracle; and every commit the suite records
(config.json's git_commit and segments, the benches' reports) both in a git checkout (git's own commit)
and in a source archive of it without .git ("unknown commit", never an error)."""
import importlib.util
import json
import os
import subprocess

from engine import runlog
from tests.git_checkout import UNKNOWN_COMMIT, needs_git_history
from tests.helpers import REPO


def git(*argv, **kwargs) -> str:
    return subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True, check=True,
                          **kwargs).stdout


def code_tree_by_mktree(commit: str) -> str:
    """The oracle: git itself writes the commit's root tree without its reproduction entry."""
    listing = [line for line in git("ls-tree", commit).splitlines() if line.split("\t")[1] != "reproduction"]
    return git("mktree", "--missing", input="\n".join(listing) + "\n").strip()


@needs_git_history
def test_tree_without_reproduction_is_gits_own_tree():
    raw = subprocess.run(["git", "-C", str(REPO), "cat-file", "tree", "HEAD^{tree}"], capture_output=True,
                         check=True).stdout
    assert runlog.tree_without(raw, b"reproduction") == code_tree_by_mktree("HEAD")
    assert runlog.tree_without(raw, b"no-such-entry") == git("rev-parse", "HEAD^{tree}").strip()


@needs_git_history
def test_the_commit_of_a_code_tree_has_that_tree():
    tree = code_tree_by_mktree("HEAD")
    found = runlog.commit_of_code_tree(tree)
    assert found and code_tree_by_mktree(found) == tree
    assert runlog.commit_of_code_tree("0" * 40) is None  # no commit has it
    assert runlog.commit_of_code_tree(None) == UNKNOWN_COMMIT  # no tree: code_tree() where git is missing


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


# ---------------------------------------------------------------------------------------------- with and without git
GIT_ID = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
          "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}


def git_in(folder, *argv, **kwargs) -> str:
    return subprocess.run(["git", "-C", str(folder), *argv], capture_output=True, text=True, check=True, env=GIT_ID,
                          **kwargs).stdout


def runlog_of(root):
    """engine/runlog.py as the copy of the code at `root` runs it (its REPO_DIR is root)."""
    spec = importlib.util.spec_from_file_location(f"runlog_of_{abs(hash(str(root)))}", root / "engine" / "runlog.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_provenance_in_a_git_checkout_and_in_its_source_archive(tmp_path):
    """A small project holding this engine/runlog.py, committed: git_commit, head_commit, git_state, code_tree
    and a config.json segment name git's own commit and tree (the tree without reproduction/ by git mktree);
    a change makes it dirty and its tree no commit's. The same commit as `git archive` gives it (no .git),
    unpacked INSIDE that checkout: every commit is "unknown commit" and the tree None, not the enclosing
    checkout's commit and not an error."""
    repo = tmp_path / "checkout"
    (repo / "engine").mkdir(parents=True)
    (repo / "engine" / "runlog.py").write_bytes((REPO / "engine" / "runlog.py").read_bytes())
    (repo / "main.py").write_text("print('train')\n")
    (repo / "reproduction").mkdir()
    (repo / "reproduction" / "metrics.csv").write_text("epoch\n1\n")
    (repo / ".gitignore").write_text("__pycache__/\n")
    git_in(repo, "init", "--quiet")
    git_in(repo, "add", "-A")
    git_in(repo, "commit", "--quiet", "--no-gpg-sign", "-m", "first")
    head = git_in(repo, "rev-parse", "HEAD").strip()
    listing = [line for line in git_in(repo, "ls-tree", "HEAD").splitlines() if line.split("\t")[1] != "reproduction"]
    tree = git_in(repo, "mktree", input="\n".join(listing) + "\n").strip()

    checkout = runlog_of(repo)
    assert checkout.git_commit() == checkout.head_commit() == head
    assert head.startswith(checkout.head_commit(short=True)) and len(checkout.head_commit(short=True)) >= 7
    assert checkout.git_state() == (head, True)
    assert checkout.code_tree() == tree and checkout.commit_of_code_tree(tree) == head
    (segment,) = checkout.with_segment(tmp_path / "config.json", {"device": "cpu"}, first_epoch=1)["segments"]
    assert (segment["code_tree"], segment["commit"], segment["git_describe"]) == (tree, head, head)
    (repo / "main.py").write_text("print('changed')\n")
    changed = runlog_of(repo)
    assert changed.git_commit() == f"{head}-dirty" and changed.git_state() == (head, False)
    assert changed.git_state(ignored=repo / "main.py") == (head, True)  # a bench's own report file
    assert changed.code_tree() != tree and changed.commit_of_code_tree(changed.code_tree()) is None

    archive = repo / "unpacked"  # inside the checkout: git must not find the enclosing repository
    archive.mkdir()
    tar = subprocess.run(["git", "-C", str(repo), "archive", "HEAD"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(archive)], input=tar, check=True)
    assert not (archive / ".git").exists() and (archive / "engine" / "runlog.py").exists()
    source = runlog_of(archive)
    assert source.git_commit() == source.head_commit() == source.head_commit(short=True) == UNKNOWN_COMMIT
    assert source.git_state(ignored=archive / "main.py") == (UNKNOWN_COMMIT, None)
    assert source.code_tree() is None
    assert source.commit_of_code_tree(None) == source.commit_of_code_tree(tree) == UNKNOWN_COMMIT
    (segment,) = source.with_segment(tmp_path / "archive.json", {"device": "cpu"}, first_epoch=1)["segments"]
    assert (segment["code_tree"], segment["commit"], segment["git_describe"]) == (None, UNKNOWN_COMMIT, UNKNOWN_COMMIT)
