"""The command-line flags the scripts share (Hugging Face `TrainingArguments` names), in argument groups, and their
checks: every flag has a one-line help, `--help` shows its default, and a bad value stops the run with one line,
`error: ...`, and exit status 2, before anything expensive (tokenizer training, dataset loading, model building).
Each script adds its own group. The checks only check: nothing here changes `args` or the environment; hub ids are
not checked here (they fail at load time with the hub's message)."""

from __future__ import annotations

import argparse
import os

import torch

from common.errors import fail, leave_for_launcher, missing_local_path
from common.paths import METRICS_FILE

OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "adafactor")
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "cosine_with_min_lr", "inverse_sqrt")


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (no usage dump) and exit status 2, and `--help` shows defaults."""

    def __init__(self, **kwargs) -> None:
        super().__init__(formatter_class=argparse.ArgumentDefaultsHelpFormatter, **kwargs)

    def error(self, message: str):  # noqa: D102
        leave_for_launcher(f"error: {message}")
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_model_args(parser: argparse.ArgumentParser, presets: tuple[str, ...] = ()) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model_name_or_path", help="Pretrained checkpoint (local folder or hub id) to start from.")
    g.add_argument("--config_name", help="Model config (path or hub id) to build a model from scratch.")
    if presets:  # scripts that only fine-tune have no from-scratch presets
        g.add_argument("--model_preset", choices=presets, help="Named architecture built from scratch (None: tiny).")
    g.add_argument("--tokenizer_name", help="Tokenizer (path or hub id); None: the model's, else one trained here.")
    g.add_argument("--attn_implementation", default="sdpa", choices=("sdpa", "eager", "flash_attention_2"),
                   help="Attention kernel.")
    g.add_argument("--gradient_checkpointing", action="store_true",
                   help="Recompute activations in the backward pass (non-reentrant): less memory, ~30%% more compute.")


def add_data_args(parser: argparse.ArgumentParser, files: str | None = None) -> None:
    g = parser.add_argument_group("data")  # files="+": one file per source of a mixture (common/inputs/mixture.py)
    g.add_argument("--dataset_name", help="Dataset on the hub (or a local dataset folder), via `datasets`.")
    g.add_argument("--dataset_config_name", help="The dataset's configuration (e.g. sst2 of glue).")
    g.add_argument("--train_file", nargs=files, help="txt, json/jsonl, csv or parquet file (None: the embedded default data).")
    g.add_argument("--validation_file", nargs=files, help="Held-out file in the same format as --train_file.")
    g.add_argument("--validation_split_percentage", type=int, default=5,
                   help="Held-out share of train (0-99) when there is no validation split.")
    g.add_argument("--text_column", default="text", help="Column holding the text.")
    g.add_argument("--max_train_samples", type=int, help="Keep only the first N training rows (debugging).")
    g.add_argument("--max_eval_samples", type=int, help="Keep only the first N validation rows.")
    g.add_argument("--preprocessing_num_workers", type=int, default=None, help="num_proc for datasets.map.")
    g.add_argument("--dataloader_num_workers", type=int, default=0, help="DataLoader worker processes.")
    g.add_argument("--dataloader_pin_memory", type=lambda s: s.lower() in ("1", "true", "yes"), default=True,
                   help="Pin host memory for faster copies to the GPU (true/false).")
    g.add_argument("--cache_dir", default=os.environ.get("TRAIN_SCRIPTS_CACHE",
                   os.path.join(os.path.expanduser("~"), ".cache", "accelerate-training-scripts")),
                   help="Where the embedded corpus and trained tokenizers are cached ($TRAIN_SCRIPTS_CACHE).")


def add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--output_dir", default="outputs/run", help="Checkpoints, metrics and the exported model go here.")
    g.add_argument("--seed", type=int, default=42, help="Seed of the model's initialisation and the data order.")
    g.add_argument("--per_device_train_batch_size", type=int, default=8, help="Sequences per micro-batch per process.")
    g.add_argument("--per_device_eval_batch_size", type=int, default=8, help="Sequences per evaluation batch.")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1, help="Micro-batches per optimizer step.")
    g.add_argument("--learning_rate", type=float, default=5e-4, help="Peak learning rate.")
    g.add_argument("--weight_decay", type=float, default=0.1, help="AdamW weight decay (matrices only).")
    g.add_argument("--adam_beta1", type=float, default=0.9, help="AdamW beta1.")
    g.add_argument("--adam_beta2", type=float, default=0.95, help="AdamW beta2.")
    g.add_argument("--adam_epsilon", type=float, default=1e-8, help="AdamW epsilon.")
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="Clip gradients to this norm; 0: no clipping.")
    g.add_argument("--optim", default="adamw_torch_fused", choices=OPTIMIZERS, help="Optimizer (adamw_torch_fused: "
                   "a non-finite step is skipped on the device; the others wait for one read to the host per step).")
    g.add_argument("--lr_scheduler_type", default="cosine", choices=SCHEDULERS, help="Learning-rate schedule.")
    g.add_argument("--warmup_steps", type=int, default=None, help="Warmup optimizer steps (None: 5%% of the run).")
    g.add_argument("--num_train_epochs", type=float, default=1.0, help="Passes over the training data.")
    g.add_argument("--max_steps", type=int, default=-1, help="Optimizer steps; overrides --num_train_epochs if > 0.")
    g.add_argument("--mixed_precision", choices=("no", "fp16", "bf16"), default=None,
                   help="None: what `accelerate launch`/its config says, else no.")
    g.add_argument("--bf16", dest="mixed_precision", action="store_const", const="bf16",
                   help="Same as --mixed_precision bf16.")
    g.add_argument("--fp16", dest="mixed_precision", action="store_const", const="fp16",
                   help="Same as --mixed_precision fp16 (CUDA only).")
    g.add_argument("--tf32", action="store_true", help="Allow TF32 matmuls (Ampere or newer GPUs).")
    g.add_argument("--logging_steps", type=int, default=10, help="Write a metrics row every N optimizer steps.")
    g.add_argument("--eval_steps", type=int, default=None, help="Evaluate every N optimizer steps (and at the end).")
    g.add_argument("--checkpointing_steps", type=int, default=None, help="Save a resumable checkpoint every N steps.")
    g.add_argument("--save_total_limit", type=int, default=2, help="Keep only the newest N checkpoints.")
    g.add_argument("--resume_from_checkpoint",
                   help="A checkpoint folder; latest: the newest in --output_dir (error if none); auto: the same, or "
                        "start fresh.")
    g.add_argument("--overwrite_output_dir", action="store_true",
                   help="Start over in a used --output_dir (its checkpoints, metrics and model are removed).")
    g.add_argument("--report_to", default="none", choices=("none", "all", "tensorboard", "trackio", "wandb"),
                   help="Experiment trackers to log to.")
    g.add_argument("--ddp_timeout", type=float, default=1800,
                   help="Seconds a collective may wait for the other processes before the run fails.")


def check_common_flags(args: argparse.Namespace) -> None:
    """The flags of the model, data and training groups (the data files: common/inputs/data.py); hub ids are not
    checked here (they fail at load time with the hub's message)."""
    for name in ("model_name_or_path", "config_name", "tokenizer_name"):
        value = getattr(args, name, None)
        if value and missing_local_path(value):  # else transformers takes it for a hub id with a confusing message
            fail(f"--{name} {value}: no such folder")
    if args.dataset_name and args.train_file:
        fail("give either --dataset_name or --train_file, not both")
    if not 0 <= args.validation_split_percentage < 100:  # 100 would leave nothing to train on
        fail(f"--validation_split_percentage must be between 0 and 99 (got {args.validation_split_percentage})")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                 "logging_steps"):
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
    if args.warmup_steps is not None and args.max_steps > 0:  # with epochs: once the data is counted (common/optim.py)
        check_warmup(args.warmup_steps, args.max_steps, "--max_steps ")
    check_output_dir(args)
    check_precision(args)
    if args.report_to not in ("none", "all"):
        from accelerate.utils import is_tensorboard_available, is_trackio_available, is_wandb_available

        available = {"tensorboard": is_tensorboard_available, "trackio": is_trackio_available,
                     "wandb": is_wandb_available}[args.report_to]()
        if not available:
            fail(f"--report_to {args.report_to}: the package is not installed (pip install {args.report_to})")


