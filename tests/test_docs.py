"""The documentation holds together: a README that fits on a screen, relative links (and their #anchors)
that lead somewhere, a docs/ index that lists every page, and no citation of files a user does not have
(the private reference notes this suite was written from). Reads files only: no training."""
import re
import statistics
import subprocess
import sys
from pathlib import Path

from tests.git_checkout import needs_git_history
from tests.helpers import REPO

README_MAX_LINES = 200
PAGES = [REPO / "README.md", REPO / "REPRODUCTION.md", *sorted((REPO / "docs").glob("*.md"))]
# what a checkout holds that is not the project's own text (written by runs, tools or installs)
SKIPPED_DIRS = {".git", "results", "figures", "datasets", "build", "__pycache__", ".venv", ".pytest_cache",
                ".ipynb_checkpoints"}
TEXT_SUFFIXES = {".py", ".md", ".sh", ".ipynb", ".toml", ".txt", ".ini", ".cfg", ".yml", ".yaml"}
# a section, bug or file of the notes: the word "spec" then "section", "bug" or a number; "<name>-spec.md"
SPEC_CITATION = re.compile(r"\bspec\s+(?:section|bug|\d)|\b[a-z]+-spec\.md\b", re.IGNORECASE)


def prose(markdown: str) -> str:
    """The text outside fenced code blocks and inline code spans (links there are examples, not links)."""
    markdown = re.sub(r"^[ \t]*```.*?^[ \t]*```[ \t]*$", "", markdown, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", markdown)


def links(markdown: str) -> list[str]:
    """Targets of [text](target) and ![alt](target) links."""
    return re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose(markdown))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2, ... as on GitHub."""
    seen, found = {}, set()
    text = re.sub(r"^[ \t]*```.*?^[ \t]*```[ \t]*$", "", markdown, flags=re.M | re.S)
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", text, flags=re.M):
        base = slug(heading)
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


def broken_links(page: Path) -> list[str]:
    """'target: why' for every relative link of `page` whose file or #anchor does not exist."""
    broken = []
    for target in links(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, flags=re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.name}")
    return broken


def project_text_files() -> list[Path]:
    files = []
    for path in REPO.rglob("*"):
        parts = path.relative_to(REPO).parts
        if any(part in SKIPPED_DIRS or part.startswith("results") or part.endswith(".egg-info") for part in parts):
            continue
        if path.is_file() and (path.suffix in TEXT_SUFFIXES or parts[0] == ".ci"):
            files.append(path)
    return files


def test_readme_fits_on_a_screen():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to a docs/ page"


def test_readme_test_command_is_the_one_ci_runs():
    setup = re.search(r"^## Set-up\n.*?```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.M | re.S)
    assert setup, "README.md: a '## Set-up' section with a ```bash block of the set-up commands"
    install, test_command = setup.group(1).splitlines()
    assert install == "pip install -r requirements.txt"
    assert test_command in (REPO / ".ci" / "run").read_text().splitlines()


def test_every_relative_link_leads_to_a_file_and_heading():
    broken = {page.name: broken_links(page) for page in PAGES}
    assert not {name: hits for name, hits in broken.items() if hits}, broken


def test_docs_index_lists_every_page_and_the_readme_links_the_index():
    index = REPO / "docs" / "README.md"
    listed = {(index.parent / target).resolve() for target in links(index.read_text())}
    pages = {page.resolve() for page in (REPO / "docs").glob("*.md") if page != index}
    assert pages <= listed, f"docs/README.md does not link {sorted(p.name for p in pages - listed)}"
    assert "docs/README.md" in links((REPO / "README.md").read_text())


def test_nothing_cites_the_private_reference_notes():
    hits = [f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}"
            for path in project_text_files()
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
            if SPEC_CITATION.search(line)]
    assert not hits, "cite the paper or a docs/ page instead:\n" + "\n".join(hits)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The link, anchor and citation checks on pages broken on purpose."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A `flag`: what it does\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n[ok](other.md#a-flag-what-it-does) [self](#page) [web](https://example.org/x)\n"
                    "```\n[in code](nowhere.md)\n```\n`[inline](nowhere.md)`\n")
    assert broken_links(page) == []
    page.write_text("[gone](missing.md) [bad anchor](other.md#no-such-heading) ![img](fig.png)\n")
    assert [hit.split(":")[0] for hit in broken_links(page)] == ["missing.md", "other.md#no-such-heading", "fig.png"]
    assert anchors("# A\n## A\n## A\n") == {"a", "a-1", "a-2"}
    cited = [text.replace("@", "") for text in  # "@" keeps this file from citing them itself
             ("as in sp@ec 5.3", "(Sp@ec bug 1)", "see sp@ec section 6", "cdgrab-sp@ec.md", "qsr-sp@ec.md, 2")]
    fine = ["importlib.util.spec_from_file_location", "kernelspec", "the paper's section 6.1", "a specific case"]
    assert all(SPEC_CITATION.search(line) for line in cited)
    assert not any(SPEC_CITATION.search(line) for line in fine)


