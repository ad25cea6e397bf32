"""The Hugging Face export: a `from_pretrained`-loadable folder (safetensors, config, generation config, tokenizer)
from the prepared model, under every engine; for a LoRA run the adapter in peft's format, and optionally the adapter
merged into its base."""

from __future__ import annotations

import os
import shutil

from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list, is_peft_model

from common.adapters import adapter_state_dict, merge_adapter
from common.checkpoint import complete_checkpoints, fsync_path
from common.disk import disk_refuses_writes, mount_point
from common.errors import fail_on_every_rank
from common.guard import weights_are_finite
from common.paths import LEFTOVER_PREFIX, MERGED_DIR


def export_model(accelerator: Accelerator, model, tokenizer, output_dir: str) -> bool:
    """Write the model and tokenizer to `output_dir`; False (nothing written, the reason printed) when a weight is not
    finite.

    Called on every process: under ZeRO-3/FSDP, gathering the full state dict is collective. The compiled wrapper is
    dropped so the keys carry no `_orig_mod.` prefix. config.json and generation_config.json name the tokenizer's
    special tokens. All or nothing, like a checkpoint: the files are written into a temporary folder and moved into
    place once complete; a full disk stops the run with one line and leaves no part of the export.
    """
    if not weights_are_finite(accelerator, [model], f"the model to {output_dir}"):
        return False
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    if is_peft_model(unwrapped):  # adapter_config.json + adapter_model.safetensors, for PeftModel.from_pretrained
        state_dict = adapter_state_dict(accelerator, model)
        write_all_or_nothing(accelerator, output_dir, tokenizer,
                             lambda folder: unwrapped.save_pretrained(folder, state_dict=state_dict))
        return True
    use_tokenizer_special_tokens(unwrapped, tokenizer)
    # Sharded models need the collective gather; elsewhere the unwrapped module's own state dict is complete
    # (`get_state_dict` would keep the compiled wrapper's `_orig_mod.` prefix).
    sharded = accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)
    state_dict = accelerator.get_state_dict(model) if sharded else None
    keep_used_weight_conversions(unwrapped)

    def save_model(folder: str, is_main_process: bool = True) -> None:
        unwrapped.save_pretrained(folder, is_main_process=is_main_process, state_dict=state_dict,
                                  save_function=accelerator.save, safe_serialization=True)

    write_all_or_nothing(accelerator, output_dir, tokenizer, save_model, every_process=True)
    return True


def write_all_or_nothing(accelerator: Accelerator, output_dir: str, tokenizer, save_model,
                         every_process: bool = False) -> None:
    """The main process writes `save_model(folder)` and the tokenizer into `output_dir/.tmp-export`, then moves each
    file into place, the config last: a full disk or a kill midway never leaves a config beside missing or
    partial weights (a kill leaves the temporary folder, which the next start removes). With `every_process` the
    others call `save_model(output_dir, is_main_process=False)`, writing nothing. A full disk stops every process with
    one line, the partial export removed."""
    partial = os.path.join(output_dir, f"{LEFTOVER_PREFIX}export")
    problem = None
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        try:
            save_model(partial)
            tokenizer.save_pretrained(partial)
        except Exception as exc:
            if not disk_refuses_writes(exc, partial):
                raise
            shutil.rmtree(partial, ignore_errors=True)
            problem = export_disk_full_message(output_dir)
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


def export_disk_full_message(output_dir: str) -> str:
    """The one line an export that found the disk full ends the run with."""
    free_mib = shutil.disk_usage(output_dir).free / 2**20
    checkpoints = complete_checkpoints(output_dir)
    then = (f"rerun with --resume_from_checkpoint auto ({checkpoints[-1]} is intact)" if checkpoints else
            "rerun with --overwrite_output_dir (there is no checkpoint to resume)")
    return (f"disk full: the model could not be exported to {output_dir} (filesystem {mount_point(output_dir)}, "
            f"{free_mib:.0f} MiB free after removing the partial export; nothing of it was left): free some space, "
            f"then {then}")


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
