"""The code stays readable as it grows: scripts/ holds only the recipes, imports point one way, and no function hides
a loop in hundreds of lines.

Layout: scripts/ (the recipes users copy), common/ (what they share), and the tools around them, each a package
named for what it is: benchmarks/, tools/, gpu_suite/. Tools import each other by package path
(`from benchmarks import benchmark`) with the repository root on sys.path; a bare `import benchmark` works only when
some code has put a tool's folder on sys.path, which hides what depends on what, so it fails here.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {"pretrain_llama.py", "finetune_causal_lm.py", "finetune_classifier.py", "finetune_dpo.py",
           "finetune_grpo.py", "finetune_vlm.py"}
TOOL_PACKAGES = ("benchmarks", "tools", "gpu_suite")
FOLDERS = ("common", "scripts") + TOOL_PACKAGES
SOURCES = sorted(path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py"))
MODULES = SOURCES + sorted((ROOT / "tests").glob("*.py"))  # what must not import a recipe or use a bare name
# The name a bare import of a file of these folders would use: `import pretrain_llama`, `from benchmark import x`.
BARE_NAMES = {path.stem: path.relative_to(ROOT) for folder in ("scripts",) + TOOL_PACKAGES
              for path in (ROOT / folder).glob("*.py") if path.stem not in ("__init__", "__main__")}
MAX_FUNCTION_LINES = 90


def _imports(path: Path) -> set[str]:
    """Every module the file imports, type-checking-only and function-level imports included; relative imports
    resolved against the file's package."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            package = path.parent.name if node.level else ""
            names.add(".".join(part for part in (package, node.module) if part))
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def _project_imports(path: Path) -> set[str]:
    """The imports of this project's code: by package path (`common.flags`, `gpu_suite.suite`) or by a bare name."""
    return {name for name in _imports(path) if name.split(".")[0] in FOLDERS or name.split(".")[0] in BARE_NAMES}


def test_common_modules_import_each_other_without_a_cycle():
    graph = {f"common.{p.stem}": _project_imports(p) for p in (ROOT / "common").glob("*.py")}
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


def test_common_imports_nothing_outside_common():
    outside = {f"{path.relative_to(ROOT)} imports {name}" for path in (ROOT / "common").glob("*.py")
               for name in _project_imports(path) if name.split(".")[0] != "common"}
    assert not outside, f"common/ holds what the recipes share and depends on nothing else here: {sorted(outside)}"


def test_no_module_imports_a_recipe():
    recipes = {"scripts"} | {Path(name).stem for name in RECIPES}  # by package path or by a bare name
    found = sorted(f"{path.relative_to(ROOT)} imports {name}" for path in MODULES for name in _imports(path)
                   if name.split(".")[0] in recipes)
    assert not found, f"a recipe is read and copied, never imported: shared code belongs in common/: {found}"


def test_no_module_imports_a_tool_by_a_bare_name():
    found = sorted(f"{path.relative_to(ROOT)} imports {name} ({BARE_NAMES[name.split('.')[0]]})" for path in MODULES
                   for name in _imports(path) if name.split(".")[0] in BARE_NAMES)
    assert not found, f"import these by their package path (from benchmarks import benchmark), after putting the " \
                      f"repository root on sys.path: {found}"


def test_scripts_holds_only_the_recipes():
    files = {p.name for p in (ROOT / "scripts").iterdir() if p.name != "__pycache__"}
    assert files == RECIPES, f"scripts/ is for the recipes users copy; tools go to {', '.join(TOOL_PACKAGES)}: " \
                             f"{sorted(files - RECIPES)}"


RECIPE_MAX_LINES = 500


def test_each_recipe_reads_in_one_sitting():
    too_long = {name: n for name in sorted(RECIPES) if (n := len((ROOT / "scripts" / name).read_text().splitlines()))
                > RECIPE_MAX_LINES}
    assert not too_long, f"a recipe is read top to bottom: at most {RECIPE_MAX_LINES} lines, move shared code to " \
                         f"common/ and options to common/features/: {too_long}"


def test_tool_folders_are_packages_that_say_what_they_are():
    for folder in TOOL_PACKAGES:
        init = ROOT / folder / "__init__.py"
        assert init.is_file(), f"{folder}/ needs an __init__.py (imported as a package)"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{folder}/__init__.py: say what the folder is"


def test_no_function_is_longer_than_a_screenful_or_two():
    too_long = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}() {lines} lines")
    assert not too_long, f"split these up (at most {MAX_FUNCTION_LINES} lines each): {too_long}"


