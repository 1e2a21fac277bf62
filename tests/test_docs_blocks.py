"""Every ```python block of README.md and docs/*.md runs as written (issue #59: docs whose code runs).

A block runs alone, in a fresh namespace, in an empty folder, unless a marker -- an HTML comment on the
line just before its fence, which GitHub does not show -- says otherwise:

    <!-- docs-test: after NAME -->      run PREAMBLES[NAME] first: the objects the page's prose assumes (a
                                        model, its loss, a data set, an optimizer), built small and
                                        synthetic, and after the block PREAMBLES[NAME]'s check, if any
    <!-- docs-test: quick-start -->     a quick-start snippet: scripts/release_checks.py also runs it (with
                                        its preamble) from the installed wheel, in a folder outside the checkout
    <!-- docs-test: fragment: WHY -->   a fragment that cannot run as written (WHY says why): only compiled.
                                        The exception: a block that can be made to run should be.

Several parts are separated by ";" (`<!-- docs-test: after classifier; quick-start -->`). A block that
fails names its page and line. What a preamble defines is what the text around the block names; the
preamble itself never reaches into the checkout beyond `sorters` (the quick-start ones run from the wheel).
"""
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PYTHON_FENCE = re.compile(r"^```[ \t]*(python3?|py|pycon)[ \t]*\n(.*?)^```[ \t]*$", flags=re.M | re.S)
MARKER = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")
# the quick-start snippets: the package's readme (PyPI's page) and the guide's minimal loop (the README's
# library lines point to the guide: the README has no room for a block of its own, tests/test_docs.py)
QUICK_STARTS = {"docs/package-readme.md", "docs/guide.md"}

# a linear classifier on 256 synthetic examples that a line separates: the model, loss and data the
# own-loop blocks assume (torch and sorters only: the quick starts run it from the installed wheel)
CLASSIFIER = """
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
features = torch.randn(256, 8)
labels = (features @ torch.randn(8) > 0).long()
train_set = TensorDataset(features, labels)
model = torch.nn.Linear(8, 2)
ddp_model = model                               # the DDP-wrapped model of a torchrun loop; one process here
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
epochs, start_epoch, checkpoint = 2, 0, {}


def loss_fn(logits, y):
    return F.cross_entropy(logits, y)


with torch.no_grad():
    loss_before = loss_fn(model(features), labels).item()
"""
# the block trained the model: its loss over the data fell (an independent check that the loop ran steps)
CLASSIFIER_TRAINED = """
with torch.no_grad():
    loss_after = loss_fn(model(features), labels).item()
assert loss_after < 0.9 * loss_before, (loss_before, loss_after)
"""
# a tiny GPT-2 from a config (nothing downloaded): 2 blocks (12 for the block that balances `.h.11.`), and
# 16 dict items with their labels, two batches of 8
GPT2 = """
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()
torch.manual_seed(0)
config = GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=N_LAYER, n_head=2,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = gpt2 = GPT2LMHeadModel(config)
ids = torch.randint(0, 32, (16, 8))                                   # (N, T)
mask = torch.ones_like(ids)
labels = ids.clone()
train_set = [{"input_ids": row, "labels": row} for row in ids]
args = TrainingArguments(output_dir="out", per_device_train_batch_size=8, dataloader_drop_last=True,
                         num_train_epochs=1, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)


def loss_fn(logits, y):
    return F.cross_entropy(logits.flatten(0, -2), y.flatten())
"""
# PerExampleLossGrads' block ends with `sampler.step(g)`: a sampler of those gradients, its epoch started
GPT2_SAMPLER = GPT2.replace("N_LAYER", "12") + """
from sorters import CDGraBSampler

balanced = sum(p.numel() for name, p in GPT2LMHeadModel(config).named_parameters() if ".h.11." in name)
sampler = CDGraBSampler(range(16), batch_size=16, d=balanced, seed=0)                # the block's batch: all 16
next(iter(DataLoader(range(16), batch_size=sampler.loader_batch_size, sampler=sampler)))  # the epoch starts
"""
PREAMBLES = {  # name: (set-up, check after the block)
    "classifier": (CLASSIFIER, CLASSIFIER_TRAINED),
    "classifier-setup": (CLASSIFIER, ""),  # the set-up alone: for a block that takes no optimizer step
    "accelerate": (CLASSIFIER + "from accelerate import Accelerator\naccelerator = Accelerator(cpu=True)\n",
                   CLASSIFIER_TRAINED),
    "lightning": (CLASSIFIER, ""),
    "gpt2": (GPT2.replace("N_LAYER", "2"), ""),
    "gpt2-sampler": (GPT2_SAMPLER, "assert sampler.position == 16\n"),
    "sorter": ("import torch\ntorch.manual_seed(0)\nn, m, d = 2, 8, 3\n"
               "grads, positions = torch.randn(n, 2, d), torch.arange(2)\n", ""),
    "runs": ("""
from pathlib import Path
import matplotlib
matplotlib.use("Agg")
REPRODUCTION = Path(%r)
Path("results/LR-HMDA").mkdir(parents=True)
for run in sorted((REPRODUCTION / "LR-HMDA").iterdir())[:4]:   # a few of the shipped runs, as a results/ folder
    (Path("results/LR-HMDA") / run.name).symlink_to(run)
Path("results/herding").symlink_to(REPRODUCTION / "herding")
""" % str(REPO / "reproduction"), ""),
}


