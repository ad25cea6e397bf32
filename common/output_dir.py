"""One run per output folder: a lock held for the run's life (taken before any expensive work), the leftovers of
interrupted saves cleaned up, and `--overwrite_output_dir` removing the previous run once the new one has passed every
check that can fail before training."""

from __future__ import annotations

import argparse
import atexit
import fcntl
import glob
import os
import socket
from typing import IO

from accelerate import Accelerator

from common.checkpoint import discard, remove_leftovers
from common.errors import fail
from common.paths import CHECKPOINT_DIR, LOCK_FILE, LOGS_DIR, MERGED_DIR, METRICS_FILE, RESULTS_FILE

# The exported model's files: the model and tokenizer, or a LoRA run's adapter (peft's adapter_config.json,
# adapter_model.safetensors and its model card README.md).
EXPORT_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
                "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "vocab.*", "merges.txt",
                "adapter_config.json", "README.md")
# What a run writes into --output_dir (`--overwrite_output_dir` removes these; other files are left alone): its
# checkpoints, logs and metrics, the export, and --merge_adapter's merged model.
RUN_OUTPUTS = (CHECKPOINT_DIR, LOGS_DIR, METRICS_FILE, RESULTS_FILE, MERGED_DIR) + EXPORT_FILES
_held_locks: dict[str, IO] = {}  # open for the process's life: the kernel drops the lock when the process dies
_taken_over: set[str] = set()  # folders this process has begun to write into (see take_over_output_dir)


def claim_output_dir(args: argparse.Namespace, accelerator: Accelerator) -> None:
    """Make --output_dir this run's own, before any expensive work: refuse a folder a live run holds; remove leftovers
    of interrupted saves. The previous run's outputs stay until `take_over_output_dir`.

    Every process calls it; the main process does the work while the others wait (the folder must be on a
    filesystem they all share: the others do not create it, so a run that stops early leaves nothing behind).
    """
    if accelerator.is_main_process:
        lock_output_dir(args.output_dir)
        remove_leftovers(args.output_dir)
    accelerator.wait_for_everyone()


def take_over_output_dir(args: argparse.Namespace, accelerator: Accelerator) -> None:
    """Called once every check that can fail before training has passed (flags, data, model, resume guard), before
    the run writes anything: with --overwrite_output_dir the previous run's outputs go now (checkpoints first, so
    `latest` can never resume it), so a run stopped by bad input leaves them as they were. Every process calls it."""
    if accelerator.is_main_process:
        _taken_over.add(os.path.realpath(args.output_dir))
        if args.overwrite_output_dir:
            remove_previous_run(args.output_dir)
    accelerator.wait_for_everyone()


def lock_output_dir(output_dir: str) -> None:
    """Hold an exclusive `flock` on <output_dir>/.lock until this process ends (also by SIGKILL or a crash: the kernel
    releases it, so no stale lock is ever left). On NFS, Linux maps flock to POSIX locks across nodes; Lustre needs
    the `flock` mount option. The folder and the lock file are created if needed, and removed again if the process
    exits before `take_over_output_dir` (bad input writes nothing)."""
    key = os.path.realpath(output_dir)
    if key in _held_locks:  # this process already holds it (e.g. another --auto_find_batch_size attempt)
        return
    created_dir = not os.path.isdir(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, LOCK_FILE)
    created_lock = not os.path.exists(path)
    lock = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        fail(f"--output_dir {output_dir} is in use by a live run ({holder}); wait for it to end or choose another "
             "--output_dir")
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    lock.flush()
    _held_locks[key] = lock
    atexit.register(_undo_unused_claim, key, output_dir if created_dir else None, path if created_lock else None)


def _undo_unused_claim(key: str, created_dir: str | None, created_lock: str | None) -> None:
    """At exit, for a run that stopped before writing anything: remove the lock file and the folder it created (the
    lock file goes while still held, so no other run can be holding it then; rmdir only removes an empty folder)."""
    if key in _taken_over:
        return
    try:
        if created_lock:
            os.remove(created_lock)
        if created_dir:
            os.rmdir(created_dir)
    except OSError:
        pass  # another run has begun to use the folder meanwhile: it is theirs


def export_files(output_dir: str) -> list[str]:
    """The exported model's files in output_dir (EXPORT_FILES)."""
    found = {path for pattern in EXPORT_FILES for path in glob.glob(os.path.join(glob.escape(output_dir), pattern))}
    return sorted(path for path in found if os.path.isfile(path))


def remove_previous_run(output_dir: str) -> None:
    """Remove what an earlier run wrote into output_dir (see RUN_OUTPUTS); the checkpoints go first and in one
    rename, so a kill midway never leaves a checkpoint of the old run to resume."""
    for pattern in RUN_OUTPUTS:
        for path in glob.glob(os.path.join(glob.escape(output_dir), pattern)):
            discard(path) if os.path.isdir(path) else os.remove(path)
