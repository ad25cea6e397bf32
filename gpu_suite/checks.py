"""What every row checks of a finished run: losses logged and finite (and falling), the export loads and works."""

from __future__ import annotations

import json
import math
import os
import threading

import torch

from gpu_suite.suite import FAIL, PASS, Outcome, Run

def loss_problems(run: Run, steps: int, falling: bool = True) -> list[str]:
    """Every step logged, every loss finite, and (when asked) the last loss below the first."""
    losses = run.losses
    if len(losses) != steps:
        return [f"{len(losses)} of {steps} steps logged"]
    if not all(math.isfinite(x) for x in losses):
        return [f"non-finite loss {losses}"]
    if falling and not losses[-1] < losses[0]:
        return [f"loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})"]
    return []


_EXPORT_LOCK = threading.Lock()  # transformers' lazy imports are not thread-safe


def export_problems(out: str, head: str = "causal_lm") -> list[str]:
    """The exported folder loads as a user would load it, with every weight, and gives finite logits."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the suite's output is its progress lines and the table
    cls = AutoModelForCausalLM if head == "causal_lm" else AutoModelForSequenceClassification
    with _EXPORT_LOCK:
        try:
            model, info = cls.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(out)
        except Exception as e:  # noqa: BLE001 - any failure to load is the finding
            return [f"export does not load: {type(e).__name__}: {str(e)[:200]}"]
        bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if bad:
            return [f"export keys: {json.dumps(bad)[:200]}"]
        with torch.no_grad():
            logits = model(**tokenizer("the model reads a great film", return_tensors="pt")).logits
    return [] if torch.isfinite(logits).all() else ["the exported model gives non-finite logits"]


def verdict(problems: list[str], figure: str, detail: dict | None = None) -> Outcome:
    return Outcome(FAIL, "; ".join(problems), detail or {}) if problems else Outcome(PASS, figure, detail or {})


def loss_figure(run: Run) -> str:
    losses = run.losses
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps"


def weight_distance(a: str, b: str) -> float:
    """||wa - wb|| / ||wa|| over all exported weights."""
    from safetensors.torch import load_file

    wa, wb = (load_file(os.path.join(d, "model.safetensors")) for d in (a, b))
    diff = sum(float((wa[k].double() - wb[k].double()).pow(2).sum()) for k in wa)
    return math.sqrt(diff / sum(float(v.double().pow(2).sum()) for v in wa.values()))
