"""Every use of an upstream package's private attributes, each with the version it was written for and why no public
API serves; tests/test_upstream.py fails when a pin changes or the public API appears (re-check, then remove it)."""

from __future__ import annotations

from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType

# The versions these workarounds were written and tested for (requirements.txt pins them).
WRITTEN_FOR = {"accelerate": "1.15.0", "transformers": "5.23.0", "torch": "2.13.0", "datasets": "5.2.0"}


def prepared_models(accelerator: Accelerator) -> list:
    """The models `prepare` returned (accelerate 1.15: held in `_models`; no public accessor)."""
    return accelerator._models


def attention_implementation(config) -> str:
    """The attention kernel a model runs (transformers 5.23: `_attn_implementation`; no public attribute)."""
    return config._attn_implementation


def dataset_fingerprint(dataset) -> str:
    """A `datasets` table's content hash (datasets 5.2: `_fingerprint`; no public accessor): a cache key."""
    return dataset._fingerprint


def prepared_optimizers_and_schedulers(accelerator: Accelerator) -> tuple[list, list]:
    """The optimizers and schedulers `prepare` returned (accelerate 1.15: `_optimizers`, `_schedulers`; no accessor)."""
    return ([getattr(o, "optimizer", o) for o in accelerator._optimizers],
            [getattr(s, "scheduler", s) for s in accelerator._schedulers])


def prepared_dataloaders_and_registered_objects(accelerator: Accelerator) -> tuple[list, list]:
    """What `save_state` writes besides models and optimizers: the prepared dataloaders and the objects
    `register_for_checkpointing` took (accelerate 1.15: `_dataloaders`, `_custom_objects`; no accessor)."""
    return accelerator._dataloaders, accelerator._custom_objects


def set_last_lr(scheduler, lrs: list[float]) -> None:
    """What `get_last_lr()` returns after a resume recomputed the rates (torch 2.13 LRScheduler: no setter)."""
    scheduler._last_lr = lrs


def take_back_step_count(scheduler) -> None:
    """One `step()` fewer in the count a scheduler saves in its state_dict (torch 2.13 LRScheduler: `_step_count`, no
    public way to undo a step)."""
    scheduler._step_count -= 1


def save_state_pre_hooks(accelerator: Accelerator) -> list:
    """The hooks `register_save_state_pre_hook` registered (accelerate 1.15: no accessor), so one registers once."""
    return list(accelerator._save_model_state_pre_hook.values())


def open_progress_bars() -> list:
    """tqdm's open bars (tqdm keeps them in `_instances`; no public accessor), closed before a last error line."""
    from tqdm import tqdm

    return list(getattr(tqdm, "_instances", ()))


def use_fsdp_everywhere(accelerator: Accelerator) -> None:
    """accelerate 1.15 turns FSDP into DDP when built with `cpu=True`: mark both state singletons FSDP (the
    accelerator's state and the shared PartialState that dataloader preparation and collectives read)."""
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP


def keep_used_weight_conversions(model) -> None:
    """`save_pretrained` undoes the key conversions loading recorded (`_weight_conversions`); transformers 5.23's ZeRO-3
    loading records every known one, used or not: a ZeRO-3 export of BERT had `LayerNorm.gamma/beta`. Keep the used."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        model._weight_conversions = [conversion for conversion in conversions if conversion.was_used()]


def registered_zero3_config():
    """transformers 5.23's registered DeepSpeed config object (`_hf_deepspeed_config_weak_ref`; no public getter)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    reference = hf_deepspeed._hf_deepspeed_config_weak_ref
    return reference() if reference is not None else None
