"""Optimizer factory (torch, bitsandbytes 8-bit, Adafactor, DeepSpeed placeholders), the LR schedule, and what a
resume keeps of them: the checkpoint's moments and step, this run's hyperparameters."""

from __future__ import annotations

import argparse
from contextlib import contextmanager

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from common.flags import check_warmup
from common.upstream import prepared_optimizers_and_schedulers, set_last_lr


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


def create_optimizer_and_scheduler(args: argparse.Namespace, model: nn.Module, accelerator, total_steps: int):
    """The optimizer and LR schedule, both counted in optimizer steps.

    When a DeepSpeed JSON defines its own `optimizer`/`scheduler` block, accelerate's Dummy placeholders stand in
    for them (a real torch optimizer next to a JSON optimizer raises inside DeepSpeed).
    """
    from accelerate.utils import DummyOptim, DummyScheduler
    from transformers import get_scheduler

    warmup = args.warmup_steps if args.warmup_steps is not None else int(0.05 * total_steps)
    check_warmup(warmup, total_steps)
    plugin = accelerator.state.deepspeed_plugin
    ds_config = plugin.deepspeed_config if plugin is not None else {}
    if "optimizer" in ds_config:
        optimizer = DummyOptim(param_groups(model, args.weight_decay), lr=args.learning_rate,
                               weight_decay=args.weight_decay)
    else:
        optimizer = create_optimizer(args, model)
    if "scheduler" in ds_config:
        return optimizer, DummyScheduler(optimizer, total_num_steps=total_steps, warmup_num_steps=warmup)
    extra = {"scheduler_specific_kwargs": {"min_lr_rate": 0.1}} if args.lr_scheduler_type == "cosine_with_min_lr" \
        else {}

    def schedule(opt):
        return get_scheduler(args.lr_scheduler_type, opt, num_warmup_steps=warmup, num_training_steps=total_steps,
                             **extra)

    if isinstance(optimizer, DummyOptim):  # the optimizer only exists inside DeepSpeed: build the schedule there
        return optimizer, DummyScheduler(optimizer, lr_scheduler_callable=schedule)
    return optimizer, schedule(optimizer)


# Optimizer settings that `load_state_dict` restores from a checkpoint along with the moments; a resume puts back the
# values this run's flags gave (--weight_decay, --adam_beta1/2, --adam_epsilon; initial_lr is --learning_rate).
FLAG_SETTINGS = ("weight_decay", "betas", "eps", "initial_lr")


@contextmanager
def keep_this_runs_hyperparameters(accelerator):
    """Around `accelerator.load_state`: what the flags set survives the restore; the state is the checkpoint's. A
    checkpoint restores the optimizer's moments and step and the schedule's step, but also its settings: each
    parameter group's weight decay, betas and eps, the schedule's peak learning rate (`base_lrs`) and, under
    DeepSpeed ZeRO-1/2, the gradient clipping. Left so, a resume with a new --learning_rate or --weight_decay would
    train with the old values without a word. Here they are taken before the restore (the optimizer and schedule were
    just built from the flags) and put back after it, and each group's current learning rate is recomputed from this
    run's schedule at the checkpoint's step: the schedule's shape (type, warmup, length) is always this run's, since
    a checkpoint does not hold it. Unchanged flags give the same values, bit for bit.
    """
    optimizers, schedulers = prepared_optimizers_and_schedulers(accelerator)
    settings = [[{k: group[k] for k in FLAG_SETTINGS if k in group} for group in o.param_groups] for o in optimizers]
    clipping = [getattr(o, "clip_grad", None) for o in optimizers]  # DeepSpeed ZeRO-1/2 restore it
    peaks = [list(s.base_lrs) if isinstance(s, LambdaLR) else None for s in schedulers]
    yield
    for optimizer, groups, clip in zip(optimizers, settings, clipping):
        for group, values in zip(optimizer.param_groups, groups):
            group.update(values)
        if clip is not None:
            optimizer.clip_grad = clip
    for scheduler, peak in zip(schedulers, peaks):
        if peak is not None:  # this run's schedule at the checkpoint's step, from this run's peak
            scheduler.base_lrs = peak
            lrs = [base * lmbda(scheduler.last_epoch) for lmbda, base in zip(scheduler.lr_lambdas, peak)]
            for group, lr in zip(scheduler.optimizer.param_groups, lrs):
                group["lr"] = lr
            set_last_lr(scheduler, lrs)
