"""Verifiable checkpoints: the completion marker lists every file of a checkpoint (all processes' files) with its size
and an xxh3-64 checksum of its whole content; a resume checks them before loading anything.

safetensors loads a file with a flipped byte without error, `torch.load` ignores one too, and a lost
`random_states_N.pkl` makes a resume inexact without a word: the marker alone ("complete") cannot tell a damaged
file. xxh3-64 (package `xxhash`, a dependency of `datasets`) hashes ~20 GB/s in memory on one core, so reading the
files costs more than hashing them. Each process checksums a share of the files (balanced by size), at save time and
at resume time; the shares are gathered, so every process reaches the same verdict.
"""

from __future__ import annotations

import json
import logging
import os

import xxhash
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object

from common.paths import COMPLETE_MARKER

CHECKSUM = "xxh3_64"
CHUNK_BYTES = 4 << 20  # fits the CPU caches: measured faster than larger reads


def file_checksum(path: str) -> str:
    """xxh3-64 of the whole file, as 16 hex digits."""
    digest, buffer = xxhash.xxh3_64(), bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def checkpoint_files(folder: str) -> list[str]:
    """Every file under `folder` but the marker, as sorted paths relative to it."""
    found = [os.path.relpath(os.path.join(root, name), folder) for root, _, names in os.walk(folder) for name in names]
    return sorted(name for name in found if name != COMPLETE_MARKER)


def share(sizes: dict[str, int], index: int, count: int) -> list[str]:
    """This process's part of the files: largest first, each to the least loaded process (the same on every rank)."""
    loads, mine = [0] * count, []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        least = loads.index(min(loads))
        loads[least] += sizes[name]
        if least == index:
            mine.append(name)
    return mine


def _processes(accelerator: Accelerator | None) -> tuple[int, int]:
    return (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)


def record_files(accelerator: Accelerator | None, folder: str) -> dict[str, dict] | None:
    """Size and checksum of every file of a finished save, `{name: {"bytes": n, "xxh3_64": hex}}`, for the marker.

    Collective: every process checksums its share; the main process gets the whole record, the others None. Without
    an accelerator (a background writer, common/features/async_checkpoint.py) this process checksums every file.
    """
    main = accelerator is None or accelerator.is_main_process
    names = [checkpoint_files(folder) if main else None]
    if accelerator is not None:
        broadcast_object_list(names)  # the main process's listing is the one it publishes
    sizes = {name: os.path.getsize(os.path.join(folder, name)) for name in names[0]}
    index, count = _processes(accelerator)
    mine = [(name, {"bytes": sizes[name], CHECKSUM: file_checksum(os.path.join(folder, name))})
            for name in share(sizes, index, count)]
    everything = gather_object([mine]) if count > 1 else [mine]
    return dict(sorted(item for part in everything for item in part)) if main else None


def recorded_files(folder: str) -> tuple[dict[str, dict] | None, str | None]:
    """The marker's file record, and a problem with the marker itself (None, None: a checkpoint saved before markers
    recorded files, or one without a marker)."""
    marker = os.path.join(folder, COMPLETE_MARKER)
    if not os.path.isfile(marker):
        return None, None
    try:
        with open(marker, encoding="utf-8") as f:
            return json.load(f).get("files"), None
    except (OSError, ValueError, AttributeError):
        return None, f"{COMPLETE_MARKER} does not parse"


def file_problem(folder: str, name: str, recorded: dict) -> str | None:
    """What is wrong with one recorded file (missing, truncated, another size, another checksum), or None."""
    path = os.path.join(folder, name)
    try:
        size = os.path.getsize(path)
        if size < recorded["bytes"]:
            return f"{name} is truncated ({size:,} of {recorded['bytes']:,} bytes)"
        if size > recorded["bytes"]:
            return f"{name} has {size:,} bytes, {recorded['bytes']:,} recorded"
        if file_checksum(path) != recorded[CHECKSUM]:
            return f"{name} fails its checksum (content changed, same size)"
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as e:
        return f"{name} cannot be read ({e.strerror})"
    return None


def verify(folder: str, accelerator: Accelerator | None = None) -> tuple[bool, str | None]:
    """Check a checkpoint against its marker: (verified, the first problem in file-name order).

    (False, None): nothing to check against (no marker, or a marker without a file record). Collective when an
    accelerator is given: each process checks a share; all return the same answer.
    """
    files, problem = recorded_files(folder)
    if problem or files is None:
        return False, problem
    index, count = _processes(accelerator)
    mine = [(name, found) for name in share({n: r["bytes"] for n, r in files.items()}, index, count)
            if (found := file_problem(folder, name, files[name]))]
    problems = sorted(gather_object(mine) if count > 1 else mine)
    return True, problems[0][1] if problems else None


def verify_checkpoint(path: str, accelerator: Accelerator | None) -> str | None:
    """The first problem of a checkpoint's files, or None (`CheckpointExtras.verify`); a checkpoint with nothing to
    check against (saved before markers recorded files, or without a marker) passes with a warning line."""
    verified, problem = verify(path, accelerator)
    if not verified and problem is None and (accelerator is None or accelerator.is_main_process):
        logging.getLogger(__name__).warning(f"{path} records no file sizes or checksums (saved by an older version, "
                                            "or not marked complete): resuming it unverified")
    return problem
