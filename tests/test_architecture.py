"""The package's shape: no import cycles between modules, small modules, each folder says what it is for."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mergekit_darts"
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, name: str):
    """Every mergekit_darts module ``path`` imports, at any level (function-local imports count too)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t.startswith("mergekit_darts"))
    return found


def _graph():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for target in _imports(path, name):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            # a package's __init__ is imported on the way to its submodules; it is not an edge of its own
            if target and target != name and not name.startswith(target + "."):
                edges.add(target)
        graph[name] = edges
    return graph


def test_no_import_cycles():
    graph = _graph()
    state, stack = {}, []

    def visit(node):
        state[node] = "active"
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == "active":
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_modules_are_small():
    too_long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
                if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not too_long, f"modules over {MAX_LINES} lines: {too_long}"


def test_each_folder_says_what_it_is_for():
    for init in PACKAGE.rglob("__init__.py"):
        docstring = ast.get_docstring(ast.parse(init.read_text()))
        assert docstring and docstring.strip(), f"{init.relative_to(PACKAGE)} has no docstring"


def test_library_modules_do_not_import_click_or_the_cli():
    """Errors become click errors only at the command line and in the mergekit hook."""
    allowed = ("mergekit_darts.cli", "mergekit_darts.hook", "mergekit_darts.errors")
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        if name.startswith(allowed):
            continue
        source = path.read_text()
        imported = _imports(path, name)
        assert not any(t.startswith("mergekit_darts.cli") for t in imported), name
        assert "import click" not in source and "from click" not in source, name


def test_no_module_imports_another_modules_private_name():
    """docs/design.md: a ``_name`` stays inside its module (a name another module needs is public)."""
    crossing = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("mergekit_darts")):
                crossing += [f"{path.relative_to(PACKAGE)}: {node.module}.{alias.name}" for alias in node.names
                             if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not crossing, crossing


def test_repair_imports_nothing_from_output():
    """repair/ runs before the export and below it: what both need (the weight-file reader) lives in
    ``mergekit_darts.weight_files``, below both."""
    crossing = []
    for path in (PACKAGE / "repair").rglob("*.py"):
        name = _module_name(path)
        crossing += [f"{name} -> {target}" for target in _imports(path, name)
                     if target == "mergekit_darts.output" or target.startswith("mergekit_darts.output.")]
    assert not crossing, crossing
