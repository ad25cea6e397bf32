"""Resumable checkpoints: save (accelerate `save_state`, at optimizer-step boundaries, crash-safe), find the one to
resume, and restore it.

Crash safety: a checkpoint is written under a temporary name (`checkpoints/.tmp-step_N`), marked complete once every
process has finished writing, and published by renaming the folder, so a kill at any moment leaves either a complete
`checkpoints/step_N` or a `.tmp-` leftover that no resume ever picks and the next start removes. A full disk stops
the run with one line, the previous checkpoints untouched.

Verification: the marker records every file's size and checksum (common/integrity.py). A resume checks them first:
`auto` skips a damaged checkpoint (one line says which file) for the newest one that verifies; `latest` and an
explicit path stop with one line naming the file.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil

from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, is_peft_model

from common.disk import disk_full_message, disk_refuses_writes
from common.errors import fail, fail_on_every_rank
from common.guard import weights_are_finite
from common.integrity import record_files, verify
from common.optim import keep_this_runs_hyperparameters
from common.paths import CHECKPOINT_DIR, COMPLETE_MARKER, LEFTOVER_PREFIX, METRICS_FILE, RUN_RECORD
from common.run_record import RunRecord, check_run_record
from common.steps import TrainingProgress

logger = get_logger(__name__)


def is_checkpoint(path: str) -> bool:
    """A folder written by `save_checkpoint` (or by accelerate's `save_state`, which leaves per-process RNG files)."""
    return any(os.path.isfile(os.path.join(path, name)) for name in (COMPLETE_MARKER, RUN_RECORD)) or \
        bool(glob.glob(os.path.join(path, "random_states_*.pkl")))


def resume(accelerator: Accelerator, path: str | None, progress: TrainingProgress, run: RunRecord) -> None:
    """Restore model, optimizer, scheduler, RNG and `progress` from a checkpoint folder (nothing when `path` is None).

    `path` comes from `find_checkpoint_to_resume`. The run must agree with the checkpoint's record (one line
    otherwise). The weights, the optimizer's moments, the schedule's step and the RNG come from the checkpoint; the
    learning rate, schedule and optimizer settings from this run's flags (common/optim.py).
    """
    if path:
        check_run_record(path, run.fields)
        with keep_this_runs_hyperparameters(accelerator):
            accelerator.load_state(path, **frozen_base_left_out(accelerator, loading=True))
        # accelerate restores its micro-step counter, which sets the sync points of `accumulate`, from the checkpoint
        # (and only on ranks that wrote one): count it afresh in this run's accumulation steps, on every rank.
        accelerator.step = progress.step * accelerator.gradient_accumulation_steps
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


def save_checkpoint(accelerator: Accelerator, output_dir: str, step: int, save_total_limit: int | None,
                    run: RunRecord) -> str | None:
    """Save the full training state (model, optimizer, scheduler, RNG, progress) and the run's record on all ranks,
    publish it as `checkpoints/step_N`, then prune the oldest complete ones beyond `save_total_limit`.

    Returns the checkpoint's folder, or None when a weight is not finite: nothing is saved, the reason is printed,
    and the run must stop with DIVERGED_STATUS. Collective under DeepSpeed/FSDP: every process must call it. A full
    disk stops the run with one line, the partial save removed and the previous checkpoints untouched.
    """
    root = os.path.join(output_dir, CHECKPOINT_DIR)
    path, partial = os.path.join(root, f"step_{step}"), os.path.join(root, f"{LEFTOVER_PREFIX}step_{step}")
    if not weights_are_finite(accelerator, accelerator._models, f"checkpoint {path}"):
        return None
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(partial, **frozen_base_left_out(accelerator, loading=False))
    except Exception as exc:
        if not disk_refuses_writes(exc, partial):
            raise
        shutil.rmtree(partial, ignore_errors=True)
        fail(disk_full_message(output_dir, step, complete_checkpoints(output_dir)))
    accelerator.wait_for_everyone()  # every rank has written its part
    if accelerator.is_main_process:
        run.write(partial)
    accelerator.wait_for_everyone()
    files = record_files(accelerator, partial)  # every rank checksums a share of the files
    if accelerator.is_main_process:
        publish(partial, path, {"step": step, "metrics_rows": count_rows(os.path.join(output_dir, METRICS_FILE)),
                                "files": files})
        for old in complete_checkpoints(output_dir)[:-save_total_limit] if save_total_limit else []:
            discard(old)
    accelerator.wait_for_everyone()
    logger.info(f"Saved checkpoint {path}")
    return path


def frozen_base_left_out(accelerator: Accelerator, loading: bool) -> dict:
    """`save_state`/`load_state` arguments: DeepSpeed writes a LoRA run's frozen base into every checkpoint unless
    told not to; the base comes from the pretrained model at every start (other engines: common/adapters.py)."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED or not any(map(is_peft_model, accelerator._models)):
        return {}
    return {"load_module_strict": False} if loading else {"exclude_frozen_parameters": True}


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


def find_checkpoint_to_resume(output_dir: str, value: str | None, accelerator: Accelerator | None = None
                              ) -> str | None:
    """The checkpoint folder `--resume_from_checkpoint value` names, or None to start fresh; one line if there is none
    or if it is damaged.

    `latest`: the newest complete checkpoint under output_dir (an error if there is none); `auto`: the newest complete
    one that verifies, else None (a requeued job runs the same command line whether or not a checkpoint exists); a
    path: itself, if it holds a checkpoint. Every file is checked against the sizes and checksums its marker records
    (common/integrity.py): `auto` skips a damaged checkpoint with one line naming the file, `latest` and a path stop
    with one line. Collective when `accelerator` is given (each process checks a share of the files).
    """
    stop = (lambda message: fail_on_every_rank(accelerator, message)) if accelerator else fail
    if value in ("latest", "auto"):
        root = os.path.join(output_dir, CHECKPOINT_DIR)
        found = complete_checkpoints(output_dir)[::-1]
        if not found and value == "latest":
            fail(f"--resume_from_checkpoint latest: no checkpoint under {root} "
                 "(--resume_from_checkpoint auto starts fresh when there is none)")
        damaged = []
        for path in found:
            problem = checked(path, accelerator)
            if problem is None:
                return path
            if value == "latest":
                stop(f"--resume_from_checkpoint latest: {path} is damaged: {problem}; --resume_from_checkpoint auto "
                     "resumes the newest checkpoint that verifies")
            warn(accelerator, f"Skipping checkpoint {path}: {problem}; trying the one before it")
            damaged.append(f"{os.path.basename(path)}: {problem}")
        if damaged:
            stop(f"--resume_from_checkpoint auto: no checkpoint under {root} verifies ({'; '.join(damaged)}); remove "
                 "them to start fresh, or start over with --overwrite_output_dir instead of --resume_from_checkpoint")
        return None
    if value and not is_checkpoint(value):
        fail(f"--resume_from_checkpoint {value}: not a checkpoint (it holds no {RUN_RECORD}); pass an "
             "<output_dir>/checkpoints/step_N folder or `latest`")
    if value and (problem := checked(value, accelerator)):
        stop(f"--resume_from_checkpoint {value} is damaged: {problem}; resume another checkpoint "
             "(--resume_from_checkpoint auto takes the newest one that verifies)")
    return value or None


def checked(path: str, accelerator: Accelerator | None) -> str | None:
    """The first problem of a checkpoint's files, or None; a checkpoint with nothing to check against (saved before
    markers recorded files, or without a marker) passes with a warning line."""
    verified, problem = verify(path, accelerator)
    if not verified and problem is None:
        warn(accelerator, f"{path} records no file sizes or checksums (saved by an older version, or not marked "
                          "complete): resuming it unverified")
    return problem


def warn(accelerator: Accelerator | None, line: str) -> None:
    """One warning line, from the main process."""
    if accelerator is None or accelerator.is_main_process:
        logging.getLogger(__name__).warning(line)


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


