"""Imported once by the fork server (gpu_suite/runner.py): the recipes' import statements, done for every fork.

Only the top-level `import` / `from ... import` statements of the recipes run here, in their order, as the
recipes would run them (a `from transformers import AutoModelForCausalLM` loads that lazy class too); the recipes
themselves are never imported, and none of their other code runs. Then what they import inside functions:
transformers.optimization (get_scheduler; it imports peft and bitsandbytes, ~2 s a run) and, where the CPU
accelerator is named (DS_ACCELERATOR=cpu: it cannot look for a GPU), deepspeed (accelerate's unwrap_model, ~1 s);
and transformers' table of weight renamings, which its first save or load in a process builds.

Last, `gc.freeze()`: what was imported here stays alive in every fork, and the recipes' own `gc.collect()` calls
(common/lifecycle.py, accelerate's free_memory) would otherwise walk all of it, ~0.25 s each, twice a run.
"""

from __future__ import annotations

import ast
import gc
import importlib
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = [os.path.join(ROOT, "scripts", f"{name}.py") for name in
           ("pretrain_llama", "finetune_causal_lm", "finetune_classifier", "finetune_dpo",
            "finetune_grpo", "finetune_vlm")]


def import_statements(path: str) -> ast.Module:
    """The file's top-level import statements (`from __future__` left out: it only means something in its file)."""
    with open(path, encoding="utf-8") as f:
        body = ast.parse(f.read(), path).body
    imports = [node for node in body if isinstance(node, ast.Import)
               or (isinstance(node, ast.ImportFrom) and node.module != "__future__")]
    return ast.Module(body=imports, type_ignores=[])


for _recipe in RECIPES:
    exec(compile(import_statements(_recipe), _recipe, "exec"), {"__name__": "gpu_suite.preload"})
importlib.import_module("transformers.optimization")
if os.environ.get("DS_ACCELERATOR") == "cpu":
    importlib.import_module("deepspeed")
# transformers' table of checkpoint weight renamings, built on a run's first save or load (~0.2 s of regexes), then
# kept for the process: built here once
importlib.import_module("transformers.conversion_mapping").get_checkpoint_conversion_mapping("llama")
gc.freeze()
