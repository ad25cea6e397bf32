"""What the preference and reinforcement recipes (DPO, GRPO) share about a policy and its frozen reference: the
log-probability of each response token, the frozen copy of the pretrained model, the reference's forward (that copy,
or the policy with its LoRA adapter disabled), and dropout off."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from common.inputs.modeling import build_causal_lm


def token_logps(model, batch: dict, temperature: float = 1.0, with_entropy: bool = False, first: int = 0):
    """Per row and position t >= `first`: the log-probability of token t + 1 where `labels` keeps it (0 where it is
    -100), in fp32, from logits divided by `temperature` (GRPO scores a completion under the distribution it was
    sampled from). `first` > 0: the model computes the logits of those positions only (`logits_to_keep`: a GRPO
    prompt's positions predict nothing to learn). `position_ids`, when the batch has them, place left-padded rows.
    With `with_entropy`: also each position's entropy of that distribution."""
    targets = batch["labels"][:, first + 1:]  # position t predicts token t + 1
    keep = {"logits_to_keep": batch["input_ids"].shape[1] - first} if first else {}
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch.get("position_ids"), use_cache=False, **keep).logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logps = -F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")
    if not with_entropy:
        return logps
    with torch.no_grad():
        log_probs = logits.log_softmax(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logps, entropy


def sequence_logps(model, batch: dict, chunked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the log-probability of its response tokens, summed, and their number (fp32). `chunked`: from the
    chunked head (--chunked_cross_entropy), without the batch x sequence x vocabulary logits."""
    counts = (batch["labels"][:, 1:] != -100).sum(1)
    if chunked:
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                     per_row_logps=True, use_cache=False).logps, counts
    return token_logps(model, batch).sum(1), counts


def frozen_copy(args: argparse.Namespace, config, vocab_size: int):
    """A second copy of the pretrained model (never a deep copy of the policy: under ZeRO-3 and FSDP2 that copies
    shards and hooks), frozen and in eval mode, in fp32 (mixed precision autocasts it as the policy)."""
    unchecked = argparse.Namespace(**{**vars(args), "gradient_checkpointing": False})  # no backward through it
    reference = build_causal_lm(unchecked, config, vocab_size, dtype=torch.float32)
    reference.requires_grad_(False)
    reference.eval()
    return reference


def reference_forward(accelerator, model, reference, logps: Callable[[torch.nn.Module, dict], torch.Tensor]):
    """batch -> `logps(reference, batch)` without gradient, in eval mode and the run's precision; `reference` None:
    the policy with its LoRA adapter disabled (the frozen base), left in the mode it was in."""
    def forward(batch: dict) -> torch.Tensor:
        with torch.no_grad():
            if reference is not None:
                with accelerator.autocast():
                    return logps(reference, batch)
            module = accelerator.unwrap_model(model)
            was_training = module.training
            module.eval()
            with module.disable_adapter(), accelerator.autocast():
                values = logps(module, batch)
            module.train(was_training)
            return values
    return forward


def disable_dropout(model) -> None:
    """Dropout off (TRL's DPO default; its GRPO keeps dropout unless `disable_dropout`): every nn.Dropout, and the
    rates attention layers read from their own attributes (e.g. Llama's `attention_dropout`)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
