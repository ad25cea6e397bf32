"""Cache entries under --cache_dir (trained tokenizers, the default corpora and tasks): each entry is a folder written
whole or not at all, so a kill, a full disk or two runs sharing the cache never leave a half-written entry to read.

An entry is built in a temporary folder beside it (locked while its builder lives, so the next build removes only
a killed one's), which gets a manifest (`cache.json`: the entry's key, the rows it covers where it has a count, every
file's size and xxh3-64) last and is then renamed into place: the rename is atomic, so an entry either exists
complete or not at all. Of two runs building the same entry, the first rename wins and the other uses it. A later run
checks the manifest before it reads the entry (xxh3-64 hashes ~20 GB/s: common/features/checksums.py): an entry that
fails the check (damaged since, written by an older version without a key, or another key's entry under this name: a
folder is named by a hash of its key, and folders get copied and moved) is set aside and rebuilt, with one line in the
log.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable

import xxhash

from common.errors import fail

logger = logging.getLogger(__name__)
MANIFEST = "cache.json"


def cached_folder(path: str, build: Callable[[str], None], what: str, key: str, rows: int | None = None) -> str:
    """`path`, complete: as found when its manifest holds and records `key` (and `rows`), else built by
    `build(folder)` into a temporary folder beside it and renamed into place. `what` names the entry in the log and in
    errors ("the default corpus"); `key` is what the folder's name is a hash of, `rows` the rows of data it covers."""
    problem = entry_problem(path, key, rows)
    if problem is None:
        return path
    if problem != "missing":
        logger.warning(f"cache entry {path} is damaged ({problem}): rebuilding it")
        set_aside(path)
    logger.info(f"Building {what} -> {path}")
    remove_abandoned_builds(path)
    temporary, building = f"{path}.tmp-{uuid.uuid4().hex[:12]}", None
    try:
        try:
            os.makedirs(temporary)
            building = os.open(temporary, os.O_RDONLY)  # locked while this process lives: not abandoned
            fcntl.flock(building, fcntl.LOCK_EX)
            build(temporary)
            files = {name: file_record(os.path.join(temporary, name)) for name in sorted(os.listdir(temporary))}
            manifest = {"key": key, **({"rows": rows} if rows is not None else {}), "files": files}
            write_and_sync(os.path.join(temporary, MANIFEST), json.dumps(manifest, indent=1))
        except Exception as e:  # a full disk, a read-only --cache_dir: nothing of the entry is left
            reason = write_error(e)
            if reason is None:
                raise
            fail(f"{what} could not be written to the cache ({path}): {reason}; free some space or choose "
                 "another --cache_dir")
        try:
            os.rename(temporary, path)
        except OSError:  # another run renamed its own build into place first: use that one
            if entry_problem(path, key, rows) is not None:
                raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
        if building is not None:
            os.close(building)
    problem = entry_problem(path, key, rows)
    if problem is not None:
        fail(f"cache entry {path} could not be written whole ({problem}): check the disk under --cache_dir")
    return path


def write_error(e: Exception) -> str | None:
    """What stopped a write: an OSError's reason, or that of a Rust library's own error (the tokenizers library's
    save raises a bare `Exception: No space left on device (os error 28)`); None for any other error."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    rust = re.fullmatch(r"(.+) \(os error \d+\)", str(e).strip())
    return rust.group(1) if rust else None


def remove_abandoned_builds(path: str) -> None:
    """Temporary folders of `path` that no live process holds locked: left by a killed build."""
    parent, prefix = os.path.dirname(path) or ".", os.path.basename(path) + ".tmp-"
    for name in os.listdir(parent) if os.path.isdir(parent) else []:
        if not name.startswith(prefix):
            continue
        try:
            held = os.open(os.path.join(parent, name), os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        except BlockingIOError:
            pass  # another run is building it now
        finally:
            os.close(held)


def entry_problem(path: str, key: str, rows: int | None = None) -> str | None:
    """None when `path` holds the entry of `key` (and `rows`), its manifest's files with their sizes and checksums;
    else what is wrong."""
    if not os.path.isdir(path):
        return "missing"
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"no readable {MANIFEST} with a key: damaged, or written by an older version"
    if manifest.get("key") != key:
        return f"its {MANIFEST} records another key: another entry moved or copied under this name"
    if manifest.get("rows") != rows:
        return f"its {MANIFEST} records {manifest.get('rows')} rows, not {rows}: another entry under this name"
    for name, recorded in files.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if file_record(file) != recorded:
            return f"{name} differs from what was written"
    return None


def file_record(path: str) -> dict:
    with open(path, "rb") as f:
        return {"bytes": os.path.getsize(path), "xxh3_64": xxhash.xxh3_64_hexdigest(f.read())}


def write_and_sync(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def set_aside(path: str) -> None:
    """Move a damaged entry out of the way (atomic, so a run reading it meanwhile reads it whole) and delete it."""
    aside = f"{path}.damaged-{uuid.uuid4().hex[:12]}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # another run set it aside first
        return
    shutil.rmtree(aside, ignore_errors=True)