COMMAND_LINES = ("scripts/pretrain_llama.py", "scripts/finetune_causal_lm.py", "scripts/finetune_classifier.py",
                 "scripts/finetune_dpo.py", "scripts/finetune_grpo.py", "scripts/finetune_vlm.py",
                 "benchmarks/benchmark.py", "benchmarks/plain_loop.py", "benchmarks/profile_step.py",
                 "tools/estimate_memory.py", "gpu_suite/cli.py")


@pytest.mark.parametrize("path", COMMAND_LINES)
def test_every_flag_has_a_help_line(path, monkeypatch):
    """`--help` is what a newcomer meets first: every flag says what it does (argparse adds its default)."""
    import argparse
    import importlib.util
    import sys

    parsers = []

    def record(self, *args, **kwargs):
        parsers.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", record)
    monkeypatch.syspath_prepend(str(ROOT))
    spec = importlib.util.spec_from_file_location(f"cli_{Path(path).stem}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    argv = ["--", str(ROOT / "scripts" / "pretrain_llama.py")] if path.endswith("profile_step.py") else []
    monkeypatch.setattr(sys, "argv", [path, *argv])
    with pytest.raises(SystemExit):
        module.parse_args(argv) if argv else module.parse_args()
    (parser,) = parsers
    bare = [a.option_strings[0] for a in parser._actions if a.option_strings and a.help in (None, "")]
    assert not bare, f"{path}: flags without a help line: {bare}"


CORE = sorted((ROOT / "common").glob("*.py"))  # the modules directly in common/
TIERS = ("common.inputs", "common.features")
# The core (common/*.py) holds what every loop needs and nothing optional, in at most 1,500 lines.
CORE_MAX_LINES = 1500


def test_the_core_imports_no_tier_and_inputs_import_no_feature():
    found = [f"{p.relative_to(ROOT)} imports {name}" for p in CORE for name in _project_imports(p)
             if name.startswith(TIERS)]
    found += [f"{p.relative_to(ROOT)} imports {name}" for p in (ROOT / "common" / "inputs").glob("*.py")
              for name in _project_imports(p) if name.startswith("common.features")]
    assert not found, f"a feature reaches the core through what the recipe passes, never by an import: {found}"


def test_the_core_stays_small():
    lines = sum(len(p.read_text().splitlines()) for p in CORE)
    assert lines <= CORE_MAX_LINES, f"common/*.py holds {lines} lines; move what is optional into a tier"


# The data path reads the flags in one function per path (docs/mixtures.md, "The data path"); its stages take plain
# values. The functions of its modules that may take `args`: these, and those that add or check flags.
FLAG_READERS = {"common/inputs/data.py": {"from_flags", "get_tokenizer"},
                "common/inputs/mixture.py": {"read_sources", "load_mixed_blocks"},
                "common/features/streaming.py": {"load_streaming_data", "stream_tokenizer"}}


def test_the_data_stages_take_plain_values_not_the_flags():
    found = [f"{path}: {node.name}" for path, readers in FLAG_READERS.items()
             for node in ast.walk(ast.parse((ROOT / path).read_text()))
             if isinstance(node, ast.FunctionDef) and node.name not in readers
             and not node.name.startswith(("add_", "check_")) and "args" in [a.arg for a in node.args.args]]
    assert not found, f"a data stage reads the flags (give it the values it needs): {found}"


def test_readme_states_the_common_lines_each_recipe_imports():
    """The README's "Copy and adapt" table is measured: the lines of common/ each recipe imports, with its features
    and without them (tools/copy_recipe.py)."""
    from tools.copy_recipe import common_lines, strip_features

    readme = (ROOT / "README.md").read_text()
    for recipe in sorted(RECIPES):
        source = (ROOT / "scripts" / recipe).read_text()
        row = f"| `{recipe}` | {common_lines(source):,} | {common_lines(strip_features(source)):,} |"
        assert row in readme, f"README.md: the Copy and adapt table should have the row {row}"


def test_the_fast_tier_names_tests_that_exist():
    """tests/conftest.py's FAST list (the `-m "not slow"` tier) names test files and functions that exist."""
    from conftest import FAST

    for name, tests in FAST.items():
        path = ROOT / "tests" / name
        assert path.is_file(), f"FAST names {name}, which does not exist"
        if tests != "*":
            defined = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
            assert not tests - defined, f"FAST names tests {sorted(tests - defined)} that {name} does not define"
