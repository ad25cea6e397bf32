"""Resumable checkpoints (accelerate `save_state`, at optimizer-step boundaries) and the Hugging Face export."""

from __future__ import annotations

import os
import re
import shutil

from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType

from common.divergence import refuse_nonfinite_weights
from common.errors import fail

logger = get_logger(__name__)
CHECKPOINT_DIR = "checkpoints"


class TrainingProgress:
    """Optimizer steps done; registered with `accelerator.register_for_checkpointing` so it travels with the state."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def track_progress(accelerator: Accelerator) -> TrainingProgress:
    """A step counter that every checkpoint saves and every resume restores (register once per Accelerator)."""
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)
    return progress


def resume(accelerator: Accelerator, path: str | None, progress: TrainingProgress) -> None:
    """Restore model, optimizer, scheduler, RNG and `progress` from a checkpoint folder (nothing when `path` is None).

    `--resume_from_checkpoint latest` was resolved to a folder while the flags were checked.
    """
    if path:
        accelerator.load_state(path)
        logger.info(f"Resumed from {path} at optimizer step {progress.step}")


def _checkpoints(output_dir: str) -> list[str]:
    root = os.path.join(output_dir, CHECKPOINT_DIR)
    found = [d for d in os.listdir(root) if re.fullmatch(r"step_\d+", d)] if os.path.isdir(root) else []
    return [os.path.join(root, d) for d in sorted(found, key=lambda d: int(d.split("_")[1]))]


def save_checkpoint(accelerator: Accelerator, output_dir: str, step: int, save_total_limit: int | None) -> str:
    """Save the full training state (model, optimizer, scheduler, RNG, progress) on all ranks, prune old ones.

    Collective under DeepSpeed/FSDP: every process must call it.
    """
    path = os.path.join(output_dir, CHECKPOINT_DIR, f"step_{step}")
    refuse_nonfinite_weights(accelerator, accelerator._models, f"checkpoint {path}")
    accelerator.save_state(path)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and save_total_limit:
        for old in _checkpoints(output_dir)[:-save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    logger.info(f"Saved checkpoint {path}")
    return path


def resolve_resume_path(output_dir: str, value: str | None) -> str | None:
    """`latest` -> the newest checkpoint under output_dir; a path -> itself. Errors are one line."""
    if not value:
        return None
    if value == "latest":
        found = _checkpoints(output_dir)
        if not found:
            fail(f"--resume_from_checkpoint latest: no checkpoint under {os.path.join(output_dir, CHECKPOINT_DIR)}")
        return found[-1]
    return value


def export_model(accelerator: Accelerator, model, tokenizer, output_dir: str) -> None:
    """Write a `from_pretrained`-loadable folder (safetensors + config + tokenizer).

    Called on every process: under ZeRO-3/FSDP, gathering the full state dict is collective. The compiled wrapper is
    dropped so the keys carry no `_orig_mod.` prefix.
    """
    refuse_nonfinite_weights(accelerator, [model], f"the model to {output_dir}")
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    # Sharded models need the collective gather; elsewhere the unwrapped module's own state dict is complete
    # (`get_state_dict` would keep the compiled wrapper's `_orig_mod.` prefix).
    sharded = accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)
    state_dict = accelerator.get_state_dict(model) if sharded else None
    unwrapped.save_pretrained(output_dir, is_main_process=accelerator.is_main_process, state_dict=state_dict,
                              save_function=accelerator.save, safe_serialization=True)
    if accelerator.is_main_process and tokenizer is not None:
        tokenizer.save_pretrained(output_dir)
    accelerator.wait_for_everyone()
