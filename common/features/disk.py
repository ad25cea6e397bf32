"""A full disk: telling it from other write errors, and the one line that says so (where, how much is free, which
checkpoint is intact, how to continue): for checkpoints and exports where they are written, for every other write of
a run (metrics.jsonl, all_results.json, the trackers' files) around the recipe's `train`."""

from __future__ import annotations

import errno
import functools
import io
import os
import re
import shutil
import threading
from collections.abc import Callable

from common.checkpoint import CheckpointExtras, complete_checkpoints
from common.errors import fail
from common.paths import CHECKPOINT_DIR, LEFTOVER_PREFIX

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
UNWRITABLE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)  # a place the run may not write


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


def stop_on_full_disk(train: Callable[..., int], output_dir: str, extras: CheckpointExtras) -> Callable[..., int]:
    """`train` (the recipe's run), where a write that finds the disk full or its place unwritable stops the run with
    one line naming the file and what is intact, exit status 2. A checkpoint being written in the background then is
    waited for (this process's part): unpublished, its partial folder is removed and the line is the one a blocking
    save gives, whichever write met the full disk first."""
    @functools.wraps(train)
    def guarded(*args, **kwargs) -> int:
        print_thread_error, threading.excepthook = threading.excepthook, quiet_kept_write_errors(threading.excepthook)
        try:
            return train(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - Rust libraries raise a bare Exception "... (os error 28)"
            number = refused_write_errno(exc)
            if number is None:
                raise
            settle = getattr(extras.save, "settle", None)  # an asynchronous checkpoint's (--async_checkpointing)
            unpublished = settle() if settle else None
            if unpublished:
                partial, step = unpublished
                shutil.rmtree(partial, ignore_errors=True)
                if number in DISK_FULL_ERRNOS:
                    fail(disk_full_message(output_dir, step, complete_checkpoints(output_dir)))
            fail(unwritten_message(written_file(exc) or output_dir, number, output_dir))
        finally:
            threading.excepthook = print_thread_error
    return guarded


def quiet_kept_write_errors(print_thread_error: Callable) -> Callable:
    """threading.excepthook that does not print a refused write in a thread that keeps its error for its owner:
    TensorBoard's event writer (`_AsyncWriterThread.exception`, raised again by the tracker's next call in the
    run's thread, where the one line names the file). Any other thread's error is printed as before."""
    def hook(args: threading.ExceptHookArgs) -> None:
        kept = getattr(args.thread, "exception", None) is args.exc_value
        if not (kept and refused_write_errno(args.exc_value) is not None):
            print_thread_error(args)
    return hook


def refused_write_errno(exc: BaseException | None) -> int | None:
    """The errno of a full disk or an unwritable place anywhere in the exception's chain, else None."""
    while exc is not None:
        number = exc.errno if isinstance(exc, OSError) else None
        rust = re.search(r"\(os error (\d+)\)", str(exc)) if number is None else None
        number = int(rust.group(1)) if rust else number
        if number in DISK_FULL_ERRNOS + UNWRITABLE_ERRNOS:
            return number
        exc = exc.__cause__ or exc.__context__
    return None


def written_file(exc: BaseException) -> str | None:
    """The file a failed write was writing: the error's filename, else the file object open in the innermost frame of
    the traceback that holds one (Python reports a failed write or flush without the file's name)."""
    if getattr(exc, "filename", None):
        return os.fsdecode(exc.filename)
    found, frame = None, exc.__traceback__
    while frame is not None:
        for value in frame.tb_frame.f_locals.values():
            if isinstance(value, io.IOBase) and isinstance(getattr(value, "name", None), (str, bytes)):
                found = os.fsdecode(value.name)  # TensorBoard opens its event files by bytes names
        frame = frame.tb_next
    return found


def unwritten_message(path: str, number: int, output_dir: str) -> str:
    """The one line for a write outside checkpoints and exports that failed (`number`: its errno)."""
    checkpoints = complete_checkpoints(output_dir)
    then = (f"rerun with --resume_from_checkpoint auto ({checkpoints[-1]} is intact)" if checkpoints else
            "rerun with --overwrite_output_dir (there is no checkpoint to resume)")
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    if number in DISK_FULL_ERRNOS:
        free_mib = shutil.disk_usage(folder).free / 2**20
        return (f"disk full: {path} could not be written (filesystem {mount_point(folder)}, {free_mib:.0f} MiB free): "
                f"free some space, then {then}")
    return f"{path} could not be written ({os.strerror(number)}): make it writable, then {then}"
