"""The package's shape: library code never imports the command line, and no import circle exists;
every package index names its modules and no source file cites a file that does not exist.

Both are read from the sources' import statements (function-level imports included), not guessed.
"""

import ast
import re
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
                base = base[: len(base) - (node.level - 1)]
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
    assert "dominospec.cli.bench" in graph["dominospec.cli"]  # from . import bench
    assert "dominospec.targets.features" in graph["dominospec.drafter.config"]


def test_library_code_never_imports_the_command_line():
    offenders = {
        name: sorted(m for m in deps if m == "dominospec.cli" or m.startswith("dominospec.cli."))
        for name, deps in import_graph().items()
        if not (name == "dominospec.cli" or name.startswith("dominospec.cli."))
    }
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
                return path[path.index(dep) :] + [dep]
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


# transformers' API moves fast, so one package absorbs it: targets/. The one deliberate exception is
# integrations/, which meets users inside transformers' own generate() and must name its objects.
TRANSFORMERS_PACKAGES = ("dominospec.targets", "dominospec.integrations")


def test_only_the_target_package_imports_transformers():
    outside = []
    for name, path in modules().items():
        if name.startswith(TRANSFORMERS_PACKAGES):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n.split(".")[0] == "transformers" for n in names):
                outside.append(name)
    assert not outside, f"modules outside {TRANSFORMERS_PACKAGES} importing transformers: {outside}"


# The data flow, bottom to top: a module may import its own package and packages of lower stages only.
# Packages on one stage are siblings and stay independent of each other (the foundation modules excepted).
STAGES = [
    {"errors", "version", "log", "io", "devices", "sampling"},  # foundation
    {"targets"},  # the model being accelerated (the only home of transformers)
    {"drafter"},  # the draft model and its checkpoints
    {"decode"},  # one speculative step: propose, verify, accept
    {"tune"},  # what the step reads, measured once: the device profile, the STS calibration, the policy built from them
    {"engine", "data", "export"},  # many requests at once; training data; other engines' formats
    {"serve"},  # the engine over HTTP (bench drives a running server: `bench --server`)
    {"train", "bench", "integrations"},  # what users run
    {"cli"},
    {"__init__"},  # the package's public surface re-exports from any stage
]


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def stage_of(package: str) -> int:
    for i, names in enumerate(STAGES):
        if package in names:
            return i
    raise AssertionError(f"package {package!r} has no stage in tests/test_layout.py STAGES: add it where it belongs")


def stage_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for name, deps in graph.items():
        src = package_of(name)
        for dep in deps:
            dst = package_of(dep)
            up = stage_of(dst) > stage_of(src)
            sibling = stage_of(dst) == stage_of(src) and stage_of(src) > 0  # foundation modules share freely
            if src != dst and src != "__init__" and (up or sibling):
                bad.append(f"{name} (stage {stage_of(src)}) imports {dep} (stage {stage_of(dst)})")
    return sorted(bad)


def test_every_package_has_a_stage():
    for name in modules():
        stage_of(package_of(name))


def test_imports_only_go_down_the_stages():
    bad = stage_violations(import_graph())
    assert not bad, "imports against the data flow:\n" + "\n".join(bad)


def test_stage_check_catches_an_upward_and_a_sibling_import():
    graph = {
        "dominospec.decode.single": {"dominospec.targets.hf"},  # down: fine
        "dominospec.targets.hf": {"dominospec.decode.single"},  # up: caught
        "dominospec.train.trainer": {"dominospec.bench.runner"},  # sibling: caught
    }
    assert stage_violations(graph) == [
        "dominospec.targets.hf (stage 1) imports dominospec.decode.single (stage 3)",
        "dominospec.train.trainer (stage 7) imports dominospec.bench.runner (stage 7)",
    ]


# ----- the docstrings a newcomer reads first -----

REPO_ROOT = PKG_ROOT.parents[1]


