"""A full disk: telling it from other write errors, and the one line that says so (where, how much is free, which
checkpoint is intact, how to continue)."""

from __future__ import annotations

import errno
import functools
import os
import re
import shutil
from collections.abc import Callable

from common.checkpoint import complete_checkpoints
from common.errors import fail
from common.paths import CHECKPOINT_DIR, LEFTOVER_PREFIX

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def disk_refuses_writes(exc: BaseException, folder: str) -> bool:
    """Did a save fail because the disk is full (or the quota or file-size limit reached)?

    safetensors and Python report the errno; torch.save does not ("unexpected pos ..."), so the disk is also asked
    directly with a small write next to the partial save.
    """
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return True
        number = re.search(r"\(os error (\d+)\)", str(exc))  # safetensors' errors carry it in their text only
        if number and int(number.group(1)) in DISK_FULL_ERRNOS:
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


def disk_full_message(output_dir: str, step: int, previous: list[str]) -> str:
    """The one line a save that found the disk full ends the run with (`previous`: the complete checkpoints)."""
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


def stop_if_disk_full(exc: BaseException, partial: str, step: int) -> None:
    """`CheckpointExtras.explain_failed_save`: a save that failed on a full disk stops the run with one line, its
    partial folder removed and the previous checkpoints untouched; any other error is left to propagate."""
    if disk_refuses_writes(exc, partial):
        shutil.rmtree(partial, ignore_errors=True)
        output_dir = os.path.dirname(os.path.dirname(partial))  # <output_dir>/checkpoints/.tmp-step_N
        fail(disk_full_message(output_dir, step, complete_checkpoints(output_dir)))


def explain_full_disk(export: Callable) -> Callable:
    """`export` (common/export.py) whose write, failing on a full disk, stops every rank with one line."""
    return functools.partial(export, explain_failed_write=export_disk_full_message)


def export_disk_full_message(exc: BaseException, partial: str) -> str | None:
    """The one line an export that found the disk full ends the run with (None: another error)."""
    if not disk_refuses_writes(exc, partial):
        return None
    output_dir = os.path.dirname(partial)
    part = os.path.basename(partial)[len(LEFTOVER_PREFIX):]  # "export", or "merged": --merge_adapter's folder
    free_mib = shutil.disk_usage(output_dir).free / 2**20
    checkpoints = complete_checkpoints(output_dir)
    then = (f"rerun with --resume_from_checkpoint auto ({checkpoints[-1]} is intact)" if checkpoints else
            "rerun with --overwrite_output_dir (there is no checkpoint to resume)")
    target = output_dir if part == "export" else os.path.join(output_dir, part)
    return (f"disk full: the model could not be exported to {target} (filesystem {mount_point(output_dir)}, "
            f"{free_mib:.0f} MiB free after removing the partial export; nothing of it was left): free some space, "
            f"then {then}")