@dataclass
class Block:
    page: str       # relative to the repository, e.g. "docs/sampler.md"
    line: int       # of the opening fence
    code: str
    markers: list   # the marker's parts, e.g. ["after classifier", "quick-start"]

    @property
    def preamble(self) -> str | None:
        names = [part.split(None, 1)[1] for part in self.markers if part.startswith("after ")]
        return names[0] if names else None

    @property
    def fragment(self) -> str | None:
        reasons = [part.partition(":")[2].strip() for part in self.markers if part.startswith("fragment")]
        return reasons[0] if reasons else None

    @property
    def quick_start(self) -> bool:
        return "quick-start" in self.markers

    def __str__(self):
        return f"{self.page}:{self.line}"


def python_blocks(text: str, page: str) -> list[Block]:
    """The ```python blocks of a page's text, each with the marker of the line before its fence."""
    blocks = []
    for fence in PYTHON_FENCE.finditer(text):
        line = text.count("\n", 0, fence.start()) + 1
        before = text[:fence.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        markers = [part.strip() for part in marker.group(1).split(";")] if marker else []
        blocks.append(Block(page, line, fence.group(2), markers))
    return blocks


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in python_blocks(page.read_text(), str(page.relative_to(REPO)))]


def marker_problems(block: Block) -> list[str]:
    """What is wrong with a block's marker: an unknown part or preamble, a fragment without its reason."""
    problems = []
    for part in block.markers:
        if part.startswith("after "):
            if part.split(None, 1)[1] not in PREAMBLES:
                problems.append(f"{block}: no preamble {part.split(None, 1)[1]!r} (tests/test_docs_blocks.py: PREAMBLES)")
        elif part.startswith("fragment"):
            if not part.partition(":")[2].strip():
                problems.append(f"{block}: a fragment says why it cannot run: `fragment: WHY`")
        elif part != "quick-start":
            problems.append(f"{block}: unknown marker part {part!r} (after NAME, quick-start, fragment: WHY)")
    if block.fragment and (block.preamble or block.quick_start):
        problems.append(f"{block}: a fragment does not run, so it has no preamble and is no quick start")
    return problems


def program(block: Block) -> str:
    """The block as a program: its preamble's set-up, the block as written, the preamble's check."""
    setup, check = PREAMBLES[block.preamble] if block.preamble else ("", "")
    return f"{textwrap.dedent(setup)}\n# ---- {block} as written\n{block.code}\n# ---- the check\n{textwrap.dedent(check)}"


def quick_start_programs() -> list[tuple[str, str]]:
    """(where, program) of every quick-start block: what scripts/release_checks.py runs from the wheel."""
    return [(str(block), program(block)) for block in all_blocks() if block.quick_start]


BLOCKS = all_blocks()


def test_every_marker_is_known_and_the_quick_starts_are_marked():
    problems = [problem for block in BLOCKS for problem in marker_problems(block)]
    assert not problems, "\n".join(problems)
    marked = {block.page for block in BLOCKS if block.quick_start}
    assert marked == QUICK_STARTS, f"quick-start blocks on {sorted(marked)}, expected one on each of {sorted(QUICK_STARTS)}"


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_the_block_runs_as_written(block, tmp_path, monkeypatch):
    """The block's program (preamble, block, check) in a fresh namespace, in an empty folder; a fragment
    compiles."""
    if block.fragment:
        compile(block.code, str(block), "exec")
        return
    monkeypatch.chdir(tmp_path)
    code = compile(program(block), str(block), "exec")
    exec(code, {"__name__": "__docs_block__"})


def test_the_checks_catch_what_they_are_for():
    """A block whose code is broken, a trained-model check that is not met, markers that are wrong."""
    page = ("text\n<!-- docs-test: after classifier -->\n```python\nfor x, y in DataLoader(train_set, batch_size=16):\n"
            "    pass\n```\n\n```python\nimport sorters\n```\n<!-- docs-test: fragment -->\n```py\nx\n```\n")
    untrained, plain, fragment = python_blocks(page, "page.md")
    assert (untrained.preamble, untrained.line, plain.markers, plain.line) == ("classifier", 3, [], 8)
    with pytest.raises(AssertionError):  # the loop took no optimizer step: the check after it fails
        exec(compile(program(untrained), "page", "exec"), {})
    assert marker_problems(fragment) == ["page.md:12: a fragment says why it cannot run: `fragment: WHY`"]
    wrong = Block("p.md", 1, "", ["after nothing", "quickstart"])
    assert len(marker_problems(wrong)) == 2
    broken = Block("p.md", 1, "from sorters import CDGraBSamplr\n", [])
    with pytest.raises(ImportError):
        exec(compile(program(broken), "p", "exec"), {})


def test_the_guides_error_lines_are_the_librarys():
    """Each line the guide's error table quotes (its first column) is in a message of the library's source,
    so that a reworded message cannot leave the guide describing a line no one sees."""
    guide = (REPO / "docs" / "guide.md").read_text()
    table = guide[guide.index("## What each error means"):]
    quoted = re.findall(r"^\| `([^`]+)` \|", table, flags=re.M)
    source = "".join(path.read_text() for path in sorted((REPO / "sorters").rglob("*.py")))
    assert len(quoted) >= 8, quoted
    assert not [line for line in quoted if line not in source], [line for line in quoted if line not in source]