def test_readme_local_step_table_is_the_shipped_bench_result():
    """README's local-step cost table and docs/local-step-speed.md's full table state the ratios of
    bench/results/communication-cpu.json (a rerun of the bench must update both)."""
    import json

    result = json.loads((REPO / "bench" / "results" / "communication-cpu.json").read_text())
    columns = [("MLP-M4", "D-RR"), ("MLP-M4", "CD-GraB"), ("LR-HMDA", "D-RR"), ("LR-HMDA", "CD-GraB")]
    rows = {"constant H = 4, dense": "constant+dense", "QSR, dense": "qsr+dense",
            "constant H = 4, dense, through vmap (before)": "constant+dense (vmap)"}
    readme = (REPO / "README.md").read_text()
    for label, strategy in rows.items():
        expected = " | ".join(f"{result[b][s][strategy]['ratio']:.2f}" for b, s in columns)
        assert f"| {label} | {expected} |" in readme, label
    page = (REPO / "docs" / "local-step-speed.md").read_text()
    for benchmark, sorter in columns:
        for strategy, m in result[benchmark][sorter].items():
            assert f"| {benchmark} | {sorter} | {strategy} | {m['epoch_cpu_seconds']:.2f} | {m['ratio']:.2f} |" in page


def quickstart_claims(result: dict) -> list[str]:
    """The README's times of its set-up and quick-start commands, as bench/results/quickstart-cpu.json's
    numbers print there."""
    smoke, threads, full = result["smoke_run"], result["smoke_run_default_threads"], result["full_run"]
    torchrun, analysis, pip = result["torchrun"], result["analysis"], result["pip_install_requirements"]
    return [
        f"again, with everything installed, {pip['cpu_seconds']:.1f} s of CPU, {pip['wall_seconds']:.1f} s of wall time",
        f"| smoke run | {smoke['wall_seconds']:.1f} s |",
        f"| one process, 50 epochs | {full['wall_seconds'] / 60:.1f} min (training epochs: median "
        f"{full['median_epoch_seconds']:.1f} s) |",
        f"| torchrun, 4 processes | about {torchrun['estimated_50_epoch_wall_seconds'] / 60:.0f} min (estimate: "
        f"{len(torchrun['epoch_seconds'])} epochs took {torchrun['wall_seconds']:.0f} s, "
        f"{torchrun['median_epoch_seconds']:.0f} s each) |",
        f"| `python -m analysis` | {analysis['wall_seconds']:.1f} s |",
        f"(load average {result['load_average_before'][0]:.1f} before, {result['load_average_after'][0]:.1f} after)",
        f"({threads['epoch_seconds'][0]:.2f} s against {smoke['epoch_seconds'][0]:.2f} s, the same",
        f"first epoch {threads['epoch_seconds'][0] / smoke['epoch_seconds'][0]:.0f} times slower",
    ]


