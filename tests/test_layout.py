"""The package's shape: library code never imports the command line, and no import circle exists.

Both are read from the sources' import statements (function-level imports included), not guessed.
"""

import ast
from pathlib import Path

PKG_ROOT = Path(__file__).resolve().parents[1] / "src" / "dominospec"


def module_name(path: Path) -> str:
    parts = ("dominospec",) + path.relative_to(PKG_ROOT).with_suffix("").parts
    return ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG_ROOT.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """dominospec modules that `path` imports anywhere in its body."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "dominospec")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "dominospec":
                continue
            found.add(mod)
            for alias in node.names:  # `from . import bench` imports the submodule bench
                if f"{mod}.{alias.name}" in known:
                    found.add(f"{mod}.{alias.name}")
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(path, set(mods)) for name, path in mods.items()}


def test_import_reader_sees_relative_and_function_level_imports():
    graph = import_graph()
    assert "dominospec.cli.common" in graph["dominospec.cli.bench"]
    assert "dominospec.cli.bench" in graph["dominospec.cli"]          # from . import bench
    assert "dominospec.target.features" in graph["dominospec.drafter.config"]


def test_library_code_never_imports_the_command_line():
    offenders = {name: sorted(m for m in deps if m == "dominospec.cli" or m.startswith("dominospec.cli."))
                 for name, deps in import_graph().items()
                 if not (name == "dominospec.cli" or name.startswith("dominospec.cli."))}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"library modules importing dominospec.cli: {offenders}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_circle_between_modules():
    # the package __init__ files re-export their children; edges into a package mean its __init__
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


def test_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_only_the_target_package_imports_transformers():
    outside = []
    for name, path in modules().items():
        if name.startswith("dominospec.target"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "transformers" for n in names):
                outside.append(name)
    assert not outside, f"modules outside dominospec.target importing transformers: {outside}"
