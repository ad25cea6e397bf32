"""Sequence parallelism (`sp_size` in an accelerate config's `parallelism_config`, DeepSpeed's ALST/Ulysses): each
sequence is cut along its length over `sp_size` processes; attention swaps the sequence split for a split of the
heads (one all-to-all before and one after), everything else runs on the process's own slice of the tokens.

Wired into scripts/pretrain_llama.py. accelerate 1.15 registers the Ulysses attention when the model is prepared and
wraps every dataloader prepared with it; the recipe instead keeps its own prepared loaders (their epochs, resume
skips and evaluation stay as they are) and slices each optimizer step's micro-batches here, with DeepSpeed's own
`UlyssesSPDataLoaderAdapter`: every process's micro-batch is trained by the whole group in turn, so one optimizer step
still holds per-device batch x accumulation x processes sequences, as under DDP, and `common/accumulation.py`'s
token count and loss scale hold unchanged (the accumulation becomes accumulation x sp_size slices).

Only DeepSpeed serves it (accelerate's other backend, `cp_size` with FSDP2, is refused on CPU by accelerate itself,
see docs/techniques.md). The Ulysses attention discards the attention mask and keeps causality only: with sdpa,
examples packed into one row would attend to each other (measured), so a row must hold one sequence (pretraining's
blocks do) or the kernel must read the position ids (flash_attention_2).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from common.errors import fail

SUPPORTED_ATTENTION = ("sdpa", "flash_attention_2")


def sequence_parallel_size() -> int:
    """The launcher's `sp_size` (1: none). Read from `accelerate launch`'s variables, before any work."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return 1
    return int(os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1") or 1)


def check_sequence_parallel(args: argparse.Namespace, config, sequence_length: int) -> int:
    """One line before any work for what sequence parallelism cannot serve; returns sp_size (1: off)."""
    sp = sequence_parallel_size()
    if sp == 1:
        return 1
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        fail(f"sp_size {sp} needs a DeepSpeed config (accelerate_configs/deepspeed_sequence_parallel.yaml); "
             "accelerate 1.15 implements sequence parallelism with DeepSpeed's Ulysses only")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % sp:
        fail(f"sp_size {sp} does not divide the {world} processes")
    if sequence_length % sp:
        fail(f"sp_size {sp} does not divide the sequence length {sequence_length}: each process takes an equal slice")
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads is None or heads % sp:
        fail(f"sp_size {sp} does not divide the model's {heads} attention heads (Ulysses splits the heads)")
    if kv_heads % sp and sp % kv_heads:
        fail(f"sp_size {sp} and the model's {kv_heads} key/value heads do not divide one another")
    kernel = os.environ.get("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION", "None")
    if kernel not in SUPPORTED_ATTENTION or kernel != args.attn_implementation:
        fail(f"sequence parallelism needs parallelism_config_sp_attn_implementation equal to --attn_implementation, "
             f"one of {', '.join(SUPPORTED_ATTENTION)} (got {kernel} and {args.attn_implementation})")
    for flag in ("chunked_cross_entropy", "streaming", "torch_compile"):
        if getattr(args, flag, False):
            fail(f"--{flag} is not tested with sequence parallelism (sp_size {sp}); drop one of them")
    return sp


def refuse_sequence_parallel(recipe: str) -> None:
    """The recipes sequence parallelism is not wired into stop with one line."""
    if sequence_parallel_size() > 1:
        fail(f"sequence parallelism (sp_size {sequence_parallel_size()}) is wired into scripts/pretrain_llama.py "
             f"only, not {recipe}")


def accumulate_slices(accelerator) -> None:
    """Before `prepare`: each process's micro-batch is trained in sp_size slices, so an optimizer step accumulates
    accumulation x sp_size of them (DeepSpeed's gradient_accumulation_steps is filled from this)."""
    if sequence_parallel_size() > 1:
        accelerator.gradient_accumulation_steps *= sequence_parallel_size()


def unsliced(*dataloaders):
    """After `prepare`: the prepared loaders themselves, not accelerate's slicing wrappers (`.dl`), so epochs, resume
    skips and evaluation (which runs unsliced: accelerate turns the Ulysses attention off in eval mode) are as usual."""
    return tuple(getattr(d, "dl", d) if sequence_parallel_size() > 1 else d for d in dataloaders)


def slice_windows(windows: Iterator[list[dict]], accelerator) -> Iterator[list[dict]]:
    """Each optimizer step's micro-batches, cut into this process's sequence slices of every process's micro-batch
    (accumulation x sp_size slices). `labels` holds the slice's targets shifted right by one, so that
    `count_label_tokens` (which skips each row's first label) counts exactly the slice's targets; the model reads
    `shift_labels`, as transformers' loss does under sequence parallelism."""
    sp = sequence_parallel_size()
    if sp == 1:
        yield from windows
        return
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    from deepspeed.runtime.sequence_parallel.parallel_state_sp import get_sequence_parallel_group

    group = get_sequence_parallel_group()  # made by accelerate's prepare
    for window in windows:
        for batch in window:
            batch.pop("attention_mask", None)  # Ulysses keeps causality only (no padding in pretraining blocks)
            if "position_ids" not in batch:
                length = batch["input_ids"].shape[1]
                batch["position_ids"] = torch.arange(length, device=batch["input_ids"].device).expand_as(
                    batch["input_ids"])
        slices = UlyssesSPDataLoaderAdapter(window, sp_rank=torch.distributed.get_rank(group), sp_group=group,
                                            sp_world_size=sp, device=accelerator.device)
        sliced = []
        for piece in slices:
            piece = {k: v.to(accelerator.device).contiguous() if torch.is_tensor(v) else v for k, v in piece.items()}
            piece["labels"] = F.pad(piece["shift_labels"], (1, 0), value=-100)
            sliced.append(piece)
        yield sliced