def test_readme_quickstart_times_are_their_named_measurements():
    """README.md's times of its set-up and quick-start commands (and docs/benchmarks.md's LR-HMDA epoch) are
    bench/results/quickstart-cpu.json's (a rerun of bench/quickstart.py must update them), and the shipped
    runs' epoch time it compares them with is the median of their metrics.csv."""
    import csv
    import json
    import statistics

    result = json.loads((REPO / "bench" / "results" / "quickstart-cpu.json").read_text())
    flat = " ".join((REPO / "README.md").read_text().split())  # claims may wrap across lines
    missing = [claim for claim in quickstart_claims(result) if " ".join(claim.split()) not in flat]
    assert not missing, "README.md does not state bench/results/quickstart-cpu.json's times:\n" + "\n".join(missing)
    shipped = [float(row["epoch_seconds"]) for path in (REPO / "reproduction" / "LR-HMDA").glob("CD-GraB-*/metrics.csv")
               for row in csv.DictReader(path.open())]
    assert f"took {statistics.median(shipped):.2f} s per CD-GraB training epoch" in flat
    benchmarks = " ".join((REPO / "docs" / "benchmarks.md").read_text().split())
    assert f"LR-HMDA (CD-GraB: median {result['full_run']['median_epoch_seconds']:.1f} s," in benchmarks


def bench_result(name: str) -> dict:
    import json

    return json.loads((REPO / "bench" / "results" / name).read_text())


def test_performance_and_gpu_pages_state_their_bench_results():
    """The epoch times of docs/performance.md (CPU and GPU tables) and docs/gpus.md's training seconds per
    epoch are bench/results/cpu-epochs.json's and gpu-epochs.json's, and docs/sketching.md's GPT-2 step
    times are sketch-gpt2-cpu.json's (a rerun of a bench must update its page)."""
    performance = (REPO / "docs" / "performance.md").read_text()
    cpu = bench_result("cpu-epochs.json")["runs"]
    rows = {"LR-HMDA, 64,000 examples (4,000 steps), epoch 2": "LR-HMDA --max-train-examples 64000",
            "MLP-M4 (32 workers, B 32), 32,000 windows, epoch 2": "MLP-M4 --max-train-examples 32000 (32 workers, B 32)",
            "MLP-M4 (4 workers, B 16), 32,000 windows, epoch 2": "MLP-M4 --max-train-examples 32000 --node_cnt 4 --B 16",
            "LSTM-Wiki2 (4 workers, B 16), 30 of 3,728 steps, epoch 2":
                "LSTM-Wiki2 --max-train-examples 30 --max-eval-examples 10"}
    for label, run in rows.items():
        seconds = cpu[run]["seconds"]
        row = (f"| {label} | {seconds['D-RR']['epoch_seconds']:.2f} s | {seconds['CD-GraB']['epoch_seconds']:.2f} s "
               f"| {cpu[run]['CD-GraB/D-RR']:.2f} |")
        assert row in performance, row
    gpu = bench_result("gpu-epochs.json")["benchmarks"]
    gpus = (REPO / "docs" / "gpus.md").read_text()
    for benchmark, result in gpu.items():
        times = result["seconds_per_epoch"]
        row = f"| {benchmark} | {times['textbook']:#.3g} | {times['D-RR']:#.3g} | {times['CD-GraB']:#.3g} |"
        assert row in performance, row
        if benchmark in ("LSTM-Wiki2", "GPT2-Wiki103"):
            for sorter in ("CD-GraB", "D-RR"):
                assert f"| {benchmark} {sorter} | {times[sorter]:.1f} |" in gpus, (benchmark, sorter)
    sketching = (REPO / "docs" / "sketching.md").read_text()
    sketching = sketching[sketching.index("| GPT-2, CPU, one process |"):]
    sketching = sketching[:sketching.index("\n\n")]  # that table
    variants = bench_result("sketch-gpt2-cpu.json")["variants"]
    for label, variant in {"D-RR": "D-RR", "D-RR, CD-GraB's CPU sign loop loaded": "D-RR, CD-GraB's sign loop loaded",
                           "exact CD-GraB": "CD-GraB", "D = 1024, materialise then sketch": "CD-GraB D=1024 materialise",
                           "D = 1024, from layer records": "CD-GraB D=1024 records",
                           "D = 1024, from layer records, --sketch-min-numel 16384":
                               "CD-GraB D=1024 records min-numel 2^14"}.items():
        v = variants[variant]
        wall, cpu_step = f"{v['step_seconds']:.1f} s", f"{v['step_cpu_seconds']:.1f} s"
        (row,) = [line for line in sketching.splitlines() if line.startswith(f"| {label} |")]
        assert [cell.strip() for cell in row.split("|")[6:10:2]] == [wall, cpu_step], (row, wall, cpu_step)
    # the sign-loop table: peak memory and CPU step time with their ratios to D-RR (sketch-gpt2-sign-loop-cpu.json)
    page = (REPO / "docs" / "sketching.md").read_text()
    table = page[page.index("| GPT-2, CPU, sign loops |"):]
    table = table[:table.index("\n\n")]
    variants = bench_result("sketch-gpt2-sign-loop-cpu.json")["variants"]
    for label, variant in {"D-RR": "D-RR", "D-RR, CD-GraB's CPU sign loop loaded": "D-RR, CD-GraB's sign loop loaded",
                           "D = 1024 from layer records, `--sign-loop compiled`": "CD-GraB D=1024 records, compiled sign loop",
                           "D = 1024 from layer records (`auto`)": "CD-GraB D=1024 records"}.items():
        v = variants[variant]
        (row,) = [line for line in table.splitlines() if line.startswith(f"| {label} |")]
        cells = [cell.strip().strip("*").split(" (")[0].strip("*") for cell in row.split("|")[2:8]]
        assert cells[0] == (v["sign_loop"] or "-") and cells[1] == ("yes" if v["numba_loaded"] else "no"), row
        assert cells[2] == f"{v['peak_rss_mb']:,.0f} MB" and cells[4] == f"{v['step_cpu_seconds']:.2f} s", row
        assert float(cells[3]) == round(v["peak_vs_drr"], 2) and float(cells[5]) == round(v["step_cpu_vs_drr"], 2), row


