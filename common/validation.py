"""Cheap checks of the shared flags, run before anything expensive (tokenizer training, dataset loading, model
building): a bad value stops the run with one line, `error: ...`, and exit status 2. They only check: nothing here
changes `args` or the environment."""

from __future__ import annotations

import argparse
import os

import torch

from common.data import DATA_EXTENSIONS, data_format
from common.errors import fail
from common.modeling import missing_local_path
from common.paths import METRICS_FILE


def check_common_flags(args: argparse.Namespace) -> None:
    """The flags of common/flags.py's model, data and training groups; hub ids are not checked here (they fail at
    load time with the hub's message)."""
    check_data_files(args.train_file, args.validation_file)
    for name in ("model_name_or_path", "config_name", "tokenizer_name"):
        value = getattr(args, name, None)
        if value and missing_local_path(value):  # else transformers takes it for a hub id with a confusing message
            fail(f"--{name} {value}: no such folder")
    if args.dataset_name and args.train_file:
        fail("give either --dataset_name or --train_file, not both")
    if not 0 <= args.validation_split_percentage < 100:  # 100 would leave nothing to train on
        fail(f"--validation_split_percentage must be between 0 and 99 (got {args.validation_split_percentage})")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                 "logging_steps", "max_nonfinite_steps"):
        if getattr(args, name) < 1:
            fail(f"--{name} must be >= 1 (got {getattr(args, name)})")
    for name in ("eval_steps", "checkpointing_steps", "save_total_limit", "max_train_samples", "max_eval_samples"):
        value = getattr(args, name)
        if value is not None and value < 1:
            fail(f"--{name} must be >= 1 (got {value})")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        fail(f"--warmup_steps must be >= 0 (got {args.warmup_steps})")
    if args.ddp_timeout <= 0:
        fail(f"--ddp_timeout must be > 0 seconds (got {args.ddp_timeout})")
    if args.learning_rate <= 0:
        fail(f"--learning_rate must be > 0 (got {args.learning_rate})")
    if args.max_steps <= 0 and args.num_train_epochs <= 0:
        fail("set --max_steps > 0 or --num_train_epochs > 0")
    if args.warmup_steps is not None and 0 < args.max_steps < args.warmup_steps:
        fail(f"--warmup_steps {args.warmup_steps} is more than the run's --max_steps {args.max_steps}: the learning "
             "rate would never reach --learning_rate")
    check_output_dir(args)
    check_precision(args)
    if args.report_to not in ("none", "all"):
        from accelerate.utils import is_tensorboard_available, is_trackio_available, is_wandb_available

        available = {"tensorboard": is_tensorboard_available, "trackio": is_trackio_available,
                     "wandb": is_wandb_available}[args.report_to]()
        if not available:
            fail(f"--report_to {args.report_to}: the package is not installed (pip install {args.report_to})")


def check_data_files(train_file: str | None, validation_file: str | None) -> None:
    for flag, path in (("--train_file", train_file), ("--validation_file", validation_file)):
        if path is None:
            continue
        if os.path.isdir(path):
            fail(f"{flag} {path}: is a folder; pass a file (for a folder of files use --dataset_name {path})")
        if not os.path.isfile(path):
            fail(f"{flag} {path}: no such file")
        if os.path.splitext(path)[1].lower() not in DATA_EXTENSIONS:
            fail(f"{flag} {path}: unsupported extension (use one of {', '.join(DATA_EXTENSIONS)})")
        if os.path.getsize(path) == 0:
            fail(f"{flag} {path}: the file is empty")
        if holds_only_whitespace(path):  # datasets would say "Couldn't cast"
            fail(f"{flag} {path}: the file holds only whitespace, no rows")
    if validation_file and not train_file:
        fail("--validation_file needs --train_file")
    if validation_file and data_format(train_file) != data_format(validation_file):
        fail(f"--train_file {train_file} and --validation_file {validation_file} must have the same format "
             f"({data_format(train_file)} vs {data_format(validation_file)})")


