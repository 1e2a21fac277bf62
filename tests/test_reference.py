"""The generated API reference (issue #59): docs/reference/ builds with Sphinx (autodoc + napoleon, nitpicky,
warnings as errors, nothing downloaded) into a temporary folder, and every public name of docs/api.md is
documented in it, under its public module (read from the build's objects.inv, Sphinx's own inventory)."""
import os
import subprocess
import sys
from pathlib import Path

from sphinx.util.inventory import InventoryFile

from tests.helpers import release_check
from tests.test_sorters_imports import api_page

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTED = {"py:class", "py:exception", "py:function", "py:data", "py:attribute", "py:method", "py:property"}


def build_reference(out: Path) -> subprocess.CompletedProcess:
    """The command docs/api.md gives, `python -m sphinx -W --keep-going -n -b html docs/reference OUT`, with
    this interpreter."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
                           "-d", str(out / ".doctrees"), str(ROOT / "docs" / "reference"), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def documented_names(inventory_path: Path) -> dict[str, set[str]]:
    """{role: {full name}} of a built reference's objects.inv."""
    with open(inventory_path, "rb") as stream:
        inventory = InventoryFile.load(stream, "", os.path.join)
    return {role: set(entries) for role, entries in inventory.items()}


@release_check
def test_the_reference_builds_without_a_warning_and_documents_every_public_name(tmp_path):
    built = build_reference(tmp_path)
    assert built.returncode == 0, f"the reference's build failed or warned:\n{built.stdout}\n{built.stderr}"
    names = documented_names(tmp_path / "objects.inv")
    objects = set().union(*(entries for role, entries in names.items() if role in DOCUMENTED))
    public, _ = api_page()
    assert set(public) <= names.get("py:module", set()), names.get("py:module")
    missing = sorted(f"{module}.{name}" for module, listed in public.items() for name in listed
                     if f"{module}.{name}" not in objects)
    assert not missing, f"public names (docs/api.md) the reference does not document: {missing}"
    # the classes come with their documented methods (autodoc members), e.g. the sampler's step
    assert {"sorters.CDGraBSampler.step", "sorters.Sorter.load_state_dict", "sorters.exact.ExactCDGraB.step"} <= objects
