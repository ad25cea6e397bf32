"""The Hugging Face export: a `from_pretrained`-loadable folder (safetensors, config, generation config, tokenizer)
from the prepared model, under every engine; for a LoRA run the adapter in peft's format, and optionally the adapter
merged into its base."""

from __future__ import annotations

import os

from accelerate import Accelerator
from accelerate.utils import DistributedType, is_peft_model

from common.adapters import adapter_state_dict, merge_adapter
from common.guard import weights_are_finite
from common.paths import MERGED_DIR


def export_model(accelerator: Accelerator, model, tokenizer, output_dir: str) -> bool:
    """Write the model and tokenizer to `output_dir`; False (nothing written, the reason printed) when a weight is not
    finite.

    Called on every process: under ZeRO-3/FSDP, gathering the full state dict is collective. The compiled wrapper is
    dropped so the keys carry no `_orig_mod.` prefix. config.json and generation_config.json name the tokenizer's
    special tokens.
    """
    if not weights_are_finite(accelerator, [model], f"the model to {output_dir}"):
        return False
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    if is_peft_model(unwrapped):  # adapter_config.json + adapter_model.safetensors, for PeftModel.from_pretrained
        state_dict = adapter_state_dict(accelerator, model)
        if accelerator.is_main_process:
            unwrapped.save_pretrained(output_dir, state_dict=state_dict)
            tokenizer.save_pretrained(output_dir)
        accelerator.wait_for_everyone()
        return True
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


def export_merged_model(accelerator: Accelerator, tokenizer, output_dir: str, model_class, base_path: str,
                        **load_kwargs) -> None:
    """--merge_adapter: the adapter exported in `output_dir` merged into a full-precision copy of the base (see
    common/adapters.py), written to `output_dir/merged`, loadable with the model class alone. The main process does
    it; the others wait."""
    if accelerator.is_main_process:
        merged = merge_adapter(model_class, base_path, output_dir, **load_kwargs)
        use_tokenizer_special_tokens(merged, tokenizer)
        merged.save_pretrained(os.path.join(output_dir, MERGED_DIR), safe_serialization=True)
        tokenizer.save_pretrained(os.path.join(output_dir, MERGED_DIR))
    accelerator.wait_for_everyone()


def keep_used_weight_conversions(model) -> None:
    """Let `save_pretrained` undo only the key conversions that loading the model applied.

    transformers (5.23) reverts a model's recorded key conversions when saving. Its ZeRO-3 loading path records every
    conversion known for the model type, used or not (the other path keeps the used ones), so a ZeRO-3 export of BERT
    had the legacy names `LayerNorm.gamma/beta` instead of the checkpoint's `LayerNorm.weight/bias`.
    """
    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        model._weight_conversions = [conversion for conversion in conversions if conversion.was_used()]


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
