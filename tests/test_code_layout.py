"""The code stays readable as it grows: imports point one way and no function hides a loop in hundreds of lines."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "common").glob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))
MAX_FUNCTION_LINES = 100


def _imported_modules(path: Path) -> set[str]:
    """Every `common.*` / `scripts.*` module the file imports, type-checking-only imports included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name.split(".")[0] in ("common", "scripts")}


def test_common_modules_import_each_other_without_a_cycle():
    graph = {f"common.{p.stem}": _imported_modules(p) for p in (ROOT / "common").glob("*.py")}
    done, on_path = set(), []

    def visit(module: str) -> None:
        assert module not in on_path, f"import cycle: {' -> '.join(on_path[on_path.index(module):] + [module])}"
        if module in done:
            return
        on_path.append(module)
        for imported in graph.get(module, ()):
            visit(imported)
        on_path.pop()
        done.add(module)

    for module in graph:
        visit(module)


def test_no_module_imports_a_script():
    for path in SOURCES:
        imported = sorted(m for m in _imported_modules(path) if m.startswith("scripts"))
        assert not imported, f"{path.relative_to(ROOT)} imports {imported}: shared code belongs in common/"


def test_no_function_is_longer_than_a_screenful_or_two():
    too_long = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}() {lines} lines")
    assert not too_long, f"split these up (at most {MAX_FUNCTION_LINES} lines each): {too_long}"
