"""Less activation memory for long sequences, one flag each: selective activation checkpointing (torchtitan's
`selective_ac_option`: every k-th decoder layer, or `op`: per op) and activation offloading (TRL's
`--activation_offloading`).

Activations grow with sequence length x layers; they are what stops long sequences once the weights fit. Full
checkpointing (`--gradient_checkpointing`) keeps only each layer's input and recomputes the whole layer in the
backward. `--selective_ac_option k` checkpoints every k-th layer only (the others keep their activations: memory
between none and full, less recompute). `--selective_ac_option op` checkpoints every layer but keeps the outputs of
its matmuls and attention, recomputing only the cheap element-wise ops (norms, activations, rotary embeddings):
torch 2.13's `create_selective_checkpoint_contexts` with a policy that saves those ops (torchtitan's default mode).
`--activation_offloading` moves every tensor the forward saves for the backward to pinned host memory and back for
the backward (`torch.autograd.graph.save_on_cpu`); with checkpointing, the layers' saved inputs go too. On a CPU the
activations already live in host memory, so offloading copies nothing (torch skips host tensors): there it can only be
shown not to change the gradients, and its memory and speed are a GPU suite row.
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from common.errors import fail

aten = torch.ops.aten
# The ops whose outputs `--selective_ac_option op` keeps: the matmuls and attention (expensive to recompute);
# everything else in a layer is recomputed in the backward.
SAVED_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten._scaled_mm.default,
             aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
             aten._scaled_dot_product_cudnn_attention.default,
             aten._scaled_dot_product_flash_attention_for_cpu.default}


def add_activation_memory_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("activation memory (long sequences)")
    g.add_argument("--selective_ac_option", help="Selective activation checkpointing (torchtitan's name): an integer "
                   "k checkpoints every k-th layer; `op` keeps matmul outputs and recomputes the element-wise ops.")
    g.add_argument("--activation_offloading", action="store_true",
                   help="Keep the activations saved for the backward in pinned host memory (TRL's name).")


def check_activation_memory(args: argparse.Namespace, config) -> None:
    """One line before any work for a value the model or the other flags cannot serve."""
    option, layers = args.selective_ac_option, getattr(config, "num_hidden_layers", None)
    if option is not None and option != "op" and not (option.isdigit() and 1 <= int(option) <= (layers or 1)):
        fail(f"--selective_ac_option {option}: give `op` or a number of layers k, 1 <= k <= {layers} (the model's "
             "layers)")
    if args.activation_offloading and args.torch_compile:
        fail("--activation_offloading does not compose with --torch_compile (its saved-tensor hooks are not traced); "
             "drop one")


def reduce_activation_memory(model: torch.nn.Module, selective_ac_option: str | None,
                             activation_offloading: bool) -> None:
    """Apply the two flags to a freshly built model (before peft and `accelerator.prepare`); a selective option takes
    the place of `--gradient_checkpointing`'s full checkpointing."""
    checkpointing = selective_ac_option or getattr(model, "is_activation_checkpointing", False)
    if checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            fail(f"--selective_ac_option: {type(model).__name__} does not support activation checkpointing")
        kwargs, every = {"use_reentrant": False}, 1
        if selective_ac_option == "op":
            kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
        elif selective_ac_option:
            every = int(selective_ac_option)
        # offload: the checkpointed layers' saved inputs go to host memory too (transformers pins it: CUDA only, and
        # on a CPU they are in host memory already)
        model.activation_checkpointing_enable(kwargs, every_n_layers=every,
                                              offload=activation_offloading and torch.cuda.is_available())
    if activation_offloading:
        forward = model.forward

        @functools.wraps(forward)
        def offloaded_forward(*args, **kwargs):
            # The hooks travel with the saved tensors: the backward, outside this block, brings them back.
            with save_on_cpu(pin_memory=torch.cuda.is_available()):
                return forward(*args, **kwargs)

        model.forward = offloaded_forward


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE
