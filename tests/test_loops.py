"""The recipes keep one loop design: their training loops hold the same statements in the same order, except the
loss lines and what an evaluation computes (GRPO's loop also generates and scores each step's completions first); and
no explanatory comment is copied into all of them."""

from __future__ import annotations

import ast
import io
import tokenize
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ("pretrain_llama", "finetune_causal_lm", "finetune_classifier", "finetune_dpo", "finetune_grpo",
           "finetune_vlm")
# A statement mentioning one of these is a loss line: how a recipe turns a batch into its loss may differ. GRPO's
# rollouts (sample, score, advantages) make the window's batches: they belong to how it gets its loss.
LOSS_MARKERS = ("num_items", "outputs", "backward_loss", "window_loss +=", "loss = model(", "rollouts.window(")


def loop_statements(script: str) -> list[str]:
    """The statements of `train()`'s `for window in ...` loop, in order (compound ones by their header), without the
    loss lines and without the body of the evaluation block (its header, when to evaluate, is kept)."""
    tree = ast.parse((ROOT / "scripts" / f"{script}.py").read_text())
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    loop = next(n for n in ast.walk(train) if isinstance(n, ast.For) and ast.unparse(n.target) == "window")
    lines: list[str] = []

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, (ast.If, ast.With, ast.For)):
                header = ast.unparse(node).splitlines()[0]
                lines.append(header)
                if not header.startswith("if args.eval_steps"):
                    visit(node.body)
                    visit(node.orelse) if isinstance(node, ast.If) else None
            else:
                text = ast.unparse(node)
                if not any(marker in text for marker in LOSS_MARKERS):
                    lines.append(text)

    visit(loop.body)
    return lines


def test_the_training_loops_have_not_drifted_apart():
    reference = loop_statements(RECIPES[0])
    assert len(reference) > 20  # the loop was found and read whole
    for script in RECIPES[1:]:
        statements = loop_statements(script)
        assert statements == reference, (
            f"scripts/{script}.py's loop differs from scripts/{RECIPES[0]}.py's outside the loss lines: change all "
            f"recipes the same way.\n{script}: {statements}\n{RECIPES[0]}: {reference}")


def test_loop_drift_is_caught(tmp_path, monkeypatch):
    """The check above fails when one script's loop changes a shared statement (here: clipping is dropped)."""
    edited = tmp_path / "scripts"
    edited.mkdir()
    for script in RECIPES:
        source = (ROOT / "scripts" / f"{script}.py").read_text()
        if script == RECIPES[2]:
            source = source.replace("args.max_grad_norm or math.inf", "math.inf")
        (edited / f"{script}.py").write_text(source)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert loop_statements(RECIPES[2]) != loop_statements(RECIPES[0])


def comments(script: str) -> set[str]:
    source = (ROOT / "scripts" / f"{script}.py").read_text()
    return {token.string.lstrip("# ").strip() for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type == tokenize.COMMENT and len(token.string) > 12 and not token.string.startswith("#!")
            and not token.string.startswith("# feature: ")}  # the markers of a feature's lines (docs/layout.md)


def test_no_explanatory_comment_is_copied_into_all_the_recipes():
    counts = Counter(comment for script in RECIPES for comment in comments(script))
    copied = sorted(comment for comment, n in counts.items() if n == len(RECIPES))
    assert not copied, f"explain once (in scripts/{RECIPES[0]}.py or the common/ module), not in every recipe: {copied}"


def test_dpo_and_grpo_evaluations_show_a_progress_bar(capsys, monkeypatch):
    """DPO's and GRPO's final evaluations (a forward per pair; a generation per prompt) ran minutes with nothing on
    screen; each now has a bar over the held-out batches (gone once done), as the training steps have."""
    import sys
    import types

    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from transformers.modeling_outputs import ModelOutput

    sys.path.insert(0, str(ROOT / "tests"))
    from test_bad_inputs import load_script

    accelerator, model, batches = Accelerator(cpu=True), torch.nn.Linear(1, 1), [{}, {}, {}]
    dpo, grpo = load_script("finetune_dpo"), load_script("finetune_grpo")
    monkeypatch.setattr(dpo, "dpo_forward", lambda *a: ModelOutput(figures=torch.zeros(1, len(dpo.METRICS) + 1)))
    capsys.readouterr()
    assert dpo.evaluate_dpo(model, None, batches, accelerator, None)["eval_pairs"] == 3
    assert "eval:   0%|          | 0/3" in capsys.readouterr().err
    rollouts = types.SimpleNamespace(generate=lambda *a, **k: {"rewards": torch.ones(1, 1)}, weights=torch.ones(1),
                                     stop_on_reward_error=lambda: None, metrics=types.SimpleNamespace(names=["r"]),
                                     rewards=types.SimpleNamespace(trainer_state=types.SimpleNamespace(),
                                                                   logged_metrics=lambda *a: {}))
    assert grpo.evaluate_grpo(model, rollouts, batches, accelerator, types.SimpleNamespace(seed=0), 0)["eval_prompts"] == 3
    assert "eval:   0%|          | 0/3" in capsys.readouterr().err
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
