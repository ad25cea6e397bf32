"""Builds the Accelerator (device/backend choice, precision, accumulation, trackers, seed) and tears it down."""

from __future__ import annotations

import argparse
import logging
import os
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import (DataLoaderConfiguration, GradientAccumulationPlugin, InitProcessGroupKwargs,
                              ProjectConfiguration, set_seed)


logger = get_logger(__name__)


def build_accelerator(args: argparse.Namespace) -> Accelerator:
    """One Accelerator for every launch: plain python, `accelerate launch` (1..N processes), DeepSpeed, FSDP. Without
    CUDA two traps are avoided (measured, see docs/techniques.md "CPU runs"): DDP launched without `cpu=True` starts N
    *unsynchronised* processes without any error; DeepSpeed needs the gloo backend named explicitly, and `cpu=True`
    would silently turn DeepSpeed off. (FSDP with `cpu=True` becoming plain DDP: common/features/fsdp_on_cpu.py.)
    """
    extra, backend = {}, None
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would otherwise warn while guessing it
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            backend = "gloo"
        else:
            extra["cpu"] = True
    extra["kwargs_handlers"] = [process_group_kwargs(args.ddp_timeout, backend)]
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


def process_group_kwargs(timeout_seconds: float, backend: str | None = None) -> InitProcessGroupKwargs:
    """Process-group settings under which a collective that cannot complete fails after `timeout_seconds`.

    accelerate passes on only values that differ from `InitProcessGroupKwargs()`'s defaults (nccl, 600 s): exactly
    600 s would be dropped and gloo's default (30 min) used, so one microsecond more keeps it."""
    timeout = timedelta(seconds=timeout_seconds)
    if timeout == InitProcessGroupKwargs().timeout:
        timeout += timedelta(microseconds=1)
    return InitProcessGroupKwargs(timeout=timeout, **({"backend": backend} if backend else {}))
