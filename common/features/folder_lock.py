"""One live run per output folder: an exclusive lock held for the run's life, so a second run started in the same
--output_dir (a double submit, a requeue racing the old job) is refused in one line before it writes anything."""

from __future__ import annotations

import atexit
import fcntl
import os
import socket
from typing import IO

from common.errors import fail
from common.paths import LOCK_FILE

_held_locks: dict[str, IO] = {}  # open for the process's life: the kernel drops the lock when the process dies


def lock_output_dir(output_dir: str, is_main_process: bool = True) -> None:
    """Hold an exclusive `flock` on <output_dir>/.lock until this process ends (also by SIGKILL or a crash: the kernel
    releases it, so no stale lock is ever left). On NFS, Linux maps flock to POSIX locks across nodes; Lustre needs
    the `flock` mount option. A folder or lock file created here goes again at exit if the run wrote nothing else
    there, in a folder that held files before too (bad input found after the lock leaves no trace)."""
    if not is_main_process:
        return
    key = os.path.realpath(output_dir)
    if key in _held_locks:  # this process already holds it (e.g. another --auto_find_batch_size attempt)
        return
    created_dir = not os.path.isdir(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    found = set(os.listdir(output_dir))
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
    if created_lock:
        atexit.register(_remove_if_unused, output_dir, created_dir, found)


def _remove_if_unused(output_dir: str, created_dir: bool, found: set[str]) -> None:
    """At exit: the lock file this run created, and the folder, when the run added nothing else to what the folder
    held (the lock file goes while still held, so no other run holds it then; rmdir removes only an empty folder)."""
    try:
        if set(os.listdir(output_dir)) - found == {LOCK_FILE}:
            os.remove(os.path.join(output_dir, LOCK_FILE))
            if created_dir:
                os.rmdir(output_dir)
    except OSError:
        pass  # another run has begun to use the folder meanwhile: it is theirs
