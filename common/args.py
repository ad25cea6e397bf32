"""Shared command-line argument groups (Hugging Face `TrainingArguments` names) and cheap validation.

Every check here runs before anything expensive (tokenizer training, dataset loading, model building) and fails
with one line: `error: ...`.
"""

from __future__ import annotations

import argparse
import os

import torch

from common.checkpoint import RUN_RECORD, is_checkpoint, resolve_resume_path
from common.errors import fail
from common.modeling import PRESETS, missing_local_path

OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "adafactor")
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "cosine_with_min_lr", "inverse_sqrt")
DATA_EXTENSIONS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (no usage dump) and exit status 2."""

    def error(self, message: str):  # noqa: D102
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_model_args(parser: argparse.ArgumentParser, presets: tuple[str, ...]) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model_name_or_path", help="Pretrained checkpoint (local path or hub id) to start from.")
    g.add_argument("--config_name", help="Model config (path or hub id) to build a model from scratch.")
    if presets:  # scripts that only fine-tune have no from-scratch presets
        g.add_argument("--model_preset", choices=presets, help="Named architecture built from scratch (default: tiny).")
    g.add_argument("--tokenizer_name", help="Tokenizer (path or hub id). Default: the model's, else one trained here.")
    g.add_argument("--attn_implementation", default="sdpa", choices=("sdpa", "eager", "flash_attention_2"))
    g.add_argument("--gradient_checkpointing", action="store_true", help="Recompute activations (non-reentrant).")
    g.add_argument("--torch_compile", action="store_true", help="torch.compile the model (inductor).")


def add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data")
    g.add_argument("--dataset_name", help="Dataset on the hub (or a local dataset folder), via `datasets`.")
    g.add_argument("--dataset_config_name")
    g.add_argument("--train_file", help="txt, json/jsonl, csv or parquet file.")
    g.add_argument("--validation_file")
    g.add_argument("--validation_split_percentage", type=int, default=5,
                   help="Held-out share of train when there is no validation split.")
    g.add_argument("--text_column", default="text")
    g.add_argument("--max_train_samples", type=int, help="Keep only the first N training rows (debugging).")
    g.add_argument("--max_eval_samples", type=int)
    g.add_argument("--preprocessing_num_workers", type=int, default=None, help="num_proc for datasets.map.")
    g.add_argument("--dataloader_num_workers", type=int, default=0)
    g.add_argument("--dataloader_pin_memory", type=lambda s: s.lower() in ("1", "true", "yes"), default=True)
    g.add_argument("--cache_dir", default=os.environ.get("TRAIN_SCRIPTS_CACHE",
                   os.path.join(os.path.expanduser("~"), ".cache", "accelerate-training-scripts")),
                   help="Where the embedded corpus and trained tokenizers are cached.")


def add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--output_dir", default="outputs/run")
    g.add_argument("--seed", type=int, default=42)
    g.add_argument("--per_device_train_batch_size", type=int, default=8)
    g.add_argument("--per_device_eval_batch_size", type=int, default=8)
    g.add_argument("--gradient_accumulation_steps", type=int, default=1)
    g.add_argument("--learning_rate", type=float, default=5e-4)
    g.add_argument("--weight_decay", type=float, default=0.1)
    g.add_argument("--adam_beta1", type=float, default=0.9)
    g.add_argument("--adam_beta2", type=float, default=0.95)
    g.add_argument("--adam_epsilon", type=float, default=1e-8)
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="0 disables clipping (the norm is still logged).")
    g.add_argument("--max_nonfinite_steps", type=int, default=5,
                   help="Stop (exit status 3) after this many optimizer steps in a row with a NaN/inf loss or gradient "
                        "norm (each one's update is skipped).")
    g.add_argument("--optim", default="adamw_torch", choices=OPTIMIZERS)
    g.add_argument("--lr_scheduler_type", default="cosine", choices=SCHEDULERS)
    g.add_argument("--warmup_steps", type=int, default=None, help="Default: 5%% of the optimizer steps.")
    g.add_argument("--num_train_epochs", type=float, default=1.0)
    g.add_argument("--max_steps", type=int, default=-1, help="Optimizer steps; overrides --num_train_epochs if > 0.")
    g.add_argument("--mixed_precision", choices=("no", "fp16", "bf16"), default=None,
                   help="Default: what `accelerate launch`/its config says, else no.")
    g.add_argument("--bf16", dest="mixed_precision", action="store_const", const="bf16")
    g.add_argument("--fp16", dest="mixed_precision", action="store_const", const="fp16")
    g.add_argument("--tf32", action="store_true", help="Allow TF32 matmuls (Ampere or newer GPUs).")
    g.add_argument("--logging_steps", type=int, default=10)
    g.add_argument("--eval_steps", type=int, default=None, help="Evaluate every N optimizer steps (and at the end).")
    g.add_argument("--checkpointing_steps", type=int, default=None, help="Save a resumable checkpoint every N steps.")
    g.add_argument("--save_total_limit", type=int, default=2, help="Keep only the newest N checkpoints.")
    g.add_argument("--resume_from_checkpoint",
                   help="A checkpoint folder; `latest`: the newest complete one in --output_dir/checkpoints (an error "
                        "if none); `auto`: the same, or start fresh when there is none (one command line for a "
                        "requeued job).")
    g.add_argument("--overwrite_output_dir", action="store_true",
                   help="Start over in a used --output_dir: the previous run's checkpoints, metrics and exported "
                        "model are removed.")
    g.add_argument("--report_to", default="none", choices=("none", "all", "tensorboard", "trackio", "wandb"))
    g.add_argument("--ddp_timeout", type=float, default=1800,
                   help="Seconds a collective (all-reduce, barrier, ...) may wait for the other processes before the "
                        "run fails with a timeout error instead of hanging.")


def validate_common(args: argparse.Namespace) -> None:
    """Cheap checks of shared flags; hub ids are not checked here (they fail at load time with the hub's message)."""
    for name in ("train_file", "validation_file"):
        path = getattr(args, name, None)
        if path is None:
            continue
        if not os.path.isfile(path):
            fail(f"--{name} {path}: no such file")
        if os.path.splitext(path)[1].lower() not in DATA_EXTENSIONS:
            fail(f"--{name} {path}: unsupported extension (use one of {', '.join(DATA_EXTENSIONS)})")
        if os.path.getsize(path) == 0:
            fail(f"--{name} {path}: the file is empty")
    train_file, validation_file = getattr(args, "train_file", None), getattr(args, "validation_file", None)
    if validation_file and not train_file:
        fail("--validation_file needs --train_file")
    if validation_file and data_format(train_file) != data_format(validation_file):
        fail(f"--train_file {train_file} and --validation_file {validation_file} must have the same format "
             f"({data_format(train_file)} vs {data_format(validation_file)})")
    for name in ("model_name_or_path", "config_name", "tokenizer_name"):
        value = getattr(args, name, None)
        if value and missing_local_path(value):  # else transformers takes it for a hub id with a confusing message
            fail(f"--{name} {value}: no such folder")
    if getattr(args, "dataset_name", None) and getattr(args, "train_file", None):
        fail("give either --dataset_name or --train_file, not both")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                 "logging_steps", "max_nonfinite_steps"):
        if getattr(args, name) < 1:
            fail(f"--{name} must be >= 1 (got {getattr(args, name)})")
    for name in ("eval_steps", "checkpointing_steps", "save_total_limit"):
        value = getattr(args, name)
        if value is not None and value < 1:
            fail(f"--{name} must be >= 1 (got {value})")
    if args.ddp_timeout <= 0:
        fail(f"--ddp_timeout must be > 0 seconds (got {args.ddp_timeout})")
    if args.learning_rate <= 0:
        fail(f"--learning_rate must be > 0 (got {args.learning_rate})")
    if args.max_steps <= 0 and args.num_train_epochs <= 0:
        fail("set --max_steps > 0 or --num_train_epochs > 0")
    resume_value = args.resume_from_checkpoint
    if resume_value and resume_value not in ("latest", "auto") and not os.path.isdir(resume_value):
        fail(f"--resume_from_checkpoint {resume_value}: no such folder")
    if args.overwrite_output_dir and resume_value and (resume_value in ("latest", "auto") or os.path.commonpath(
            [os.path.abspath(resume_value), os.path.abspath(args.output_dir)]) == os.path.abspath(args.output_dir)):
        fail(f"--overwrite_output_dir removes the previous run's checkpoints; it cannot be combined with "
             f"--resume_from_checkpoint {resume_value}")
    used = os.path.isfile(os.path.join(args.output_dir, "metrics.jsonl"))
    if used and not args.resume_from_checkpoint and not args.overwrite_output_dir:
        fail(f"--output_dir {args.output_dir} already holds a run; pass --resume_from_checkpoint latest to continue"
             " it or --overwrite_output_dir to start over")
    check_writable_folder(args.output_dir, "--output_dir")
    args.resume_from_checkpoint = resolve_resume_path(args.output_dir, args.resume_from_checkpoint)
    if args.resume_from_checkpoint and not is_checkpoint(args.resume_from_checkpoint):
        fail(f"--resume_from_checkpoint {args.resume_from_checkpoint}: not a checkpoint (it holds no {RUN_RECORD}); "
             "pass an <output_dir>/checkpoints/step_N folder or `latest`")
    if args.mixed_precision == "fp16" and not torch.cuda.is_available():
        fail("fp16 mixed precision needs a CUDA GPU (fp16 loss scaling is not supported on CPU); use --bf16")
    if args.mixed_precision == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        fail("this GPU does not support bf16; use --fp16")
    if args.tf32 and not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8):
        fail("--tf32 needs an NVIDIA GPU of the Ampere generation or newer")
    if args.report_to not in ("none", "all"):
        from accelerate.utils import is_tensorboard_available, is_trackio_available, is_wandb_available

        available = {"tensorboard": is_tensorboard_available, "trackio": is_trackio_available,
                     "wandb": is_wandb_available}[args.report_to]()
        if not available:
            fail(f"--report_to {args.report_to}: the package is not installed (pip install {args.report_to})")


