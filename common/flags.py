"""The command-line flags the scripts share (Hugging Face `TrainingArguments` names), in argument groups; every flag
has a one-line help, and `--help` shows its default. Each script adds its own group; the checks are in
`common/validation.py`."""

from __future__ import annotations

import argparse
import os

OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "adafactor")
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "cosine_with_min_lr", "inverse_sqrt")


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (no usage dump) and exit status 2, and `--help` shows defaults."""

    def __init__(self, **kwargs) -> None:
        super().__init__(formatter_class=argparse.ArgumentDefaultsHelpFormatter, **kwargs)

    def error(self, message: str):  # noqa: D102
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_model_args(parser: argparse.ArgumentParser, presets: tuple[str, ...] = (), lm_head: bool = True) -> None:
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
    g.add_argument("--torch_compile", action="store_true", help="torch.compile the model (inductor).")
    if lm_head:  # causal LMs: their vocabulary-sized logits are the largest activation
        g.add_argument("--chunked_cross_entropy", action="store_true",
                       help="LM head and loss over chunks of tokens: the full logits are never materialised.")


def add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data")
    g.add_argument("--dataset_name", help="Dataset on the hub (or a local dataset folder), via `datasets`.")
    g.add_argument("--dataset_config_name", help="The dataset's configuration (e.g. sst2 of glue).")
    g.add_argument("--train_file", help="txt, json/jsonl, csv or parquet file (None: the embedded default data).")
    g.add_argument("--validation_file", help="Held-out file in the same format as --train_file.")
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
    g.add_argument("--max_nonfinite_steps", type=int, default=5,
                   help="Stop (exit status 3) after this many steps in a row with a NaN/inf loss or gradient norm.")
    g.add_argument("--optim", default="adamw_torch", choices=OPTIMIZERS, help="Optimizer.")
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


def add_finetuning_args(parser: argparse.ArgumentParser) -> None:
    """The flags both fine-tuning scripts share: sequence length, length grouping, freezing."""
    g = parser.add_argument_group("fine-tuning")
    g.add_argument("--max_seq_length", type=int, default=None,
                   help="Truncate longer examples (None: the tokenizer's limit, capped by the script).")
    g.add_argument("--group_by_length", action="store_true",
                   help="Batches of similar lengths (less padding); evaluation sorted by length.")
    g.add_argument("--freeze_embeddings", action="store_true", help="Do not train the embedding layer.")
    g.add_argument("--freeze_layers", type=int, default=0, help="Do not train the first N transformer layers.")


# The LoRA settings a checkpoint was trained with: a resume must keep them (common/run_record.py).
ADAPTER_FLAGS = ("use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "load_in_4bit",
                 "bnb_4bit_quant_type", "use_bnb_nested_quant")


def add_peft_args(parser: argparse.ArgumentParser) -> None:
    """LoRA / QLoRA with peft (TRL's flag names), for both fine-tuning scripts; see common/adapters.py."""
    g = parser.add_argument_group("LoRA / QLoRA (peft)")
    g.add_argument("--use_peft", action="store_true",
                   help="Train a LoRA adapter on the frozen base model instead of all its weights.")
    g.add_argument("--lora_r", type=int, default=16, help="LoRA rank.")
    g.add_argument("--lora_alpha", type=int, default=32, help="LoRA scale numerator: the update is scaled by alpha/r.")
    g.add_argument("--lora_dropout", type=float, default=0.05, help="Dropout on the adapter's input.")
    g.add_argument("--lora_target_modules", nargs="+", default=["all-linear"],
                   help="Names of the modules to adapt (a name matches a full module path or its end); all-linear: "
                        "every linear layer but the output head.")
    g.add_argument("--load_in_4bit", action="store_true",
                   help="QLoRA: the frozen base quantized to 4 bits (bitsandbytes); needs --use_peft.")
    g.add_argument("--bnb_4bit_quant_type", default="nf4", choices=("nf4", "fp4"), help="The 4-bit data type.")
    g.add_argument("--use_bnb_nested_quant", action="store_true",
                   help="Quantize the 4-bit blocks' scales too (double quantization: ~0.4 bit per weight less).")
    g.add_argument("--merge_adapter", action="store_true",
                   help="Also write output_dir/merged: the adapter merged into a full-precision copy of the base.")