def check_output_dir(args: argparse.Namespace) -> None:
    """--output_dir is writable, and a used one is continued or overwritten on purpose, never both."""
    resume_value = args.resume_from_checkpoint
    if resume_value and resume_value not in ("latest", "auto") and not os.path.isdir(resume_value):
        fail(f"--resume_from_checkpoint {resume_value}: no such folder")
    if args.overwrite_output_dir and resume_value and (resume_value in ("latest", "auto") or os.path.commonpath(
            [os.path.abspath(resume_value), os.path.abspath(args.output_dir)]) == os.path.abspath(args.output_dir)):
        fail(f"--overwrite_output_dir removes the previous run's checkpoints; it cannot be combined with "
             f"--resume_from_checkpoint {resume_value}")
    output_dir = os.path.realpath(args.output_dir)
    for name in ("model_name_or_path", "tokenizer_name", "config_name"):
        value = getattr(args, name, None)  # a local path: the export and --overwrite_output_dir would write over it
        if value and os.path.exists(value) and os.path.commonpath([os.path.realpath(value), output_dir]) == output_dir:
            fail(f"--output_dir {args.output_dir} is or contains --{name} {value}, which this run loads: its export "
                 "(and --overwrite_output_dir) would write over it; choose another --output_dir")
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


def check_warmup(warmup_steps: int, total_steps: int, what: str = "") -> None:
    """The warmup must end within the run: before any work against --max_steps, else once the data is counted."""
    if warmup_steps > total_steps:
        fail(f"--warmup_steps {warmup_steps} is more than the run's {what}{total_steps}{'' if what else ' optimizer steps'}"
             ": the learning rate would never reach --learning_rate")
