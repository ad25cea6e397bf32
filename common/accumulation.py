"""The exact loss of one optimizer step: the token mean over the whole accumulation window on all processes.

Averaging micro-batch means (`loss / gradient_accumulation_steps`, then DDP's gradient mean) weights every micro-batch
equally, not every token: wrong whenever micro-batches hold different numbers of real tokens (padding, masked
prompts). As in the transformers Trainer: load the window ahead (`accumulation_windows`), count its label tokens on
all processes (`count_label_tokens`), pass the count as `num_items_in_batch` (the loss becomes a sum over that count),
and multiply by accumulation x processes (`backward_loss`) to cancel accelerate's and the data-parallel averaging.
That is right only for a model whose loss honours `num_items_in_batch`: `check_loss_honours_num_items` stops any
other before its first step (its gradients would be that many times too large).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from accelerate import Accelerator

from common.errors import fail_on_every_rank


def accumulation_windows(dataloader: Iterable[dict], steps: int) -> Iterator[list[dict]]:
    """Yield lists of exactly `steps` micro-batches; a trailing partial window is dropped (like `drop_last`)."""
    window = []
    for batch in dataloader:
        window.append(batch)
        if len(window) == steps:
            yield window
            window = []


def count_label_tokens(window: list[dict], accelerator: Accelerator) -> torch.Tensor:
    """Real label tokens of the window on all processes (tp processes share a batch); skips each row's first label."""
    local, pc = sum((batch["labels"][..., 1:] != -100).sum() for batch in window), accelerator.parallelism_config
    return accelerator.reduce(torch.as_tensor(local, device=accelerator.device), "sum") // (pc.tp_size if pc else 1)


def router_aux_loss_coefficient(config) -> float:
    """The weight of a mixture-of-experts load-balancing loss that the model adds to its loss (0: none)."""
    return getattr(config, "router_aux_loss_coef", 0.0) if getattr(config, "output_router_logits", False) else 0.0


def backward_loss(outputs, accelerator: Accelerator, router_aux_loss_coef: float = 0.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to pass to `accelerator.backward`, this micro-batch's share of the window's token-mean loss).

    `outputs.loss`: from a forward with `num_items_in_batch=count_label_tokens(...)` (a mixture-of-experts balancing
    loss stays a mean over micro-batches). Processes sharing one batch (sp, tp) are averaged over once. Logits dropped.
    """
    if isinstance(outputs, dict) and outputs.get("logits") is not None:
        # Nothing after the loss reads them; kept (in fp32: accelerate upcasts a mixed-precision model's outputs),
        # they stay alive through the backward, 4 bytes per token per vocabulary entry at the loss's peak.
        outputs["logits"] = None  # item, not attribute: a ModelOutput keeps an item set to None by attribute
    pc = accelerator.parallelism_config
    scale = accelerator.gradient_accumulation_steps * accelerator.num_processes // (pc.non_data_parallel_size if pc else 1)
    aux, share = getattr(outputs, "aux_loss", None), pc.tp_size if pc else 1  # tp processes hold one loss: 1/tp each
    if aux is None or not router_aux_loss_coef:
        return outputs.loss * scale, outputs.loss.detach() / share
    token_loss = outputs.loss - router_aux_loss_coef * aux
    return token_loss * scale + router_aux_loss_coef * aux, token_loss.detach() / share


@torch.no_grad()
def check_loss_honours_num_items(model, accelerator: Accelerator, router_aux_loss_coef: float = 0.0) -> None:
    """Stop (one line, every rank) if the model's loss ignores `num_items_in_batch` while `backward_loss` scales by
    accumulation x processes; harmless, and not checked, when that scale is 1.

    Two forwards of one probe row with a token count N and 2N: a loss that divides its sum by the count halves.
    Collective under ZeRO-3/FSDP (all ranks run the same probe); eager, so nothing is compiled for its shape.
    """
    if accelerator.gradient_accumulation_steps * accelerator.num_processes == 1:
        return
    module = accelerator.unwrap_model(model, keep_torch_compile=False)
    ids = (torch.arange(1, 9, device=accelerator.device) % module.config.get_text_config().vocab_size).unsqueeze(0)
    was_training = module.training
    module.eval()  # no dropout: both forwards see the same model
    shares = []
    for count in (7, 14):  # 7 labels predict something in a row of 8
        with torch.compiler.set_stance("force_eager"):
            outputs = module(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(count, device=ids.device),
                             use_cache=False)
        shares.append(backward_loss(outputs, accelerator, router_aux_loss_coef)[1].float())
    module.train(was_training)
    ratio = (shares[0] / shares[1]).item()
    if not abs(ratio - 2) < 1e-2:
        scale = accelerator.gradient_accumulation_steps * accelerator.num_processes
        fail_on_every_rank(accelerator, f"{type(module).__name__}'s loss ignores num_items_in_batch (doubling it "
                           f"changed the loss by x{1 / ratio:.3g}, not x0.5), so its gradients would come out {scale} "
                           "times too large (accumulation x processes); make its loss a token sum divided by "
                           "num_items_in_batch, as transformers' ForCausalLMLoss does, or see README 'Copy and adapt'")
