"""The output folder: leftovers of interrupted saves, `--overwrite_output_dir` once every check has passed, and
removals a kill midway never leaves half done."""

from __future__ import annotations

import glob
import os
import shutil

from accelerate import Accelerator

from common.paths import (CHECKPOINT_DIR, EXIT_STATUS_FILE, LEFTOVER_PREFIX, LOGS_DIR, MERGED_DIR, METRICS_FILE,
                          RESULTS_FILE)

# The export: the model and tokenizer, or a LoRA run's adapter (peft's adapter_config.json and model card README.md).
EXPORT_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
                "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "vocab.*", "merges.txt",
                "adapter_config.json", "README.md")
# What a run writes into --output_dir (`--overwrite_output_dir` removes these, other files stay).
RUN_OUTPUTS = (CHECKPOINT_DIR, LOGS_DIR, METRICS_FILE, RESULTS_FILE, MERGED_DIR, EXIT_STATUS_FILE) + EXPORT_FILES


def take_over_output_dir(accelerator: Accelerator, output_dir: str, overwrite_output_dir: bool) -> None:
    """Once every check that can fail has passed, before the run writes: with --overwrite_output_dir the previous run's
    outputs go now (checkpoints first: `latest` never resumes it), so bad input leaves them as they were."""
    if accelerator.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        if overwrite_output_dir:
            remove_previous_run(output_dir)
    accelerator.wait_for_everyone()


def remove_previous_run(output_dir: str) -> None:
    """Remove what an earlier run wrote into output_dir (see RUN_OUTPUTS); the checkpoints go first and in one
    rename, so a kill midway never leaves a checkpoint of the old run to resume."""
    for pattern in RUN_OUTPUTS:
        for path in glob.glob(os.path.join(glob.escape(output_dir), pattern)):
            discard(path) if os.path.isdir(path) else os.remove(path)


def discard(path: str) -> None:
    """Remove a folder so that a kill midway never leaves it half-deleted under its own name."""
    aside = os.path.join(os.path.dirname(path), f"{LEFTOVER_PREFIX}discarded-{os.path.basename(path)}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def remove_leftovers(output_dir: str) -> None:
    """Delete what interrupted saves, prunes, overwrites and metrics trims left (`.tmp-*`); main process, under the
    output folder's lock (no live run is writing them)."""
    for folder in (output_dir, os.path.join(output_dir, CHECKPOINT_DIR)):
        for name in os.listdir(folder) if os.path.isdir(folder) else []:
            if name.startswith(LEFTOVER_PREFIX):
                leftover = os.path.join(folder, name)
                shutil.rmtree(leftover, ignore_errors=True) if os.path.isdir(leftover) else os.remove(leftover)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
