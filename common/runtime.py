"""Builds the Accelerator (device/backend choice, precision, accumulation, trackers, seed) and tears it down."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
    set_seed,
)

from common.errors import StopTraining, fail
from common.deepspeed_check import check_deepspeed_config
from common.preemption import stop_when_launcher_dies

logger = get_logger(__name__)


def build_accelerator(args: argparse.Namespace) -> Accelerator:
    """One Accelerator for every launch: plain python, `accelerate launch` (1..N processes), DeepSpeed, FSDP.

    On machines without CUDA two traps are avoided (measured, see README "CPU runs"):
    - DDP launched without `cpu=True` starts N *unsynchronised* processes without any error;
    - DeepSpeed needs the gloo backend named explicitly, and `cpu=True` would silently turn DeepSpeed off.
    """
    check_deepspeed_config(args)  # a DeepSpeed JSON contradicting the flags: one error line, before any work
    stop_when_launcher_dies()  # a launcher killed alone must not leave this process training, orphaned
    extra = {}
    if not torch.cuda.is_available():
        use_all_cores()
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would otherwise warn while guessing it
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            fail("FSDP needs CUDA GPUs (on CPU it would quietly run as plain DDP); use accelerate_configs/cpu_2proc.yaml"
                 " or a DeepSpeed ZeRO config")
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            extra["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
        else:
            extra["cpu"] = True
    if getattr(args, "torch_compile", False):
        extra["dynamo_plugin"] = TorchDynamoPlugin(backend="inductor")
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        # Windows always hold exactly `gradient_accumulation_steps` micro-batches (see common/accumulation.py), so
        # the sync points never depend on where the dataloader ends.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False),
        # The scheduler is stepped by the script once per optimizer step, so it counts optimizer steps.
        step_scheduler_with_optimizer=False,
        # Same shuffling for any number of processes and after a resume.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        log_with=None if args.report_to == "none" else args.report_to,
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, "logs")),
        **extra,
    )
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        level=logging.INFO if accelerator.is_local_main_process else logging.ERROR)
    if not accelerator.is_local_main_process:
        import datasets
        import transformers

        datasets.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()
    set_seed(args.seed)
    logger.info(accelerator.state, main_process_only=True)
    return accelerator


def init_trackers(accelerator: Accelerator, args: argparse.Namespace, project: str) -> None:
    """Start the --report_to trackers, with the run's scalar flags as its config (trackers reject None and lists)."""
    if args.report_to != "none":
        accelerator.init_trackers(project, config={k: v for k, v in vars(args).items()
                                                   if isinstance(v, (int, float, str, bool))})


def use_all_cores() -> None:
    """CPU runs: share the machine's cores among the local processes.

    `accelerate launch` without `--cpu` starts each process with OMP_NUM_THREADS=1, which halves the speed of a
    one-process run on a 2-core machine. A value other than 1 is taken as the user's choice and kept.
    """
    if os.environ.get("OMP_NUM_THREADS", "1") != "1":
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(threads)


def finish(accelerator: Accelerator) -> None:
    """End trackers and the process group once the script's models are gone.

    Call it after the function that held the prepared model has returned: a DDP model still alive when the
    gloo group is destroyed makes the process abort at exit now and then.
    """
    accelerator.free_memory()
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()


@contextmanager
def finishing(accelerator: Accelerator) -> Iterator[None]:
    """Run the training inside; then `finish`, also when it stopped early on purpose (`StopTraining`: a stop signal
    after its checkpoint, a diverged run), and exit with that stop's status."""
    status = 0
    try:
        yield
    except StopTraining as stop:
        status = stop.code
        traceback.clear_frames(stop.__traceback__)  # the loop's frames hold the model: free it before `finish`
    finish(accelerator)
    if status:
        raise SystemExit(status)