def test_herding_time_is_the_shipped_csvs_sum():
    """docs/figures.md's time of the shipped herding run is the sum of its CSVs' `seconds` at the last round,
    over the four methods it names, at the paper's scale (10^6 vectors a trial; issue #60's smaller-scale
    CD-GraB and D-RR runs are another run)."""
    import csv

    total = 0.0
    for path in (REPO / "reproduction" / "herding").glob("*.csv"):
        rows = list(csv.DictReader(path.open()))
        paper_scale = int(rows[-1]["n_workers"]) * int(rows[-1]["m"]) == 10**6
        if rows[-1]["method"] in ("CD-GraB", "I-B", "I-PB", "D-RR") and paper_scale:
            total += float(rows[-1]["seconds"])
    page = " ".join((REPO / "docs" / "figures.md").read_text().split())
    assert f"adds up to {total / 60:.1f} min for the four methods" in page


def test_run_directory_states_the_peer_report_delay_the_code_uses():
    """docs/run-directory.md's delay before other ranks report bad input is common/errors.py's setting."""
    setting = re.search(r"^PEER_REPORT_DELAY_SECONDS = ([\d.]+)$", (REPO / "common" / "errors.py").read_text(), flags=re.M)
    page = " ".join((REPO / "docs" / "run-directory.md").read_text().split())
    assert f"by those ranks after {float(setting.group(1)):g} s: `PEER_REPORT_DELAY_SECONDS`" in page


def test_readme_states_the_test_suites_measured_time():
    """README.md's set-up times are bench/results/test-suite-cpu.json's (bench/test_suite.py: a fresh clone,
    an in-checkout venv, the two set-up commands), and that run passed."""
    import json

    result = json.loads((REPO / "bench" / "results" / "test-suite-cpu.json").read_text())
    assert result["test_exit_status"] == 0 and result["counts"]["passed"] > 0 and "failed" not in result["counts"]
    flat = " ".join((REPO / "README.md").read_text().split())
    claim = (f"the first command took {result['install_seconds']:.1f} s and the second "
             f"{result['test_seconds'] / 60:.1f} min on this 2-core CPU")
    assert claim in flat and "bench/results/test-suite-cpu.json" in flat, claim


