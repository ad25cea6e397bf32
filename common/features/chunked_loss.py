"""Chunked cross-entropy (`--chunked_cross_entropy`): a causal LM's head and its token loss computed over chunks of
tokens, so the batch x sequence x vocabulary logits and their gradient are never materialised.

torch 2.13's `F.linear_cross_entropy` does the chunking (weight gradient accumulated in fp32 under bf16/fp16), over
chunks of CHUNK_TOKENS tokens: its own default sizes a chunk's logits like the head's input, which for a narrow model
and a wide vocabulary means chunks of 1-8 tokens (measured on a CPU, 2,048 tokens x hidden 128 x vocabulary 128,256:
46 s per forward and backward against 4.7 s unchunked and 3.0 s with chunks of 1,024). The loss is the same token
sum divided by `num_items_in_batch` as transformers' `ForCausalLMLoss`, so `common/accumulation.py`'s exact
normalisation holds unchanged. An older torch, without `F.linear_cross_entropy` (2.11 on some GPU machines), gets
the same chunks from `torch.utils.checkpoint`: each chunk's logits and loss are computed in the forward and freed,
and computed again in the backward, one chunk at a time (the same loss and gradients, `tests/test_chunked_loss.py`).

The head's weight is only read inside the head module's own forward: ZeRO-3 gathers it there and FSDP2 has it
unsharded, which a loss computed outside that forward would not see (an empty shard or a DTensor). A forward with
labels returns the loss and no logits; with `per_row_logps=True` as well, each row's summed log-probability of its
labelled tokens (`outputs.logps`, fp32: DPO's sequence log-probabilities); without labels (evaluation, generation)
the model is unchanged.
"""

from __future__ import annotations

import argparse
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast, ModelOutput

from common.errors import fail

CHUNK_TOKENS = 1024  # a chunk's fp32 logits: 0.5 GB at a 128k vocabulary (all 16k tokens of 8 x 2,048: 8.4 GB)
# None before torch 2.13, which has no F.linear_cross_entropy: the checkpointed chunks below stand in for it
OPTIONS = getattr(torch.nn, "LinearCrossEntropyOptions", lambda **_: None)(chunking_method=None,
                                                                            batch_chunk_size=CHUNK_TOKENS)


def check_chunked_loss(config: PretrainedConfig) -> None:
    """One line before any work for a model whose training loss is more than the token loss."""
    if getattr(config, "output_router_logits", False):
        fail("--chunked_cross_entropy does not add a mixture of experts' load-balancing loss: leave it off for "
             f"{config.model_type} with output_router_logits")


def use_chunked_loss(model: PreTrainedModel) -> None:
    """From now on `model(..., labels=...)` returns the chunked loss (`outputs.logits` is None). Call it before any
    wrapping (peft, accelerate.prepare); the state dict's keys do not change."""
    head = model.get_output_embeddings()
    if not (hasattr(model, "model") and isinstance(head, torch.nn.Linear)):
        fail(f"--chunked_cross_entropy needs a causal LM with a base model and a linear head; {type(model).__name__} "
             "has none")
    head.forward = types.MethodType(_head_forward, head)
    model.forward = types.MethodType(_forward, model)


@dataclass
class RowLogps(ModelOutput):
    logps: torch.Tensor | None = None  # per row: the summed log-probability of its labelled tokens


def _forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, num_items_in_batch=None,
             per_row_logps=False, **kwargs):
    if labels is None:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, **kwargs)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    loss = self.get_output_embeddings()(outputs.last_hidden_state, labels, num_items_in_batch, per_row_logps)
    if per_row_logps:
        return RowLogps(logps=loss)
    return CausalLMOutputWithPast(loss=loss, past_key_values=outputs.past_key_values)


def _head_forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None, num_items_in_batch=None,
                  per_row_logps: bool = False):
    if labels is None:
        return F.linear(hidden, self.weight, self.bias)
    targets = F.pad(labels[..., 1:], (0, 1), value=-100).reshape(-1)  # position t predicts token t + 1
    hidden, weight, bias = hidden.reshape(-1, hidden.shape[-1]), self.weight, self.bias
    device = hidden.device.type
    # the head's matmul in the autocast dtype, as the unchunked head's is
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    if OPTIONS is None:
        losses = checkpointed_chunk_losses(hidden, weight, bias, targets, dtype)
    else:
        hidden, weight, bias = (None if t is None else t.to(dtype) for t in (hidden, weight, bias))
        # A 16-bit "sum" comes back rounded to 16 bits (0.7 % off over 512 tokens, measured); per-token losses
        # summed in fp32 are exact to 5e-5, for one more pass over the chunks' logits in the backward.
        reduction = "sum" if hidden.dtype == torch.float32 and not per_row_logps else "none"
        with torch.autocast(device, enabled=False):
            losses = F.linear_cross_entropy(hidden, weight, targets, linear_bias=bias, reduction=reduction,
                                            ignore_index=-100, options=OPTIONS)
    if per_row_logps:  # an ignored target's loss is 0
        return -losses.float().view(labels.shape).sum(1)
    count = (targets != -100).sum() if num_items_in_batch is None else num_items_in_batch
    return losses.float().sum() / count


def checkpointed_chunk_losses(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              targets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-token fp32 losses over chunks of CHUNK_TOKENS tokens, each chunk's logits recomputed in the backward (a
    torch without F.linear_cross_entropy). The cast to `dtype` is inside each chunk, so the weight's gradient adds up
    in the weight's own dtype (fp32 under autocast), as F.linear_cross_entropy's does."""
    losses = [checkpoint(_chunk_losses, h, weight, bias, t, dtype, use_reentrant=False)
              for h, t in zip(hidden.split(CHUNK_TOKENS), targets.split(CHUNK_TOKENS))]
    return torch.cat(losses)


def _chunk_losses(hidden, weight, bias, targets, dtype):
    with torch.autocast(hidden.device.type, enabled=False):
        logits = F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
        return F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="none")


def add_chunked_loss_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument_group("chunked cross-entropy").add_argument(
        "--chunked_cross_entropy", action="store_true",
        help="LM head and loss over chunks of tokens: the full logits are never materialised.")