def data_format(path: str) -> str:
    """The `datasets` builder that reads a data file (json for both .json and .jsonl)."""
    return DATA_EXTENSIONS[os.path.splitext(path)[1].lower()]


def check_writable_folder(path: str, flag: str) -> None:
    """The folder, or the nearest existing folder above it, must be writable (checked without creating anything)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        fail(f"{flag} {path}: cannot write there ({existing} is not a writable folder)")


def finetuning_parser(description: str | None = None) -> ArgumentParser:
    """The flags both fine-tuning scripts share: model, data, training, and sequence length, grouping, freezing."""
    parser = ArgumentParser(description=description)
    add_model_args(parser, presets=())
    add_data_args(parser)
    add_training_args(parser)
    g = parser.add_argument_group("fine-tuning")
    g.add_argument("--max_seq_length", type=int, default=None,
                   help="Truncate longer examples (default: the tokenizer's limit, capped by the script).")
    g.add_argument("--group_by_length", action="store_true",
                   help="Training batches of similar lengths (still shuffled between groups); evaluation sorted by "
                        "length. Less padding per batch.")
    g.add_argument("--freeze_embeddings", action="store_true", help="Do not train the embedding layer.")
    g.add_argument("--freeze_layers", type=int, default=0, help="Do not train the first N transformer layers.")
    return parser


def validate_finetuning(args: argparse.Namespace) -> None:
    """Fine-tuning starts from pretrained weights; cheap checks of the shared and fine-tuning flags."""
    validate_common(args)
    if not args.model_name_or_path:
        fail("fine-tuning needs --model_name_or_path (a local folder or a hub id)")
    if args.config_name:
        fail("--config_name builds a model from scratch; fine-tuning loads --model_name_or_path")
    if args.max_seq_length is not None and args.max_seq_length < 2:
        fail(f"--max_seq_length must be >= 2 (got {args.max_seq_length})")
    if args.freeze_layers < 0:
        fail(f"--freeze_layers must be >= 0 (got {args.freeze_layers})")


def parse_pretraining_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    """The flags of the pretraining job (scripts/pretrain_llama.py, and scripts/plain_loop.py which mirrors it)."""
    parser = ArgumentParser(description=description)
    add_model_args(parser, PRESETS)
    add_data_args(parser)
    add_training_args(parser)
    g = parser.add_argument_group("pretraining")
    g.add_argument("--block_size", type=int, default=256, help="Tokens per packed training sequence.")
    g.add_argument("--tokenizer_vocab_size", type=int, default=8192, help="When a tokenizer is trained here.")
    g.add_argument("--streaming", action="store_true",
                   help="Read the corpus as a stream: tokenized and packed on the fly, no cache; needs --max_steps.")
    g.add_argument("--sample_prompt", default="def ", help="Prompt for the sample generated at the end.")
    g.add_argument("--sample_max_new_tokens", type=int, default=64, help="0: no sample.")
    args = parser.parse_args(argv)
    validate_common(args)
    if args.block_size < 2:
        fail(f"--block_size must be >= 2 (got {args.block_size})")
    if args.streaming and args.max_steps <= 0:
        fail("--streaming needs --max_steps: a stream has no length to count epochs in")
    if sum(x is not None for x in (args.model_name_or_path, args.config_name, args.model_preset)) > 1:
        fail("give only one of --model_name_or_path, --config_name, --model_preset")
    return args
