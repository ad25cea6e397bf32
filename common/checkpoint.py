"""Resumable checkpoints (accelerate `save_state`, at optimizer-step boundaries) and the Hugging Face export.

Crash safety: a checkpoint is written under a temporary name (`checkpoints/.tmp-step_N`), marked complete once every
process has finished writing, and published by renaming the folder, so a kill at any moment leaves either a complete
`checkpoints/step_N` or a `.tmp-` leftover that no resume ever picks and the next start removes.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil

from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType

from common.divergence import refuse_nonfinite_weights
from common.errors import fail, fail_on_every_rank

logger = get_logger(__name__)
CHECKPOINT_DIR = "checkpoints"
COMPLETE_MARKER = "checkpoint_complete.json"  # written last, inside the folder: the checkpoint is whole
LEFTOVER_PREFIX = ".tmp-"  # interrupted saves, prunes and overwrites: never resumed, removed at the next start
METRICS_FILE = "metrics.jsonl"  # its row count is recorded at each save: a resume keeps exactly those rows
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


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


def complete_checkpoints(output_dir: str) -> list[str]:
    """The published checkpoints `checkpoints/step_N` that hold the completion marker, oldest first."""
    root = os.path.join(output_dir, CHECKPOINT_DIR)
    found = [d for d in os.listdir(root) if re.fullmatch(r"step_\d+", d)
             and os.path.isfile(os.path.join(root, d, COMPLETE_MARKER))] if os.path.isdir(root) else []
    return [os.path.join(root, d) for d in sorted(found, key=lambda d: int(d.split("_")[1]))]


def metrics_rows_at(output_dir: str, step: int) -> int | None:
    """How many metrics.jsonl rows had been written when checkpoint step_N was saved (None: unknown)."""
    marker = os.path.join(output_dir, CHECKPOINT_DIR, f"step_{step}", COMPLETE_MARKER)
    if not os.path.isfile(marker):
        return None
    with open(marker, encoding="utf-8") as f:
        return json.load(f).get("metrics_rows")


def save_checkpoint(accelerator: Accelerator, output_dir: str, step: int, save_total_limit: int | None) -> str:
    """Save the full training state (model, optimizer, scheduler, RNG, progress) on all ranks, publish it as
    `checkpoints/step_N`, then prune the oldest complete ones beyond `save_total_limit`.

    Collective under DeepSpeed/FSDP: every process must call it. A full disk stops the run with one line, the partial
    save removed and the previous checkpoints untouched.
    """
    root = os.path.join(output_dir, CHECKPOINT_DIR)
    path, partial = os.path.join(root, f"step_{step}"), os.path.join(root, f"{LEFTOVER_PREFIX}step_{step}")
    refuse_nonfinite_weights(accelerator, accelerator._models, f"checkpoint {path}")
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(partial)
    except Exception as exc:
        if not disk_refuses_writes(exc, partial):
            raise
        shutil.rmtree(partial, ignore_errors=True)
        fail(disk_full_message(output_dir, step))
    accelerator.wait_for_everyone()  # every rank has written its part
    if accelerator.is_main_process:
        publish(partial, path, {"step": step, "metrics_rows": count_rows(os.path.join(output_dir, METRICS_FILE))})
        for old in complete_checkpoints(output_dir)[:-save_total_limit] if save_total_limit else []:
            discard(old)
    accelerator.wait_for_everyone()
    logger.info(f"Saved checkpoint {path}")
    return path


def publish(partial: str, path: str, marker: dict) -> None:
    """Flush the finished save to disk, mark it complete, and rename it into place (atomic on POSIX filesystems).

    The fsyncs make the marker mean "complete" even if the node loses power right after.
    """
    for folder, _, files in os.walk(partial):
        for name in files:
            fsync_path(os.path.join(folder, name))
    with open(os.path.join(partial, COMPLETE_MARKER), "w", encoding="utf-8") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(path):  # the same step saved by an earlier attempt: replaced whole, never merged
        discard(path)
    os.replace(partial, path)
    fsync_path(os.path.dirname(path))


def discard(path: str) -> None:
    """Remove a folder so that a kill midway never leaves it half-deleted under its own name."""
    aside = os.path.join(os.path.dirname(path), f"{LEFTOVER_PREFIX}discarded-{os.path.basename(path)}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def remove_leftovers(output_dir: str) -> None:
    """Delete what interrupted saves, prunes, overwrites and metrics trims left (`.tmp-*`); main process, under the
    output folder's lock (no live run is writing them)."""
    for folder in (output_dir, os.path.join(output_dir, CHECKPOINT_DIR)):
        for name in os.listdir(folder) if os.path.isdir(folder) else []:
            if name.startswith(LEFTOVER_PREFIX):
                leftover = os.path.join(folder, name)
                shutil.rmtree(leftover, ignore_errors=True) if os.path.isdir(leftover) else os.remove(leftover)


