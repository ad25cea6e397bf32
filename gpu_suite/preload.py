"""Imported once by the fork server (gpu_suite/runner.py): the recipes' import statements, done for every fork.

Only the top-level `import` / `from ... import` statements of the recipes run here, in their order, as the
recipes would run them (a `from transformers import AutoModelForCausalLM` loads that lazy class too); the recipes
themselves are never imported, and none of their other code runs.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = [os.path.join(ROOT, "scripts", f"{name}.py") for name in
           ("pretrain_llama", "finetune_causal_lm", "finetune_classifier")]


def import_statements(path: str) -> ast.Module:
    """The file's top-level import statements (`from __future__` left out: it only means something in its file)."""
    with open(path, encoding="utf-8") as f:
        body = ast.parse(f.read(), path).body
    imports = [node for node in body if isinstance(node, ast.Import)
               or (isinstance(node, ast.ImportFrom) and node.module != "__future__")]
    return ast.Module(body=imports, type_ignores=[])


for _recipe in RECIPES:
    exec(compile(import_statements(_recipe), _recipe, "exec"), {"__name__": "gpu_suite.preload"})
