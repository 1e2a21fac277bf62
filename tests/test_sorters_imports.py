"""The import graph, read from the source (ast, no import): the suite's rooms stand in layers (LAYERS) with
no arrow from a lower room up to a higher one and no circle; no circle inside sorters/, and no arrow from
it to any room of the suite; and the one threshold table (sorters/thresholds.py) that
the torch-free engine/flags.py and analysis/paper_values.py write out, agreeing with them. And the decided
public API (issue #59): docs/api.md lists exactly the public modules' __all__, every module is public or
internal there, and the names a module keeps to itself start with an underscore."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("common", "engine", "data", "models", "analysis")
# each room's floor: a module may import its own room's modules and those of lower floors, never a higher
# one. common/ (the one-line error, the data folder) is the ground floor; sorters/ (the pip library)
# stands beside it and imports nothing of the suite; the data loaders and models on them; the engine
# above; the analysis of the run folders on top (it reads the engine's flag table).
LAYERS = {"common": 0, "sorters": 0, "data": 1, "models": 1, "engine": 2, "analysis": 3}


def imported_modules(path: Path, package: str = "sorters", run_time: bool = False) -> set[str]:
    """Every module `path` imports, anywhere in the file (lazy imports in functions too); `from sorters
    import x` names the submodule sorters.x when there is one, else the package itself. run_time: without
    the imports under `if TYPE_CHECKING:`, which only a type checker reads (they never run)."""
    found = set()
    tree = ast.parse(path.read_text())
    for_annotations = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                       for statement in node.body for inner in ast.walk(statement)} if run_time else set()
    for node in ast.walk(tree):
        if id(node) in for_annotations:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = (ROOT / (sub.replace(".", "/") + ".py")).exists()
                found.add(sub if is_module else node.module)
    return found


def sorters_graph() -> dict[str, set[str]]:
    """module -> the sorters modules it imports when it runs ('sorters' is the package's __init__); an import
    for annotations only (sorters.exact's of sorters.gather, which imports it) makes no arrow."""
    graph = {}
    for path in sorted((ROOT / "sorters").glob("*.py")):
        name = "sorters" if path.stem == "__init__" else f"sorters.{path.stem}"
        graph[name] = {m for m in imported_modules(path, run_time=True) if m.split(".")[0] == "sorters"} - {name}
    return graph


def test_an_import_for_annotations_only_makes_no_arrow_at_run_time(tmp_path):
    source = tmp_path / "module.py"
    source.write_text("from typing import TYPE_CHECKING\nimport sorters.sketch\n\nif TYPE_CHECKING:\n"
                      "    import sorters.gather\n\n\ndef f():\n    from sorters import balance\n")
    assert imported_modules(source) >= {"sorters.sketch", "sorters.gather", "sorters.balance"}
    assert imported_modules(source, run_time=True) >= {"sorters.sketch", "sorters.balance"}
    assert "sorters.gather" not in imported_modules(source, run_time=True)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of the graph as a list of nodes (first = last), or None (depth-first search)."""
    state, stack = {}, []

    def visit(node):
        state[node], _ = "open", stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node], _ = "done", stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_circles_and_passes_chains():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a2"}, "a2": {"b"}, "b": {"a2"}}) == ["a2", "b", "a2"]


def test_the_package_imports_no_circle():
    graph = sorters_graph()
    assert "sorters.registry" in graph["sorters.sampler"], "the sampler takes the registry from its own module"
    assert "sorters" not in set().union(*(graph[m] for m in graph if m != "sorters" and not m.startswith(
        ("sorters.hf", "sorters.lightning")))), "only the framework glue imports the package's __init__"
    assert find_cycle(graph) is None, find_cycle(graph)


def rooms_graph() -> dict[str, set[str]]:
    """module -> the suite's modules it imports when it runs, for every module of the rooms in LAYERS."""
    graph = {}
    for room in LAYERS:
        for path in sorted((ROOT / room).glob("*.py")):
            name = room if path.stem == "__init__" else f"{room}.{path.stem}"
            graph[name] = {m for m in imported_modules(path, run_time=True) if m.split(".")[0] in LAYERS} - {name}
    return graph


def test_the_rooms_stand_in_layers_with_no_arrow_up_and_no_circle():
    graph = rooms_graph()
    assert "common.errors" in graph["data.files"] and "common.paths" in graph["engine.cli"], graph["engine.cli"]
    upward = sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                    if LAYERS[target.split(".")[0]] > LAYERS[module.split(".")[0]]
                    or (LAYERS[target.split(".")[0]] == LAYERS[module.split(".")[0]]
                        and target.split(".")[0] != module.split(".")[0]))
    assert not upward, f"imports that run up or sideways between rooms: {upward}"
    assert find_cycle(graph) is None, find_cycle(graph)


def test_the_package_never_imports_the_engine_data_or_analysis():
    for path in sorted((ROOT / "sorters").glob("*.py")):
        wrong = sorted(m for m in imported_modules(path) if m.split(".")[0] in FORBIDDEN)
        assert not wrong, f"{path.name} imports {wrong}"


def test_the_examples_and_benches_need_no_engine_or_tests():
    """Examples: the library alone (plus data/ for the data sets); bench/profile_steps.py: not tests/."""
    for path in sorted((ROOT / "examples").glob("*.py")):
        wrong = sorted(m for m in imported_modules(path) if m.split(".")[0] in ("engine", "tests", "analysis"))
        assert not wrong, f"{path.name} imports {wrong}"
    assert not [m for m in imported_modules(ROOT / "bench" / "profile_steps.py") if m.split(".")[0] == "tests"]


def test_one_threshold_table_and_the_torch_free_copies_agree():
    from analysis.paper_values import _COMMON
    from engine.flags import FLAGS
    from engine.sketching import STRUCTURED_MIN_NUMEL as engine_default
    from sorters.layer_sketch import STRUCTURED_MIN_NUMEL as library_default
    from sorters.settings import CDGraBSettings
    from sorters.thresholds import STRUCTURED_MIN_NUMEL_BY_USE as table

    assert table == {"library": 2**16, "engine": 2**20}
    assert engine_default == FLAGS["sketch_min_numel"].added == _COMMON["sketch_min_numel"] == table["engine"]
    assert library_default == CDGraBSettings().min_numel == table["library"]


# ---- the public API (issue #59): docs/api.md, the modules' __all__ and the underscore rules ----

API_PAGE = ROOT / "docs" / "api.md"


def api_page() -> tuple[dict[str, list[str]], list[str]]:
    """docs/api.md read as ({public module: the names of its table}, [internal modules]): a public module is a
    `## \\`sorters...\\`` heading, its names the first cells of its table; the internal ones the first cells
    of the table under "## Internal modules"."""
    public, internal, section = {}, [], None
    for line in API_PAGE.read_text().splitlines():
        if line.startswith("## "):
            heading = line[3:].strip()
            section = heading.strip("`") if heading.startswith("`sorters") else heading
            if heading.startswith("`sorters"):
                public[section] = []
        elif line.startswith("| `") and section is not None:
            name = line.split("|")[1].strip().strip("`")
            if section == "Internal modules":
                internal.append(name)
            elif section in public:
                public[section].append(name)
    return public, internal


def defined_names(path: Path) -> list[str]:
    """The names a module defines at its top level (def, class, assignment), not those it imports."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name)]
    return [name for name in names if not (name.startswith("__") and name.endswith("__"))]


def module_path(module: str) -> Path:
    return ROOT / "sorters" / ("__init__.py" if module == "sorters" else module.split(".", 1)[1] + ".py")


def test_the_api_page_reads_its_tables():
    public, internal = api_page()
    assert list(public) == ["sorters", "sorters.exact", "sorters.fsdp", "sorters.hf", "sorters.lightning"]
    assert "CDGraBSampler" in public["sorters"] and "watch" in public["sorters.lightning"]
    assert "sorters.balance" in internal and "sorters" not in internal


def test_the_api_page_lists_exactly_every_public_modules_all():
    """Every name of every public module's __all__ is on the page, under its module, and every name the page
    lists is in that __all__ and exists."""
    import importlib

    public, _ = api_page()
    for module, names in public.items():
        imported = importlib.import_module(module)
        exported = getattr(imported, "__all__", None)
        assert exported is not None, f"{module} is public (docs/api.md) but has no __all__"
        assert len(set(exported)) == len(exported), f"{module}.__all__ names something twice"
        assert len(set(names)) == len(names), f"docs/api.md lists a name of {module} twice"
        missing, extra = sorted(set(exported) - set(names)), sorted(set(names) - set(exported))
        assert not missing, f"{module}.__all__ has names docs/api.md does not list: {missing}"
        assert not extra, f"docs/api.md lists names that are not in {module}.__all__: {extra}"
        absent = [name for name in names if not hasattr(imported, name)]
        assert not absent, f"{module} has no {absent}"


def test_every_module_is_public_or_internal_on_the_page():
    public, internal = api_page()
    modules = {"sorters" if p.stem == "__init__" else f"sorters.{p.stem}" for p in (ROOT / "sorters").glob("*.py")}
    listed = set(public) | set(internal)
    unlisted = sorted(m for m in modules - listed if not m.split(".")[-1].startswith("_"))
    assert not unlisted, f"modules docs/api.md neither lists as public nor as internal: {unlisted}"
    assert not listed - modules, f"docs/api.md lists modules that do not exist: {sorted(listed - modules)}"
    assert not set(public) & set(internal)


def test_a_public_modules_other_names_are_private():
    """In a public module, every name it defines and does not export starts with an underscore."""
    public, _ = api_page()
    for module, names in public.items():
        loose = [name for name in defined_names(module_path(module)) if name not in names and not name.startswith("_")]
        assert not loose, f"{module} defines {loose}: in its __all__ (and docs/api.md), or with a leading underscore"


def test_a_name_used_only_inside_its_module_is_private():
    """Internal modules too: a top-level name that no other Python file of the checkout mentions is a
    module-private helper, so its name starts with an underscore (sampler.check_arguments -> _check_arguments)."""
    sources = {path: path.read_text() for room in ("sorters", "engine", "bench", "tests", "analysis", "scripts",
                                                   "examples", "models", "data", "common")
               for path in (ROOT / room).rglob("*.py")}
    sources.update({path: path.read_text() for path in ROOT.glob("*.py")})
    public, _ = api_page()
    loose = []
    for path in sorted((ROOT / "sorters").glob("*.py")):
        module = "sorters" if path.stem == "__init__" else f"sorters.{path.stem}"
        for name in defined_names(path):
            if name.startswith("_") or name in public.get(module, ()):
                continue
            pattern = re.compile(rf"\b{re.escape(name)}\b")
            if not any(pattern.search(text) for other, text in sources.items() if other != path):
                loose.append(f"{module}.{name}")
    assert not loose, f"names used only inside their module, without a leading underscore: {loose}"
