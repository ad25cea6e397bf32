"""Optimizer factory (torch, bitsandbytes 8-bit, Adafactor, DeepSpeed placeholders) and the LR schedule, counted in
optimizer steps."""

from __future__ import annotations

import argparse

import torch
from torch import nn

from common.flags import check_warmup


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: biases and norm weights (the 1-D parameters) are not decayed.

    Under DeepSpeed ZeRO-3 a parameter built partitioned is an empty 1-D tensor; `ds_shape` keeps its real shape.
    An empty group is left out (a LoRA adapter has only matrices): DeepSpeed drops it, and the schedule built on the
    groups would then count one group too many.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    is_matrix = {id(p): len(getattr(p, "ds_shape", p.shape)) >= 2 for p in params}
    groups = [
        {"params": [p for p in params if is_matrix[id(p)]], "weight_decay": weight_decay},
        {"params": [p for p in params if not is_matrix[id(p)]], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def create_optimizer(args: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(model, args.weight_decay)
    betas = (args.adam_beta1, args.adam_beta2)
    if args.optim in ("adamw_torch", "adamw_torch_fused"):
        return torch.optim.AdamW(groups, lr=args.learning_rate, betas=betas, eps=args.adam_epsilon,
                                 fused=args.optim == "adamw_torch_fused")
    if args.optim in ("adamw_8bit", "paged_adamw_8bit"):
        import bitsandbytes as bnb

        # Embedding rows see rare, spiky updates that 8-bit state quantises badly: keep their state in 32 bits.
        manager = bnb.optim.GlobalOptimManager.get_instance()
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                manager.register_module_override(module, "weight", {"optim_bits": 32})
        cls = bnb.optim.PagedAdamW8bit if args.optim == "paged_adamw_8bit" else bnb.optim.AdamW8bit
        return cls(groups, lr=args.learning_rate, betas=betas, eps=args.adam_epsilon)
    from transformers.optimization import Adafactor  # --optim adafactor (the flag's choices allow no other)

    return Adafactor(groups, lr=args.learning_rate, scale_parameter=False, relative_step=False, warmup_init=False)


def create_optimizer_and_scheduler(args: argparse.Namespace, model: nn.Module, accelerator, total_steps: int,
                                   create=None, schedule_kwargs: dict | None = None):
    """The optimizer and LR schedule, both counted in optimizer steps. A feature may pass its optimizer's factory
    (`create(args, model)`, else `create_optimizer`; it may return a `DummyOptim`) and its schedule's extra arguments
    (`schedule_kwargs`).

    When a DeepSpeed JSON defines its own `optimizer`/`scheduler` block, accelerate's Dummy placeholders stand in
    for them (a real torch optimizer next to a JSON optimizer raises inside DeepSpeed).
    """
    from accelerate.utils import DummyOptim, DummyScheduler
    from transformers import get_scheduler

    warmup = args.warmup_steps if args.warmup_steps is not None else int(0.05 * total_steps)
    check_warmup(warmup, total_steps)
    plugin = accelerator.state.deepspeed_plugin
    ds_config = plugin.deepspeed_config if plugin is not None else {}
    if "optimizer" in ds_config and create is None:
        optimizer = DummyOptim(param_groups(model, args.weight_decay), lr=args.learning_rate,
                               weight_decay=args.weight_decay)
    else:
        optimizer = (create or create_optimizer)(args, model)
    if "scheduler" in ds_config:
        return optimizer, DummyScheduler(optimizer, total_num_steps=total_steps, warmup_num_steps=warmup)
    extra = {"min_lr_rate": 0.1} if args.lr_scheduler_type == "cosine_with_min_lr" else dict(schedule_kwargs or {})

    def schedule(opt):
        return get_scheduler(args.lr_scheduler_type, opt, num_warmup_steps=warmup, num_training_steps=total_steps,
                             scheduler_specific_kwargs=extra)

    if isinstance(optimizer, DummyOptim):  # the optimizer only exists inside DeepSpeed: build the schedule there
        return optimizer, DummyScheduler(optimizer, lr_scheduler_callable=schedule)
    return optimizer, schedule(optimizer)