def test_reproduction_tables_are_the_scripts_output():
    """Every table scripts/reproduction_tables.py computes from the shipped reproduction/ stands in
    REPRODUCTION.md verbatim: the page's tables are never typed by hand, and new runs (a GPU session's
    epochs) must be followed by the script's tables."""
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "reproduction_tables.py"), str(REPO / "reproduction")],
                         capture_output=True, text=True, check=True).stdout
    page = (REPO / "REPRODUCTION.md").read_text()
    tables = [block for block in out.strip().split("\n\n") if block.startswith("|")]
    assert len(tables) >= 4, out[:500]
    stale = [table.splitlines()[0] for table in tables if table not in page]
    assert not stale, f"REPRODUCTION.md lacks the script's current tables headed {stale}"


def test_gpu_session_numbers_are_their_session_records():
    """docs/gpus.md's times of the third and fourth lent sessions are their session.json files' and test logs'
    (reproduction/gpu-sessions/), and docs/performance.md names the commit of bench/results/gpu-epochs.json."""
    import json

    sessions = REPO / "reproduction" / "gpu-sessions"
    gpt2 = json.loads((sessions / "2026-11-26T143245" / "session.json").read_text())
    (run,) = [entry for key, entry in gpt2["runs"].items() if key.startswith("GPT2-Wiki103/CD-GraB")]
    wall, train = run["median_wall_seconds_per_epoch_this_call"], run["median_train_seconds_this_call"]
    lstm = json.loads((sessions / "2026-11-26T145609" / "session.json").read_text())["runs"].values()
    trains = sorted(entry["median_train_seconds_this_call"] for entry in lstm)
    page = " ".join((REPO / "docs" / "gpus.md").read_text().split())
    claims = [f"median 17.0 s of wall time an epoch ({train:.1f} s of training; {run['epochs_done']} epochs in a call "
              f"of {gpt2['wall_seconds']:.1f} s", f"a median {wall:.1f} s of wall time an epoch alone ({train:.1f} s",
              f"so {wall - train:.1f} s of evaluation and checkpoint), so 30 epochs take about {30 * wall:.0f} s",
              f"measured {wall - train:.1f} s of wall time beyond training an epoch ({wall:.1f} - {train:.1f}",
              f"{max(e['median_wall_seconds_per_epoch_this_call'] for e in lstm):.1f} s of wall time an epoch "
              f"(training {trains[0]:.1f}-{trains[-1]:.1f})"]
    assert f"median {wall:.1f} s" in page
    fourth = json.loads((sessions / "2026-11-27T195320" / "session.json").read_text())
    clipped = {key.split("/")[1].split("-node")[0]: entry for key, entry in fourth["runs"].items()}
    tested = (sessions / "2026-11-27T195320" / "tests.log").read_text().splitlines()[-1]
    fold, drr, cdgrab = (clipped[name] for name in ("Fold", "D-RR", "CD-GraB"))
    firsts = sorted(entry["first_epoch_wall_seconds"] for entry in clipped.values())
    claims += [f"({tested.split()[0]} passed in {tested.split()[-2].rstrip('s')} s)",
               "median wall seconds per epoch {:.1f} (D-RR), {:.1f} (CD-GraB) and {:.1f} (Fold), training {:.1f}, "
               "{:.1f} and {:.1f}, the first epoch {:.1f}-{:.1f} s; in a call of {:.1f} s they reached epochs {}, {} "
               "and {}".format(*(e["median_wall_seconds_per_epoch_this_call"] for e in (drr, cdgrab, fold)),
                               *(e["median_train_seconds_this_call"] for e in (drr, cdgrab, fold)), firsts[0],
                               firsts[-1], fourth["wall_seconds"], *(e["epochs_done"] for e in (drr, cdgrab, fold))),
               f"wall time to {cdgrab['median_wall_seconds_per_epoch_this_call'] / drr['median_wall_seconds_per_epoch_this_call']:.1f}x "
               f"(training: 4.0x to {cdgrab['median_train_seconds_this_call'] / drr['median_train_seconds_this_call']:.1f}x)"]
    missing = [claim for claim in claims if claim not in page]
    assert not missing, missing
    commit = bench_result("gpu-epochs.json")["git_commit"]
    assert f"Measured once, on commit {commit[:7]} (its `git_commit`" in (REPO / "docs" / "performance.md").read_text()


