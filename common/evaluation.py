"""Held-out loss and perplexity of a causal LM, exact over all processes (token-weighted, no duplicates)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from accelerate import Accelerator


@torch.no_grad()
def evaluate_causal_lm(model, dataloader, accelerator: Accelerator) -> dict[str, float]:
    """Token-mean loss over the whole eval set and its perplexity. Per-example loss sums and token counts go through
    `gather_for_metrics`, which drops the examples a process repeated to even out the last batch, so the figure is
    the same for any number of processes and any padding."""
    model.eval()
    loss_sum, token_count = (torch.zeros((), dtype=torch.float64, device=accelerator.device) for _ in range(2))
    full_rows = None
    for batch in dataloader:
        labels = batch.pop("labels")
        full_rows = full_rows or len(labels)  # the outputs of the rows full_batch repeats are left out
        logits = model(**full_batch(batch, full_rows), use_cache=False).logits[:len(labels), :-1].float()
        targets = labels[:, 1:]
        per_token = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")
        sums, counts = accelerator.gather_for_metrics((per_token.sum(1), (targets != -100).sum(1)))
        loss_sum += sums.double().sum()
        token_count += counts.double().sum()
    model.train()
    eval_loss = (loss_sum / token_count.clamp(min=1)).item()
    return {"eval_loss": eval_loss, "perplexity": math.exp(min(eval_loss, 50.0)), "eval_tokens": int(token_count.item())}


def full_batch(batch: dict, rows: int) -> dict:  # compiled, a ragged last batch's size is a graph of its own
    missing = rows - len(next(iter(batch.values())))
    return {k: torch.cat([v, v[-1:].expand(missing, *v.shape[1:])]) for k, v in batch.items()} if missing > 0 else batch
