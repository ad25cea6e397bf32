#!/usr/bin/env python
"""Copy a recipe without the optional features you do not want: the lines marked `# feature: <name>` are removed
(a marked block header takes its block with it), and what is left still runs and trains as the original does
without those features' flags (tests/test_pretrain.py proves it for every recipe).

    python tools/copy_recipe.py scripts/finetune_causal_lm.py my_sft.py                 # every feature removed
    python tools/copy_recipe.py scripts/finetune_causal_lm.py my_sft.py --keep lora     # all but LoRA removed
    python tools/copy_recipe.py scripts/pretrain_llama.py --list                        # its features and lines

It also reports how many lines of `common/` the copy imports (its import closure), with and without the features.
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import sys
import tokenize

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.errors import fail  # noqa: E402
from common.flags import ArgumentParser  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "# feature: "


def feature_lines(source: str) -> dict[int, str]:
    """Line number -> feature name, for every line carrying a `# feature: <name>` comment."""
    return {token.start[0]: token.string[len(MARKER):].strip()
            for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type == tokenize.COMMENT and token.string.startswith(MARKER)}


def strip_features(source: str, keep: frozenset[str] = frozenset()) -> str:
    """`source` without the statements of its features (except `keep`): a simple statement with a marker on any of
    its lines, a compound one (if/for/with) with a marker on its header line, whole."""
    marked = {line: name for line, name in feature_lines(source).items() if name not in keep}
    drop: set[int] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            lines = range(node.lineno, node.end_lineno + 1)
            compound = hasattr(node, "body")
            if (node.lineno in marked) if compound else any(line in marked for line in lines):
                drop.update(lines)
                continue
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []))

    visit(ast.parse(source).body)
    kept = [line for number, line in enumerate(source.splitlines(keepends=True), 1) if number not in drop]
    copy = "".join(kept)
    ast.parse(copy)  # still a program
    return copy


def common_modules(source: str) -> set[str]:
    """Every `common` module the source imports, and what they import in turn (the copy's share of common/)."""
    seen: set[str] = set()
    todo = [source]
    while todo:
        for node in ast.walk(ast.parse(todo.pop())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if name.split(".")[0] == "common" and name not in seen:
                    path = module_path(name)
                    if path:
                        seen.add(name)
                        with open(path, encoding="utf-8") as f:
                            todo.append(f.read())
    return seen


def module_path(name: str) -> str | None:
    base = os.path.join(ROOT, *name.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def common_lines(source: str) -> int:
    """Lines of the `common/` modules (package __init__ files included) a program imports."""
    modules = common_modules(source)
    packages = {".".join(m.split(".")[:i]) for m in modules for i in range(1, m.count(".") + 1)}
    total = 0
    for name in modules | packages:
        with open(module_path(name), encoding="utf-8") as f:
            total += sum(1 for _ in f)
    return total


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe", help="The recipe to copy, e.g. scripts/pretrain_llama.py.")
    parser.add_argument("destination", nargs="?", help="Where to write the copy (None: only report).")
    parser.add_argument("--keep", nargs="*", default=[], help="Features to keep (names as in the markers).")
    parser.add_argument("--list", action="store_true", help="List the recipe's features and their line numbers.")
    return parser.parse_args(argv)


def read_recipe(args: argparse.Namespace) -> tuple[str, dict[str, int]]:
    """The recipe's source and its marked lines; a missing or non-Python recipe, or a destination that is the recipe
    itself (the copy would strip it in place), is one line."""
    if not os.path.isfile(args.recipe):
        fail(f"{args.recipe}: no such file")
    if not args.recipe.endswith(".py"):
        fail(f"{args.recipe}: not a Python file; give a recipe such as scripts/pretrain_llama.py")
    if args.destination and os.path.exists(args.destination) and os.path.samefile(args.recipe, args.destination):
        fail(f"the destination {args.destination} is the recipe itself: the copy would replace it; choose another path")
    try:
        with open(args.recipe, encoding="utf-8") as f:
            source = f.read()
        ast.parse(source)
        return source, feature_lines(source)
    except (UnicodeDecodeError, SyntaxError, ValueError, tokenize.TokenError) as e:
        fail(f"{args.recipe}: not a Python program ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e}); "
             "give a recipe such as scripts/pretrain_llama.py")


def main() -> None:
    args = parse_args()
    source, marked = read_recipe(args)
    features: dict[str, list[int]] = {}
    for line, name in marked.items():
        features.setdefault(name, []).append(line)
    unknown = set(args.keep) - set(features)
    if unknown:
        fail(f"--keep {' '.join(sorted(unknown))}: not a feature of {args.recipe} "
             f"(its features: {', '.join(sorted(features))})")
    if args.list:
        for name, lines in sorted(features.items()):
            print(f"{name}: lines {', '.join(map(str, lines))}")
    copy = strip_features(source, frozenset(args.keep))
    print(f"{args.recipe}: imports {common_lines(source)} lines of common/; the copy imports {common_lines(copy)} "
          f"(kept: {', '.join(args.keep) or 'no feature'})")
    if args.destination:
        try:
            with open(args.destination, "w", encoding="utf-8") as f:
                f.write(copy)
        except OSError as e:
            fail(f"cannot write the copy to {args.destination}: {e.strerror or e}")


if __name__ == "__main__":
    main()
