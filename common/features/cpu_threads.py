"""CPU runs: share the machine's cores among the local processes (a speed feature; on a GPU it does nothing)."""

from __future__ import annotations

import os
import warnings

import torch


def use_all_cores() -> None:
    """Share the cores among the local processes of a CPU run (nothing with CUDA).

    `accelerate launch` without `--cpu` starts each process with OMP_NUM_THREADS=1, which halves the speed of a
    one-process run on a 2-core machine. A value the user set (1 included) is kept.
    """
    if torch.cuda.is_available():
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_processes > cores and os.environ.get("LOCAL_RANK", "0") == "0":
        # accelerate takes the count from the config file, never from the machine (a GPU config says 8), but a
        # parallelism_config (tp.yaml, fsdp2_tp.yaml) fixes it: the product of its sizes
        sizes = {name[len("PARALLELISM_CONFIG_"):-len("_SIZE")].lower(): int(value) for name, value in os.environ.items()
                 if name.startswith("PARALLELISM_CONFIG_") and name.endswith("_SIZE") and value.isdigit()}
        mesh = {name: size for name, size in sorted(sizes.items()) if size > 1}
        if mesh:
            warnings.warn(f"{local_processes} processes share {cores} CPU cores on this machine: the config's "
                          f"parallelism_config ({' x '.join(f'{n} {s}' for n, s in mesh.items())}) needs "
                          f"{local_processes}; expect a slow run, or lower its sizes in the config file")
        else:
            warnings.warn(f"{local_processes} processes share {cores} CPU cores on this machine: pass --num_processes "
                          f"{cores} (or fewer) after --config_file to `accelerate launch`")
    if os.environ.get("OMP_NUM_THREADS", "1") != "1" or omp_threads_set_by_user():
        return
    torch.set_num_threads(max(1, cores // local_processes))


def omp_threads_set_by_user() -> bool:
    """Whether the user set OMP_NUM_THREADS. A launcher (accelerate launch, torchrun) sets it to 1 in the processes
    it starts when the user did not, so there the launcher's own environment, as it was started, tells (Linux)."""
    if "ACCELERATE_DYNAMO_BACKEND" not in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ:  # no launcher
        return "OMP_NUM_THREADS" in os.environ
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            return any(entry.startswith(b"OMP_NUM_THREADS=") for entry in f.read().split(b"\0"))
    except OSError:  # elsewhere: a 1 reads as the launcher's
        return False