@needs_git_history
def test_gpu_history_table_is_what_git_holds():
    """docs/gpus.md's table of the git history each lent GPU added is what git holds: per session commit, the
    checkpoint blobs it added or changed."""
    page = " ".join((REPO / "docs" / "gpus.md").read_text().split())

    def git(*argv, **kwargs):
        return subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True, check=True, **kwargs).stdout

    for commit in git("log", "--format=%h", "--", "reproduction/*checkpoint.pt.gz").split():
        blobs = [line.split()[3] for line in git("diff-tree", "-r", "--no-commit-id", "--diff-filter=AM", commit, "--",
                                                "reproduction/*checkpoint.pt.gz").splitlines()]
        if blobs:
            sizes = git("cat-file", "--batch-check=%(objectsize)", input="\n".join(blobs) + "\n").split()
            row = f"| {commit} | {len(blobs)} | {sum(map(int, sizes)) / 2**20:.1f} |"
            assert row in page, row


def test_exact_cdgrab_page_states_the_divided_ddp_bench():
    """docs/exact-cdgrab.md's table of the products divided over processes is
    bench/results/exact-ddp-gpt2-small-cpu.json's (step CPU, peak and their ratios, bytes), at its commit."""
    page = (REPO / "docs" / "exact-cdgrab.md").read_text()
    table = page[page.index("| variant (2 processes x 4 sequences) | step s (CPU) | vs plain | peak MB | vs plain | sent"):]
    table = table[:table.index("\n\n")]
    result = bench_result("exact-ddp-gpt2-small-cpu.json")
    assert f"exact-ddp-gpt2-small-cpu.json`, commit {result['git_commit'][:7]};" in " ".join(page.split())
    for label, name in {"plain Trainer (DDP)": "plain", "sketched D = 1024": "sketched D=1024",
                        "exact_low_memory, divided": "exact_low_memory",
                        "exact_low_memory, 1 process x 2 replicas (8 sequences)":
                            "exact_low_memory, 1 process x 2 replicas"}.items():
        v = result["variants"][name]
        (row,) = [line for line in table.splitlines() if line.startswith(f"| {label} |")]
        cells = [cell.strip() for cell in row.split("|")[2:6]]
        assert cells == [f"{v['step_cpu_seconds']:.2f}", f"{v['step_cpu_vs_plain']:.2f}", f"{v['peak_rss_mb']:.0f}",
                         f"{v['peak_vs_plain']:.2f}"], row
    exact = result["variants"]["exact_low_memory"]
    assert f"{exact['gathered_bytes_per_step'] / 1e6:.1f} MB / {exact['received_bytes_per_step'] / 1e6:.0f} MB |" in table
    assert result["exact_low_memory_orders_equal_one_process"] is True


