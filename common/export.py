"""The Hugging Face export: a `from_pretrained`-loadable folder (safetensors, config, generation config, tokenizer)
from the prepared model, under every engine (a LoRA run's adapter: common/features/lora.py)."""

from __future__ import annotations

from accelerate import Accelerator
from accelerate.utils import DistributedType

from common.upstream import keep_used_weight_conversions


def export_model(accelerator: Accelerator, model, tokenizer, output_dir: str) -> bool:
    """Write the model and tokenizer to `output_dir`; True (a wrapper may refuse: common/features/divergence.py).

    Called on every process: under ZeRO-3/FSDP, gathering the full state dict is collective. The compiled wrapper is
    dropped so the keys carry no `_orig_mod.` prefix. config.json and generation_config.json name the tokenizer's
    special tokens.
    """
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    use_tokenizer_special_tokens(unwrapped, tokenizer)
    # Sharded models need the collective gather; elsewhere the unwrapped module's own state dict is complete
    # (`get_state_dict` would keep the compiled wrapper's `_orig_mod.` prefix).
    sharded = accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)
    state_dict = accelerator.get_state_dict(model) if sharded else None
    keep_used_weight_conversions(unwrapped)
    unwrapped.save_pretrained(output_dir, is_main_process=accelerator.is_main_process, state_dict=state_dict,
                              save_function=accelerator.save, safe_serialization=True)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(output_dir)
    accelerator.wait_for_everyone()
    return True


def use_tokenizer_special_tokens(model, tokenizer) -> None:
    """Give the model's config and generation config the tokenizer's BOS / EOS / PAD ids.

    A model built from a preset carries LlamaConfig's defaults (BOS 1, EOS 2), other tokens of a tokenizer trained here
    (its end-of-text is 0): generation would stop at the wrong token and run past the real end. A list of EOS ids
    that holds the tokenizer's (chat models stop at several tokens) is kept.
    """
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name)
        if value is None:
            continue
        for config in (model.config, getattr(model, "generation_config", None)):
            if config is not None and not (isinstance(getattr(config, name, None), list)
                                           and value in getattr(config, name)):
                setattr(config, name, value)
