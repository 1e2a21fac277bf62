"""The import graph, read from the source (ast, no import): the suite's rooms stand in layers (LAYERS) with
no arrow from a lower room up to a higher one and no circle; no circle inside sorters/, and no arrow from
it to any room of the suite; and the one threshold table (sorters/thresholds.py) that
the torch-free engine/flags.py and analysis/paper_values.py write out, agreeing with them."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("common", "engine", "data", "models", "analysis")
# each room's floor: a module may import its own room's modules and those of lower floors, never a higher
# one. common/ (the one-line error, the data folder) is the ground floor; sorters/ (the pip library)
# stands beside it and imports nothing of the suite; the data loaders and models on them; the engine
# above; the analysis of the run folders on top (it reads the engine's flag table).
LAYERS = {"common": 0, "sorters": 0, "data": 1, "models": 1, "engine": 2, "analysis": 3}


def imported_modules(path: Path, package: str = "sorters") -> set[str]:
    """Every module `path` imports, anywhere in the file (lazy imports in functions too); `from sorters
    import x` names the submodule sorters.x when there is one, else the package itself."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = (ROOT / (sub.replace(".", "/") + ".py")).exists()
                found.add(sub if is_module else node.module)
    return found


def sorters_graph() -> dict[str, set[str]]:
    """module -> the sorters modules it imports ('sorters' is the package's __init__)."""
    graph = {}
    for path in sorted((ROOT / "sorters").glob("*.py")):
        name = "sorters" if path.stem == "__init__" else f"sorters.{path.stem}"
        graph[name] = {m for m in imported_modules(path) if m.split(".")[0] == "sorters"} - {name}
    return graph


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
    """module -> the suite's modules it imports, for every module of the rooms in LAYERS."""
    graph = {}
    for room in LAYERS:
        for path in sorted((ROOT / room).glob("*.py")):
            name = room if path.stem == "__init__" else f"{room}.{path.stem}"
            graph[name] = {m for m in imported_modules(path) if m.split(".")[0] in LAYERS} - {name}
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