def test_gpt2_small_numbers_are_the_current_bench_files():
    """The GPT-2 small Trainer numbers of README.md, docs/frameworks.md and docs/exact-cdgrab.md are those of the
    bench's current files: bench/results/sketch-gpt2-small.json (every variant, one run) and
    sketch-gpt2-small-exact-low-memory-parts.json (exact_low_memory's split of the sorter's share)."""
    result = bench_result("sketch-gpt2-small.json")
    v = result["variants"]
    sketched = f"sketched D={result['sketch_dim']}"
    time, peak = ({name: f"{m[key]:.2f}x" for name, m in v.items()} for key in ("step_cpu_vs_plain", "peak_vs_plain"))
    readme = " ".join((REPO / "README.md").read_text().split())
    assert (f"steps at {time[sketched]} the plain Trainer's time and peaks at {peak[sketched]} its memory (CPU, "
            "bench/results/sketch-gpt2-small.json;") in readme
    assert (f"at {time['exact_low_memory']} the plain step and {peak['exact_low_memory']} its peak, against "
            f"{time['exact']} and {peak['exact']} when they are formed (the same run;") in readme
    frameworks = " ".join((REPO / "docs" / "frameworks.md").read_text().split())
    assert (f"steps at {time[sketched]} the plain `Trainer`'s time and {peak[sketched]} its peak memory with "
            f"D = {result['sketch_dim']}, where exact CD-GraB takes {time['exact']} and {peak['exact']} with the "
            f"formed gradients, and {time['exact_low_memory']} and {peak['exact_low_memory']} from") in frameworks
    page = (REPO / "docs" / "exact-cdgrab.md").read_text()
    flat = " ".join(page.split())
    assert f"(`bench/results/sketch-gpt2-small.json`, commit {result['git_commit'][:7]}," in flat
    for name in ("plain", sketched, "exact", "exact_low_memory"):
        m = v[name]
        row = (f"| {name} | {m['step_seconds']:.2f} | {m['step_vs_plain']:.2f} | {m['step_cpu_seconds']:.2f} | "
               f"{m['step_cpu_vs_plain']:.2f} | {m['peak_rss_mb'] / 1024:.2f} | {m['peak_vs_plain']:.2f} |")
        assert row in page, row
    parts = bench_result("sketch-gpt2-small-exact-low-memory-parts.json")
    plain, low = parts["variants"]["plain"], parts["variants"]["exact_low_memory"]
    split = [r["part_cpu_seconds"] for r in low["rounds"]]
    rest = [r["step_cpu_seconds"] - p["products"] - p["update"] for r, p in zip(low["rounds"], split)]
    products = sorted(f"{p['products']:.1f}" for p in split)
    assert (f"(commit {parts['git_commit'][:7]}), plain and exact_low_memory alone" in flat and
            f"plain {plain['step_seconds']:.2f} s, exact_low_memory {low['step_seconds']:.2f} s "
            f"({low['step_vs_plain']:.2f}x) and {low['peak_vs_plain']:.2f}x the peak; products "
            f"{products[0]}-{products[-1]} s and update {statistics.median(p['update'] for p in split):.1f} s "
            "of its step" in flat), flat
    assert f"took about {statistics.median(rest):.1f} s against the plain step's {plain['step_seconds']:.2f} s" in flat
    assert f"step ratios ({v['exact_low_memory']['step_vs_plain']:.2f}x, {low['step_vs_plain']:.2f}x)" in flat


def quoted_bench_files() -> list[tuple[str, str]]:
    """(page, file name) for every bench result a page names: each bench/results/NAME, and each bare file name
    of a bench's family (its first two words those of a file in bench/results: sketch-gpt2-small-....json);
    a bare suffix of a JSON file such as `-8mib.json` as it is. A glob (bench/results/sketch-gpt2-small*.json)
    names none."""
    families = {"-".join(path.name.split("-")[:2]) for path in (REPO / "bench" / "results").iterdir()}
    quoted = []
    for page in PAGES:
        text = page.read_text()
        quoted += [(page.name, name) for name in re.findall(r"bench/results/([\w.-]+\.(?:json|txt))\b(?!\*)", text)]
        for name in re.findall(r"(?<![\w/.$*-])(-?[\w.]+(?:-[\w.]+)*\.(?:json|txt))\b", text):
            if name.startswith("-") and name.endswith(".json") or "-".join(name.split("-")[:2]) in families:
                quoted.append((page.name, name))
    return quoted


def test_docs_quote_current_bench_files_only():
    """Every bench result the docs name is a file in bench/results/ now (a superseded run lives in git history,
    not beside the current one), named by what it measures: no file there is named by a commit
    (<name>-<7 hex digits>.json), and no page names a file by a bare suffix."""
    results = REPO / "bench" / "results"
    by_commit = [path.name for path in results.iterdir() if re.search(r"-[0-9a-f]{7}\.json$", path.name)]
    assert not by_commit, f"bench/results/ files named by a commit (git history keeps old runs): {by_commit}"
    quoted = quoted_bench_files()
    assert ("README.md", "sketch-gpt2-small.json") in quoted  # the check reads what it should
    missing = [(page, name) for page, name in quoted if not (results / name).is_file()]
    assert not missing, f"pages name bench results that are not in bench/results/: {missing}"
