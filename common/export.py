"""The Hugging Face export: a `from_pretrained`-loadable folder (safetensors, config, generation config, tokenizer)
from the prepared model, under every engine (a LoRA run's adapter: common/features/lora.py)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list

from common.errors import fail_on_every_rank
from common.output_dir import fsync_path
from common.paths import LEFTOVER_PREFIX
from common.upstream import keep_used_weight_conversions


def export_model(accelerator: Accelerator, model, tokenizer, output_dir: str,
                 explain_failed_write: Callable | None = None) -> bool:
    """Write the model and tokenizer to `output_dir`, all or nothing (`write_all_or_nothing`); True (a wrapper may
    refuse: common/features/divergence.py).

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

    def save_model(folder: str, is_main_process: bool = True) -> None:
        unwrapped.save_pretrained(folder, is_main_process=is_main_process, state_dict=state_dict,
                                  save_function=accelerator.save, safe_serialization=True)

    write_all_or_nothing(accelerator, output_dir, tokenizer, save_model, True, explain_failed_write)
    return True


def write_all_or_nothing(accelerator: Accelerator, output_dir: str, tokenizer, save_model: Callable,
                         every_process: bool = False, explain_failed_write: Callable | None = None) -> None:
    """The main process writes `save_model(folder)` and the tokenizer into `output_dir/.tmp-export`, then moves each
    file into place, the config last: a failed write or a kill never leaves a config beside missing or partial
    weights (a kill leaves the temporary folder, which the next start removes). With `every_process` the others call
    `save_model(output_dir, is_main_process=False)` (collectives; they write nothing). A failed write is removed;
    `explain_failed_write(exception, partial folder)` may name it in one line (a full disk) that stops every rank."""
    partial, problem = os.path.join(output_dir, f"{LEFTOVER_PREFIX}export"), None
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        try:
            save_model(partial)
            tokenizer.save_pretrained(partial)
        except Exception as exc:
            problem = explain_failed_write(exc, partial) if explain_failed_write else None
            shutil.rmtree(partial, ignore_errors=True)
            if problem is None:
                raise
    elif every_process:
        save_model(output_dir, is_main_process=False)
    problem = broadcast_object_list([problem])[0]  # only the main process writes: its verdict holds for all
    if problem:
        fail_on_every_rank(accelerator, problem)
    if accelerator.is_main_process:
        names = sorted(os.listdir(partial), key=lambda name: name in ("config.json", "adapter_config.json"))
        for name in names:
            fsync_path(os.path.join(partial, name))
        for name in names:
            os.replace(os.path.join(partial, name), os.path.join(output_dir, name))
        os.rmdir(partial)
        fsync_path(output_dir)
    accelerator.wait_for_everyone()


def use_tokenizer_special_tokens(model, tokenizer) -> None:
    """Give the model's config and generation config the tokenizer's BOS / EOS / PAD ids.

    A model built from a preset carries LlamaConfig's defaults (BOS 1, EOS 2), other tokens of a tokenizer trained here
    (its end-of-text is 0): generation would stop at the wrong token and run past the real end. A list of EOS ids
    that holds the tokenizer's (chat models stop at several tokens) is kept.
    """
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(getattr(tokenizer, "tokenizer", tokenizer), name)  # a processor: its tokenizer's
        if value is None:
            continue
        for config in (model.config, getattr(model, "generation_config", None)):
            if config is not None and not (isinstance(getattr(config, name, None), list)
                                           and value in getattr(config, name)):
                setattr(config, name, value)