def holds_only_whitespace(path: str) -> bool:
    """Reads up to the first byte that is not whitespace: the start of the file, for any file with data."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return False
    return True


def check_output_dir(args: argparse.Namespace) -> None:
    """--output_dir is writable, and a used one is continued or overwritten on purpose, never both."""
    resume_value = args.resume_from_checkpoint
    if resume_value and resume_value not in ("latest", "auto") and not os.path.isdir(resume_value):
        fail(f"--resume_from_checkpoint {resume_value}: no such folder")
    if args.overwrite_output_dir and resume_value and (resume_value in ("latest", "auto") or os.path.commonpath(
            [os.path.abspath(resume_value), os.path.abspath(args.output_dir)]) == os.path.abspath(args.output_dir)):
        fail(f"--overwrite_output_dir removes the previous run's checkpoints; it cannot be combined with "
             f"--resume_from_checkpoint {resume_value}")
    used = os.path.isfile(os.path.join(args.output_dir, METRICS_FILE))
    if used and not resume_value and not args.overwrite_output_dir:
        fail(f"--output_dir {args.output_dir} already holds a run; pass --resume_from_checkpoint latest to continue"
             " it or --overwrite_output_dir to start over")
    check_writable_folder(args.output_dir, "--output_dir")


def check_precision(args: argparse.Namespace) -> None:
    if args.mixed_precision == "fp16" and not torch.cuda.is_available():
        fail("fp16 mixed precision needs a CUDA GPU (fp16 loss scaling is not supported on CPU); use --bf16")
    if args.mixed_precision == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        fail("this GPU does not support bf16; use --fp16")
    if args.tf32 and not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8):
        fail("--tf32 needs an NVIDIA GPU of the Ampere generation or newer")


def check_writable_folder(path: str, flag: str) -> None:
    """The folder, or the nearest existing folder above it, must be writable (checked without creating anything)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        fail(f"{flag} {path}: cannot write there ({existing} is not a writable folder)")


def check_finetuning_flags(args: argparse.Namespace) -> None:
    """Fine-tuning starts from pretrained weights; the shared and the fine-tuning flags."""
    check_common_flags(args)
    if not args.model_name_or_path:
        fail("fine-tuning needs --model_name_or_path (a local folder or a hub id)")
    if args.config_name:
        fail("--config_name builds a model from scratch; fine-tuning loads --model_name_or_path")
    if args.max_seq_length is not None and args.max_seq_length < 2:
        fail(f"--max_seq_length must be >= 2 (got {args.max_seq_length})")
    if args.freeze_layers < 0:
        fail(f"--freeze_layers must be >= 0 (got {args.freeze_layers})")
    check_peft_flags(args)


def check_peft_flags(args: argparse.Namespace) -> None:
    """The LoRA / QLoRA group (common/flags.py add_peft_args); --lora_target_modules is checked against the model
    in common/adapters.py."""
    if args.load_in_4bit and not args.use_peft:
        fail("--load_in_4bit needs --use_peft: a 4-bit base cannot be trained, QLoRA trains a LoRA adapter on it")
    if args.merge_adapter and not args.use_peft:
        fail("--merge_adapter needs --use_peft: without it the run trains the whole model, no adapter to merge")
    if not args.use_peft:
        return
    if args.lora_r < 1 or args.lora_alpha <= 0:
        fail(f"--lora_r must be >= 1 and --lora_alpha > 0 (got {args.lora_r} and {args.lora_alpha})")
    if not 0 <= args.lora_dropout < 1:
        fail(f"--lora_dropout must be in [0, 1) (got {args.lora_dropout})")
    if "all-linear" in args.lora_target_modules and len(args.lora_target_modules) > 1:
        fail("--lora_target_modules all-linear already takes every linear layer: give it alone or list names")
    for flag in ("freeze_embeddings", "freeze_layers"):
        if getattr(args, flag):
            fail(f"--{flag} does nothing with --use_peft: the whole base model is frozen, only the adapter trains")
