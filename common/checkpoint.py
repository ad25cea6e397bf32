"""Resumable checkpoints: save (accelerate `save_state`, at optimizer-step boundaries), find one, restore it.

Crash safety: a checkpoint is written under a temporary name (`checkpoints/.tmp-step_N`), marked complete once every
process has finished writing, and published by renaming the folder, so a kill at any moment leaves either a complete
`checkpoints/step_N` or a `.tmp-` leftover that no resume ever picks and the next start removes.

Optional features (common/features/) add to checkpoints through the `CheckpointExtras` the recipe passes.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from accelerate import Accelerator
from accelerate.logging import get_logger

from common.errors import fail, fail_on_every_rank
from common.metrics import count_rows
from common.output_dir import discard, fsync_path
from common.paths import CHECKPOINT_DIR, COMPLETE_MARKER, LEFTOVER_PREFIX, METRICS_FILE, RUN_RECORD
from common.steps import TrainingProgress

logger = get_logger(__name__)


@dataclass
class CheckpointExtras:
    """What optional features add to checkpoints (common/features/; each None adds nothing)."""
    can_save: Callable[[Accelerator, str], bool] | None = None  # collective: False refuses the save (printed why)
    write: Callable[[str], None] | None = None  # main process: more files into the save before it is published
    check: Callable[[str], None] | None = None  # before a resume loads it: one line if this run cannot continue it
    record_files: Callable[[Accelerator, str], dict | None] | None = None  # collective: the marker's file record
    verify: Callable[[str, Accelerator | None], str | None] | None = None  # its first problem, None if it verifies
    # Called with a failed save's exception, partial folder and step: may remove it and stop in one line (full disk).
    explain_failed_save: Callable[[BaseException, str, int], None] | None = None
    state_kwargs: Callable[[bool], dict] | None = None  # save_state / load_state (True) arguments
    keep: Callable[[Accelerator], AbstractContextManager] | None = None  # around the restore: what of this run stays
    save: Callable[..., str | None] | None = None  # saves instead of `save_checkpoint` (its arguments and result)

    def kwargs(self, loading: bool) -> dict:
        return self.state_kwargs(loading) if self.state_kwargs else {}


def is_checkpoint(path: str) -> bool:
    """A folder written by `save_checkpoint` (or by accelerate's `save_state`, which leaves per-process RNG files)."""
    return any(os.path.isfile(os.path.join(path, name)) for name in (COMPLETE_MARKER, RUN_RECORD)) or \
        bool(glob.glob(os.path.join(path, "random_states_*.pkl")))


def resume(accelerator: Accelerator, path: str | None, progress: TrainingProgress,
           extras: CheckpointExtras | None = None) -> None:
    """Restore model, optimizer, scheduler, RNG and `progress` from a checkpoint folder (nothing when `path` is None).

    `path` comes from `find_checkpoint_to_resume`. The weights, the optimizer's moments, the schedule's step and the
    RNG come from the checkpoint; with the resume guard, the learning rate, schedule and optimizer settings from this
    run's flags (`extras.keep`).
    """
    extras = extras or CheckpointExtras()
    if path:
        if extras.check:
            extras.check(path)
        with extras.keep(accelerator) if extras.keep else nullcontext():
            accelerator.load_state(path, **extras.kwargs(loading=True))
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


def save_checkpoint(accelerator: Accelerator, output_dir: str, step: int, save_total_limit: int | None,
                    extras: CheckpointExtras | None = None) -> str | None:
    """Save the full training state (model, optimizer, scheduler, RNG, progress) on all ranks, publish it as
    `checkpoints/step_N`, then prune the oldest complete ones beyond `save_total_limit`.

    Returns the checkpoint's folder, or None when `extras.can_save` refused it (non-finite weights): nothing is
    saved, the reason is printed, and the run must stop with DIVERGED_STATUS. Collective: every process calls it. A
    failed save leaves the previous checkpoints untouched (its partial folder is a leftover the next start removes)."""
    extras = extras or CheckpointExtras()
    if extras.save:  # another way of saving (asynchronous: common/features/async_checkpoint.py)
        return extras.save(accelerator, output_dir, step, save_total_limit, extras)
    root = os.path.join(output_dir, CHECKPOINT_DIR)
    path, partial = os.path.join(root, f"step_{step}"), os.path.join(root, f"{LEFTOVER_PREFIX}step_{step}")
    if extras.can_save and not extras.can_save(accelerator, f"checkpoint {path}"):
        return None
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(partial, **extras.kwargs(loading=False))
    except Exception as exc:
        if extras.explain_failed_save:
            extras.explain_failed_save(exc, partial, step)
        raise
    accelerator.wait_for_everyone()  # every rank has written its part
    if accelerator.is_main_process and extras.write:
        extras.write(partial)
    accelerator.wait_for_everyone()
    files = extras.record_files(accelerator, partial) if extras.record_files else None
    if accelerator.is_main_process:
        marker = {"step": step, "metrics_rows": count_rows(os.path.join(output_dir, METRICS_FILE))}
        publish(partial, path, {**marker, "files": files} if files is not None else marker, save_total_limit)
    accelerator.wait_for_everyone()
    logger.info(f"Saved checkpoint {path}")
    return path


def publish(partial: str, path: str, marker: dict, save_total_limit: int | None) -> None:
    """Flush the finished save to disk, mark it complete, rename it into place (atomic on POSIX filesystems), then
    prune the oldest complete checkpoints beyond `save_total_limit`. The fsyncs make the marker mean "complete" even
    if the node loses power right after."""
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
    if save_total_limit:
        for old in complete_checkpoints(os.path.dirname(os.path.dirname(path)))[:-save_total_limit]:
            discard(old)


def find_checkpoint_to_resume(output_dir: str, value: str | None, accelerator: Accelerator | None = None,
                              verify: Callable[[str, Accelerator | None], str | None] | None = None) -> str | None:
    """The checkpoint folder `--resume_from_checkpoint value` names, or None to start fresh; one line if there is none
    or if it is damaged.

    `latest`: the newest complete checkpoint under output_dir (an error if there is none); `auto`: the newest complete
    one that verifies, else None (a requeued job runs the same command line whether or not a checkpoint exists); a
    path: itself, if it holds a checkpoint. With `verify` (common/features/checksums.py) a checkpoint is checked first:
    `auto` skips a damaged one with one line naming the file, `latest` and a path stop with one line. Collective when
    `accelerator` is given (each process checks a share of the files).
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
            problem = verify(path, accelerator) if verify else None
            if problem is None:
                return path
            if value == "latest":
                stop(f"--resume_from_checkpoint latest: {path} is damaged: {problem}; --resume_from_checkpoint auto "
                     "resumes the newest checkpoint that verifies")
            if accelerator is None or accelerator.is_main_process:
                logging.getLogger(__name__).warning(f"Skipping checkpoint {path}: {problem}; trying the one before it")
            damaged.append(f"{os.path.basename(path)}: {problem}")
        if damaged:
            stop(f"--resume_from_checkpoint auto: no checkpoint under {root} verifies ({'; '.join(damaged)}); remove "
                 "them to start fresh, or start over with --overwrite_output_dir instead of --resume_from_checkpoint")
        return None
    if value and not is_checkpoint(value):
        fail(f"--resume_from_checkpoint {value}: not a checkpoint (it holds no {RUN_RECORD}); pass an "
             "<output_dir>/checkpoints/step_N folder or `latest`")
    if value and verify and (problem := verify(value, accelerator)):
        stop(f"--resume_from_checkpoint {value} is damaged: {problem}; resume another checkpoint "
             "(--resume_from_checkpoint auto takes the newest one that verifies)")
    return value or None