def unlisted_modules(init: Path) -> list[str]:
    """Modules (x.py) and subpackages (x/) of a package that its __init__ docstring does not name."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    pkg = init.parent
    names = [p.name for p in pkg.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    names += [p.name + "/" for p in pkg.iterdir() if (p / "__init__.py").exists()]
    return sorted(n for n in names if n not in doc)


def test_every_package_index_lists_its_modules():
    stale = {str(i.parent.relative_to(PKG_ROOT)): unlisted_modules(i) for i in sorted(PKG_ROOT.rglob("__init__.py"))}
    assert {p: m for p, m in stale.items() if m} == {}


def test_index_check_catches_an_unlisted_module(tmp_path):
    (tmp_path / "__init__.py").write_text('"""A package.\n\nlisted.py  named here\n"""\n')
    (tmp_path / "listed.py").write_text("")
    assert unlisted_modules(tmp_path / "__init__.py") == []
    (tmp_path / "forgotten.py").write_text("")
    assert unlisted_modules(tmp_path / "__init__.py") == ["forgotten.py"]


# ----- the README's layout table, checked as the package indexes are -----


def readme_layout(readme: Path) -> dict[str, str]:
    """The rows of the README's "How it is organised" table: the "where" cell -> the "what" cell."""
    rows = {}
    for line in readme.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`") and (cells[0].endswith("/`") or cells[0].endswith(".py`")):
            rows[cells[0]] = cells[1]
    return rows


def layout_table_faults(readme: Path, root: Path) -> list[str]:
    """What the table gets wrong about the package at `root`: a package without its row, a module its row
    does not name, a named module that does not exist, a top-level module no row names."""
    rows = readme_layout(readme)
    faults = []
    for pkg in sorted(p for p in root.iterdir() if (p / "__init__.py").exists()):
        what = rows.get(f"`{pkg.name}/`")
        if what is None:
            faults.append(f"{pkg.name}/: no row")
            continue
        have = {p.name for p in pkg.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
        faults += [f"{pkg.name}/{m}: not named in its row" for m in sorted(have) if f"`{m}`" not in what]
        named = set(re.findall(r"`(\w+\.py)`", what))
        faults += [f"{pkg.name}/{m}: named, but no such module" for m in sorted(named - have)]
    where = " ".join(w for w in rows if w.endswith(".py`") or ".py`," in w)
    top = sorted(p.name for p in root.glob("*.py") if p.name != "__init__.py")
    faults += [f"{m}: no row names it" for m in top if f"`{m}`" not in where]
    return faults


def test_readme_layout_table_names_every_package_and_module():
    assert layout_table_faults(REPO_ROOT / "README.md", PKG_ROOT) == []


def test_layout_table_check_catches_a_missing_row_and_a_stale_name(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "a").mkdir(parents=True)
    for f in ("a/__init__.py", "a/one.py", "a/two.py", "errors.py"):
        (pkg / f).write_text("")
    (pkg / "b").mkdir()
    (pkg / "b" / "__init__.py").write_text("")
    readme = tmp_path / "README.md"
    readme.write_text("| where | what |\n|---|---|\n| `errors.py` | errors |\n| `a/` | `one.py` x; `gone.py` y |\n")
    assert layout_table_faults(readme, pkg) == [
        "a/two.py: not named in its row",
        "a/gone.py: named, but no such module",
        "b/: no row",
    ]


# files the code writes, named in docstrings as outputs, not cited as sources
# files the program writes (not sources to find), and modules that cite other projects' source files
WRITTEN_FILES = {"report.md", "concurrency.md", "server.md", "generate.py", "custom_generate/generate.py"}
CITES_OTHER_PROJECTS = {"export/contracts.py", "export/plan.py"}  # SGLang/vLLM/speculators/SpecForge file:line


def cited_files_missing(path: Path) -> list[str]:
    """Names like docs/x.md, tests/test_y.py or store.py in a source file that exist nowhere they could mean."""
    missing = []
    for m in re.finditer(r"(?<![\w./-])(?:[A-Za-z_][\w-]*/)*[A-Za-z_][\w-]*\.(?:md|py|sh)\b", path.read_text()):
        name = m.group(0)
        for prefix in ("DIR/", "OUT/"):  # placeholders for a user's directory
            name = name.removeprefix(prefix)
        where = [REPO_ROOT / name, PKG_ROOT / name, path.parent / name]
        if name not in WRITTEN_FILES and not any(w.exists() for w in where):
            missing.append(name)
    return missing


def test_no_source_file_cites_a_file_that_does_not_exist():
    missing = {
        str(p.relative_to(PKG_ROOT)): cited_files_missing(p)
        for p in sorted(PKG_ROOT.rglob("*.py"))
        if str(p.relative_to(PKG_ROOT)) not in CITES_OTHER_PROJECTS
    }
    assert {p: m for p, m in missing.items() if m} == {}


def test_citation_check_catches_a_missing_file(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""See KERNELS.md and tests/test_layout.py."""\n')
    assert cited_files_missing(f) == ["KERNELS.md"]


# ----- the tests' own shape -----

TESTS_ROOT = REPO_ROOT / "tests"


def imported_top_names(path: Path) -> set[str]:
    """Top-level names of everything a test file imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_no_test_module_imports_another():
    """Shared test code lives in conftest.py; a test module importing another runs its tests' imports and
    ties two files together. (A subprocess script that imports conftest is not a test module.)"""
    local = {p.stem for p in TESTS_ROOT.glob("*.py")} - {"conftest"}
    assert {"conftest", "dominospec"} <= imported_top_names(TESTS_ROOT / "test_core.py")  # control: imports are read
    offenders = {p.name: sorted(imported_top_names(p) & local) for p in sorted(TESTS_ROOT.glob("test_*.py"))}
    assert {name: mods for name, mods in offenders.items() if mods} == {}


def test_no_module_outside_targets_reaches_into_the_native_forward():
    """Slot decoders ask the Target (new_row_cache, forward_rows, row_bytes_per_position, ...), never its
    `.native` forward: the target package owns how its rows are laid out."""
    reaching = sorted(
        name
        for name, path in modules().items()
        if not name.startswith("dominospec.targets")
        and any(isinstance(n, ast.Attribute) and n.attr == "native" for n in ast.walk(ast.parse(path.read_text())))
    )
    assert reaching == [], f"modules reading target.native: {reaching}"
