"""Liger kernels (`--use_liger_kernel`, the TrainingArguments name): liger-kernel's Triton kernels patched into a
causal LM of a family it supports, picked by `config.model_type` (liger's own table, `MODEL_TYPE_TO_APPLY_LIGER_FN`:
Llama, Mistral, Mixtral, Qwen2/3, Gemma, Phi-3, ... in 0.8.5). CUDA only; docs/techniques.md#liger-kernels.

What is patched: liger's defaults for the family (rope, RMSNorm, SwiGLU or Gemma's GeGLU) and, where the recipe's
loss is the token loss (pretraining, SFT), its fused linear cross-entropy: the head's matmul and the loss run chunk by
chunk, the logits are never materialised and the head's gradient is computed in the forward. That forward (0.8.5,
`lce_forward` in training mode with labels) sums the token losses (`reduction="sum"`, fp32) and divides by
`num_items_in_batch` when given, as transformers' `ForCausalLMLoss` does, so `common/accumulation.py`'s exact
normalisation holds; in eval mode (evaluation, the accumulation probe) it computes the logits and transformers' loss.

DPO needs each row's log-probability, not a mean loss: there only rope, RMSNorm and SwiGLU are patched (the logits,
or `--chunked_cross_entropy`'s rows, are computed as without Liger). liger's fused DPO loss is not used: the recipe's
loss types, reference and metrics are its own.

The rope function and the layer classes are replaced in the family's modeling module, so every model built later in
the process gets them too, a CPU one included, which Triton cannot run: `undo_liger_kernel` puts them back once the
trained model is done (pretrain_llama.py's sample is generated on the CPU).

Not pinned in requirements.txt: it needs Triton (about 1 GB installed, of no use on a CPU); CUDA builds of torch ship
Triton, so `pip install liger-kernel==0.8.5` is all a GPU machine needs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
from transformers import PretrainedConfig, PreTrainedModel

from common.errors import fail
from common.features.compile import deepspeed_zero_stage

INSTALL = "pip install liger-kernel==0.8.5"  # the version checked here (docs/techniques.md#liger-kernels)
_patched: list[tuple[object, dict]] = []  # (a patched module or class, its attributes before the first patch)


def add_liger_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument_group("Liger kernels").add_argument(
        "--use_liger_kernel", action="store_true",
        help=f"Liger's Triton kernels: rope, RMSNorm, SwiGLU, fused linear cross-entropy (CUDA; {INSTALL}).")


def check_liger_kernel(config: PretrainedConfig, fused_loss: bool, chunked_cross_entropy: bool = False) -> None:
    """One line before any work for what Liger cannot serve. `fused_loss`: the recipe's loss is the token loss, which
    liger's fused linear cross-entropy computes."""
    if not torch.cuda.is_available():
        fail("--use_liger_kernel: Liger's Triton kernels run on CUDA GPUs only, and this machine has none")
    if fused_loss and chunked_cross_entropy:
        fail("--use_liger_kernel and --chunked_cross_entropy both compute the loss without the full logits: pick one")
    if fused_loss and deepspeed_zero_stage() == 3:
        fail("--use_liger_kernel under DeepSpeed ZeRO-3: liger's fused loss reads the head's weight outside the head's "
             "forward, where ZeRO-3 leaves an empty partition; use ZeRO-2 or FSDP2 (accelerate_configs/fsdp2.yaml)")
    liger_patch(config.model_type, liger_table())


def liger_table() -> dict[str, Callable]:
    """liger's model type -> patch function (imports liger-kernel and Triton)."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as e:
        fail(f"--use_liger_kernel needs liger-kernel and Triton ({e}): {INSTALL}")
    return MODEL_TYPE_TO_APPLY_LIGER_FN


def liger_patch(model_type: str, table: dict[str, Callable]) -> Callable:
    """The patch function for `model_type`, or one line naming the types liger has one for."""
    if model_type not in table:
        fail(f"--use_liger_kernel: liger-kernel has no kernels for model type {model_type}; it has them for "
             f"{', '.join(sorted(table))}")
    return table[model_type]


def use_liger_kernel(model: PreTrainedModel, fused_loss: bool) -> None:
    """Patch `model` (checked by `check_liger_kernel`; before any wrapping: peft, activation memory, compile,
    accelerate.prepare) with liger's defaults, its fused linear cross-entropy only with `fused_loss`. The state
    dict's keys do not change."""
    patch = liger_patch(model.config.model_type, liger_table())
    module = sys.modules[type(model).__module__]
    for target in (module, type(model)):  # what liger replaces besides the instance
        if not any(patched is target for patched, _ in _patched):
            _patched.append((target, dict(vars(target))))
    patch(model=model, fused_linear_cross_entropy=fused_loss)


def undo_liger_kernel() -> None:
    """Put back what liger replaced in the modeling modules and classes; models patched already keep their kernels.
    Nothing without --use_liger_kernel."""
    while _patched:
        target, before = _patched.pop()
        for name, value in before.items():
            if vars(target).get(name) is not value:
                setattr(target, name, value)
