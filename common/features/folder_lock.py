"""One live run per output folder: an exclusive lock held for the run's life, so a second run started in the same
--output_dir (a double submit, a requeue racing the old job) is refused in one line before it writes anything."""

from __future__ import annotations

import atexit
import errno
import fcntl
import os
import socket
from typing import IO

from common.errors import fail
from common.paths import EXIT_STATUS_FILE, LOCK_FILE

_held_locks: dict[str, IO] = {}  # open for the process's life: the kernel drops the lock when the process dies


def lock_output_dir(output_dir: str, is_main_process: bool = True) -> None:
    """Hold an exclusive `flock` on <output_dir>/.lock until this process ends (also by SIGKILL or a crash: the kernel
    releases it, so no stale lock is ever left). On NFS, Linux maps flock to POSIX locks across nodes; Lustre needs
    the `flock` mount option. A run that changes nothing in the folder (bad input found after the lock) leaves no
    trace at exit: a folder or lock file it created goes again, a lock file it found gets back what it held (the
    previous run's pid). A full disk or an unwritable place is one line, the folder as it was."""
    if not is_main_process:
        return
    key = os.path.realpath(output_dir)
    if key in _held_locks:  # this process already holds it (e.g. another --auto_find_batch_size attempt)
        return
    created_dir = not os.path.isdir(output_dir)
    path = os.path.join(output_dir, LOCK_FILE)
    created_lock = not os.path.exists(path)
    try:
        os.makedirs(output_dir, exist_ok=True)
        found = folder_state(output_dir)
        lock = open(path, "a+", encoding="utf-8")
    except OSError as exc:
        if created_dir and os.path.isdir(output_dir) and not os.listdir(output_dir):
            os.rmdir(output_dir)
        fail(cannot_lock(output_dir, path, exc))
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        fail(f"--output_dir {output_dir} is in use by a live run ({holder}); wait for it to end or choose another "
             "--output_dir")
    lock.seek(0)
    previous = lock.read()
    _held_locks[key] = lock
    atexit.register(_remove_if_unused, output_dir, created_dir, created_lock, found, previous)
    try:
        write_holder(lock, f"pid {os.getpid()} on {socket.gethostname()}\n")
    except OSError as exc:
        fail(cannot_lock(output_dir, path, exc))  # at exit the lock file goes, or gets back what it held


def write_holder(lock: IO, text: str) -> None:
    lock.seek(0)
    lock.truncate()
    lock.write(text)
    lock.flush()


def folder_state(folder: str) -> dict[str, tuple[int, int]]:
    """Each entry of `folder` (the lock file and exit_status.json with its reserved room aside) with its modification
    time and size: what a run changes."""
    state = {}
    for entry in os.scandir(folder):
        # the lock, the record of how a command ended and its room (common/features/exit_status.py's RESERVED_FILE)
        if entry.name != LOCK_FILE and not entry.name.endswith(EXIT_STATUS_FILE):
            stat = entry.stat(follow_symlinks=False)
            state[entry.name] = (stat.st_mtime_ns, stat.st_size)
    return state


def cannot_lock(output_dir: str, path: str, exc: OSError) -> str:
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return (f"--output_dir {output_dir}: its lock file {path} could not be written ({exc.strerror or exc}); nothing "
            f"in the folder was changed: {'free some space' if full else 'make it writable or choose another one'}, "
            "then rerun")


def _remove_if_unused(output_dir: str, created_dir: bool, created_lock: bool, found: dict, previous: str) -> None:
    """At exit, when the run changed nothing in the folder: the lock file it created goes (while still held, so no
    other run holds it then), with the folder if the run created it (rmdir removes only an empty folder); a lock file
    it found gets back the previous holder's line."""
    path = os.path.join(output_dir, LOCK_FILE)
    try:
        if folder_state(output_dir) != found:
            return  # the run wrote there: the lock file names it
        if created_lock:
            if os.path.exists(path):
                os.remove(path)
            if created_dir:
                os.rmdir(output_dir)
        elif os.path.realpath(output_dir) in _held_locks:
            write_holder(_held_locks[os.path.realpath(output_dir)], previous)
    except OSError:
        pass  # another run has begun to use the folder meanwhile: it is theirs