def resolve_resume_path(output_dir: str, value: str | None) -> str | None:
    """`latest` -> the newest complete checkpoint under output_dir, else a one-line error; `auto` -> the same, else
    None (start fresh: a requeued job runs the same command line whether or not a checkpoint exists); a path ->
    itself."""
    if value not in ("latest", "auto"):
        return value or None
    found = complete_checkpoints(output_dir)
    if found:
        return found[-1]
    if value == "latest":
        fail(f"--resume_from_checkpoint latest: no checkpoint under {os.path.join(output_dir, CHECKPOINT_DIR)} "
             "(--resume_from_checkpoint auto starts fresh when there is none)")
    return None


def disk_refuses_writes(exc: BaseException, folder: str) -> bool:
    """Did a save fail because the disk is full (or the quota or file-size limit reached)?

    safetensors and Python report the errno; torch.save does not ("unexpected pos ..."), so the disk is also asked
    directly with a small write next to the partial save.
    """
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return True
        exc = exc.__cause__ or exc.__context__
    probe = os.path.join(folder, f"{LEFTOVER_PREFIX}probe")
    try:
        with open(probe, "wb") as f:
            f.write(bytes(2**20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as probe_error:
        return probe_error.errno in DISK_FULL_ERRNOS
    finally:
        if os.path.exists(probe):
            os.remove(probe)
    return False


def disk_full_message(output_dir: str, step: int) -> str:
    previous = complete_checkpoints(output_dir)
    free_mib = shutil.disk_usage(output_dir).free / 2**20
    return (f"disk full: checkpoint step_{step} could not be written to {os.path.join(output_dir, CHECKPOINT_DIR)} "
            f"(filesystem {mount_point(output_dir)}, {free_mib:.0f} MiB free after removing the partial save); "
            f"{previous[-1] + ' is intact' if previous else 'there is no earlier checkpoint'}: free some space, then "
            "rerun with --resume_from_checkpoint auto")


def mount_point(path: str) -> str:
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def count_rows(path: str) -> int:
    """Complete lines in a text file (0 when it does not exist)."""
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8") as f:
        return sum(line.endswith("\n") for line in f)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def zero_partition_count(checkpoint_dir: str) -> int | None:
    """Processes a DeepSpeed ZeRO checkpoint written by `save_state` was partitioned over (None: not a ZeRO one).

    accelerate saves the engine under the tag `pytorch_model`; each data-parallel rank writes one
    `zero_pp_rank_<r>_mp_rank_<m>_optim_states.pt` there. Counting names is cheap (no tensor is read).
    """
    engine_dir = os.path.join(checkpoint_dir, "pytorch_model")
    if not os.path.isdir(engine_dir):
        return None
    ranks = {m.group(1) for m in (re.fullmatch(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt", f)
                                  for f in os.listdir(engine_dir)) if m}
    return len(ranks) or None


def check_resume_process_count(accelerator: Accelerator, checkpoint_dir: str | None) -> None:
    """Refuse, in one line and before any heavy work, a ZeRO checkpoint resumed at another process count.

    DeepSpeed cannot re-partition ZeRO optimizer states; it would raise only after the data and the model are built.
    (Its universal-checkpoint conversion does not fit accelerate's checkpoint layout: not offered here.) FSDP2's
    sharded checkpoints are torch.distributed.checkpoint folders and load at any process count, so they pass.
    """
    if not checkpoint_dir or accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    saved = zero_partition_count(checkpoint_dir)
    if saved is not None and saved != accelerator.num_processes:
        fail_on_every_rank(accelerator, f"--resume_from_checkpoint {checkpoint_dir} holds DeepSpeed ZeRO states "
                           f"partitioned over {saved} processes but this run has {accelerator.num_processes}, and "
                           f"DeepSpeed cannot re-partition them: resume with --num_processes {saved}, or train with "
                           "accelerate_configs/fsdp2.yaml, whose checkpoints resume at any process count")


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
    keep_used_weight_conversions(unwrapped)
    unwrapped.save_pretrained(output_dir, is_main_process=accelerator.is_main_process, state_dict=state_dict,
                              save_function=accelerator.save, safe_serialization=True)
    if accelerator.is_main_process and tokenizer is not None:
        tokenizer.save_pretrained(output_dir)
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
