#!/usr/bin/env python
"""Fine-tune a text classifier (BERT, DeBERTa, RoBERTa, ... any AutoModelForSequenceClassification) with Accelerate.

    accelerate launch scripts/finetune_classifier.py --model_name_or_path google-bert/bert-base-uncased \\
        --dataset_name nyu-mll/glue --dataset_config_name sst2 --text_column sentence --group_by_length --bf16
    python scripts/finetune_classifier.py --model_name_or_path ./my-encoder --train_file train.csv \\
        --validation_file dev.csv --freeze_embeddings --optim adamw_8bit --auto_find_batch_size

Data: a `text` column (and optionally `text_pair`) and a `label` column (names set by flags). The labels are found in
the training split and saved in the exported config (id2label / label2id). Batches are padded only to their longest
example (`--group_by_length` puts examples of similar length together); the share of padding is logged. The loop
below is the whole procedure: prepare, accumulate, backward, clip, step, log, evaluate (accuracy, F1 for two
classes), checkpoint, export the last or the best model with its tokenizer.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import shutil
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
from accelerate.logging import get_logger
from accelerate.utils import find_executable_batch_size, set_seed
from datasets import ClassLabel
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

from common.checkpoint import CheckpointExtras, find_checkpoint_to_resume, save_checkpoint
from common.errors import fail
from common.evaluation import full_batch
from common.export import export_model
from common.flags import ArgumentParser, add_data_args, add_model_args, add_training_args
from common.guard import DIVERGED_STATUS, STOPPED_STATUS, Verdict
from common.inputs.batching import EpochLengthGroupedSampler, pad_to_multiple_of
from common.inputs.data import HeldOut, Source, check_data_files, get_tokenizer, load_raw_datasets
from common.inputs.modeling import (add_finetuning_args, check_finetuning_flags, count_parameters,
                                    enable_gradient_checkpointing, freeze_parameters, load_finetuning_config,
                                    load_pretrained)
from common.lifecycle import RunLifecycle, finish
from common.optim import create_optimizer_and_scheduler
from common.output_dir import EXPORT_FILES
from common.runtime import build_accelerator
from common.steps import TrainingProgress, count_optimizer_steps, optimizer_step_windows, track_progress
from common.features.activation_memory import (add_activation_memory_args, check_activation_memory,
                                               reduce_activation_memory)  # feature: activation memory
from common.features.async_checkpoint import (add_async_checkpoint_args, save_in_background,
                                              wait_for_checkpoint)  # feature: async checkpoint
from common.features.checksums import record_files, verify_checkpoint  # feature: checksums
from common.features.compile import (add_compile_args, check_compile_flags, compile_counts,
                                     compile_model)  # feature: torch compile
from common.features.cpu_threads import use_all_cores  # feature: cpu threads
from common.features.deepspeed_check import check_deepspeed_config  # feature: deepspeed check
from common.features.divergence import (NonFiniteGuard, add_divergence_args, check_divergence_flags,
                                        export_if_finite, finite_weights)  # feature: divergence guard
from common.features.disk import explain_full_disk, stop_if_disk_full, stop_on_full_disk  # feature: full disk
from common.features.exit_status import record_exit_status  # feature: exit status
from common.features.folder_lock import lock_output_dir  # feature: folder lock
from common.features.fsdp_on_cpu import use_fsdp2_on_cpu  # feature: fsdp2 on cpu
from common.features.lora import (add_adapter, add_peft_args, base_model_kwargs, check_adapter_targets,
                                  check_peft_flags, export_adapter, export_merged_model, frozen_base_left_out)  # feature: lora
from common.features.preemption import announce_stop, catch_stop_signals, stop_when_launcher_dies  # feature: preemption
from common.features.resume_guard import RunRecord  # feature: resume guard
from common.features.sequence_parallel import refuse_sequence_parallel  # feature: sequence parallel
from common.features.tensor_parallel import refuse_tensor_parallel  # feature: tensor parallel

logger = get_logger(__name__)
DATA_FLAGS = ("text_pair_column", "label_column")  # decide the examples: a resume keeps them
BEST_DIR = "best_model"  # in a checkpoint, with --load_best_model_at_end: the best model's export and figures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_data_args(parser)
    add_training_args(parser)
    add_divergence_args(parser)  # feature: divergence guard
    add_compile_args(parser)  # feature: torch compile
    add_async_checkpoint_args(parser)  # feature: async checkpoint
    add_activation_memory_args(parser)  # feature: activation memory
    add_finetuning_args(parser)
    add_peft_args(parser)  # feature: lora
    # Fine-tuning defaults (BERT paper / TrainingArguments); attention: the best the model supports (sdpa or eager).
    parser.set_defaults(learning_rate=2e-5, weight_decay=0.01, adam_beta2=0.999, lr_scheduler_type="linear",
                        attn_implementation=None)
    g = parser.add_argument_group("classification")
    g.add_argument("--text_pair_column", help="Second text of a pair (None: `text_pair` when the data has it).")
    g.add_argument("--label_column", default="label", help="Column holding the label.")
    g.add_argument("--pad_to_max_length", action="store_true",
                   help="Pad every batch to --max_seq_length (the wasteful baseline that dynamic padding avoids).")
    g.add_argument("--auto_find_batch_size", action="store_true",
                   help="On out-of-memory: halve the batch, double the accumulation (same effective batch), restart.")
    g.add_argument("--load_best_model_at_end", action="store_true",
                   help="Export the model of the best evaluation (see --eval_steps) instead of the last one.")
    g.add_argument("--metric_for_best_model", default="accuracy", choices=("accuracy", "f1", "loss"),
                   help="What --load_best_model_at_end compares.")
    args = parser.parse_args(argv)
    check_finetuning_flags(args)
    check_data_files(args.train_file, args.validation_file)
    check_divergence_flags(args)  # feature: divergence guard
    check_compile_flags(args)  # feature: torch compile
    check_peft_flags(args)  # feature: lora
    if args.group_by_length and args.pad_to_max_length:
        fail("--group_by_length saves nothing with --pad_to_max_length (every batch has the same length)")
    if args.auto_find_batch_size and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        fail("--auto_find_batch_size does not work under DeepSpeed (the first try fixes the batch size in its "
             "config); set --per_device_train_batch_size")
    return args


def main() -> None:
    args = parse_args()
    config = load_finetuning_config(args)  # cheap: checks the flags against the model before any heavy work
    check_activation_memory(args, config)  # feature: activation memory
    if args.use_peft:  # feature: lora
        check_adapter_targets(args, config, AutoModelForSequenceClassification, "SEQ_CLS")
    check_deepspeed_config(args)  # feature: deepspeed check
    refuse_sequence_parallel("finetune_classifier.py")  # feature: sequence parallel
    refuse_tensor_parallel("finetune_classifier.py")  # feature: tensor parallel
    stop_when_launcher_dies()  # feature: preemption
    use_all_cores()  # feature: cpu threads
    accelerator = build_accelerator(args)
    use_fsdp2_on_cpu(accelerator)  # feature: fsdp2 on cpu
    extras = CheckpointExtras()
    extras.record_files, extras.verify = record_files, verify_checkpoint  # feature: checksums
    extras.explain_failed_save = stop_if_disk_full  # feature: full disk
    extras.can_save = finite_weights  # feature: divergence guard
    extras.save = save_in_background(args, accelerator)  # feature: async checkpoint
    extras.state_kwargs = partial(frozen_base_left_out, accelerator)  # feature: lora
    resume_from = find_checkpoint_to_resume(args.output_dir, args.resume_from_checkpoint, accelerator, extras.verify)
    progress = track_progress(accelerator)  # registered once: every auto-batch-size attempt restarts it at 0
    training = train_with_largest_batch if args.auto_find_batch_size else train
    training = stop_on_full_disk(training, args.output_dir, extras)  # feature: full disk
    status = training(args, config, accelerator, progress, resume_from, extras)
    wait_for_checkpoint(extras)  # feature: async checkpoint
    finish(accelerator)
    sys.exit(status)


def train_with_largest_batch(args, config, accelerator, progress: TrainingProgress, resume_from: str | None,
                             extras: CheckpointExtras) -> int:
    """`train` with accelerate's retry on out-of-memory errors: each attempt halves the per-device batch and doubles
    the accumulation (the same effective batch), and starts afresh."""
    effective_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps

    def attempt(batch_size: int) -> int:
        accelerator.free_memory()  # drop the failed attempt's prepared model and optimizer
        set_seed(args.seed)
        progress.step = 0
        args.per_device_train_batch_size = batch_size
        args.gradient_accumulation_steps = accelerator.gradient_accumulation_steps = effective_batch // batch_size
        logger.info(f"Trying {batch_size} per device x {args.gradient_accumulation_steps} accumulation steps")
        return train(args, config, accelerator, progress, resume_from, extras)

    def smaller() -> int:  # the largest divisor of the effective batch at most half the current batch
        return max(d for d in range(1, args.per_device_train_batch_size // 2 + 1) if effective_batch % d == 0)

    return find_executable_batch_size(attempt, args.per_device_train_batch_size, reduce_batch_size_fn=smaller)()


def load_classification_data(args, accelerator, config, resume_from: str | None):
    """Rows -> label ids + tokens: (tokenizer, tokenized datasets with a `length` column, label names)."""
    pair_column = args.text_pair_column
    columns = {args.text_column: "--text_column", args.label_column: "--label_column"}
    if pair_column:
        columns[pair_column] = "--text_pair_column"
    raw = load_raw_datasets(Source.from_flags(args), HeldOut.from_flags(args), args.cache_dir, columns,
                            check_rows=partial(find_unusable_label, column=args.label_column))
    pair_column = pair_column or ("text_pair" if "text_pair" in raw["train"].column_names else None)
    tokenizer = get_tokenizer(args, accelerator, raw, resume_from)
    label_names, label_ids = discover_labels(raw, args.label_column)
    if args.metric_for_best_model == "f1" and len(label_names) != 2:
        fail(f"--metric_for_best_model f1 needs two labels (found {len(label_names)})")
    max_length = args.max_seq_length or min(tokenizer.model_max_length,
                                            getattr(config, "max_position_embeddings", None) or 512, 512)
    with accelerator.main_process_first():
        data = raw.map(tokenize_labelled_rows, batched=True, num_proc=args.preprocessing_num_workers,
                       fn_kwargs=dict(tokenizer=tokenizer, text_column=args.text_column, pair_column=pair_column,
                                      label_column=args.label_column, label_ids=label_ids, max_length=max_length),
                       remove_columns=raw["train"].column_names, desc="Tokenizing")
    return tokenizer, data, label_names, max_length


def tokenize_labelled_rows(batch: dict, tokenizer, text_column: str, pair_column: str | None, label_column: str,
                           label_ids: dict, max_length: int) -> dict:
    """`datasets.map` function: text (and text pair) -> truncated ids, label -> label id, and each example's length."""
    enc = tokenizer(batch[text_column], batch[pair_column] if pair_column else None, truncation=True,
                    max_length=max_length)
    enc["labels"] = [label_ids[v] for v in batch[label_column]]
    enc["length"] = [len(ids) for ids in enc["input_ids"]]
    return enc


def exporter(args):
    """How the trained model is written (common/export.py; the features below wrap or replace it)."""
    export = export_model
    if args.use_peft:  # feature: lora
        export = export_adapter  # the adapter alone, in peft's format
    export = explain_full_disk(export)  # feature: full disk
    export = export_if_finite(export)  # feature: divergence guard
    return export


def export_merged(args, accelerator, tokenizer, head: dict) -> None:  # feature: lora
    """--merge_adapter: the adapter merged into a full-precision copy of the base, in <output_dir>/merged."""
    merge = partial(export_merged_model, **head)  # the classifier's head settings
    merge = explain_full_disk(merge)  # feature: full disk
    merge(accelerator, tokenizer, args.output_dir, AutoModelForSequenceClassification, args.model_name_or_path)


def build_dataloaders(args, accelerator, tokenizer, data, max_length: int):
    """Batches padded to their longest example (or to max length), optionally grouped by length."""
    collator = DataCollatorWithPadding(tokenizer, padding="max_length" if args.pad_to_max_length else "longest",
                                       max_length=max_length, pad_to_multiple_of=pad_to_multiple_of(accelerator))
    sampler = None
    if args.group_by_length:
        sampler = EpochLengthGroupedSampler(data["train"]["length"], args.per_device_train_batch_size, args.seed)
        data["validation"] = data["validation"].sort("length")  # order is free: metrics are gathered, not streamed
    data = data.remove_columns("length")
    loader_kwargs = dict(collate_fn=collator, num_workers=args.dataloader_num_workers,
                         pin_memory=args.dataloader_pin_memory and torch.cuda.is_available())
    # drop_last: every micro-batch holds the same number of examples, so averaging the micro-batch means
    # (accelerate's 1/accumulation, DDP's 1/processes) is exactly the mean over the optimizer step's examples.
    # Its own generator: a resumed run draws the uninterrupted run's dropout masks (scripts/pretrain_llama.py)
    train_dataloader = DataLoader(data["train"], sampler=sampler, shuffle=sampler is None, drop_last=True,
                                  batch_size=args.per_device_train_batch_size, generator=torch.Generator(),
                                  **loader_kwargs)
    eval_dataloader = DataLoader(data["validation"], batch_size=args.per_device_eval_batch_size, **loader_kwargs)
    return train_dataloader, eval_dataloader


def train(args, config, accelerator, progress: TrainingProgress, resume_from: str | None,
          extras: CheckpointExtras) -> int:
    """The whole run; returns the exit status (see scripts/pretrain_llama.py, whose loop this one follows)."""
    record = RunRecord(args, "finetune_classifier", accelerator, config, DATA_FLAGS, resume_from)  # feature: resume guard
    extras.write, extras.check, extras.keep = record.write, record.check, record.keep  # feature: resume guard
    lock_output_dir(args.output_dir, accelerator.is_main_process)  # feature: folder lock
    run = RunLifecycle(accelerator, args.output_dir, args.overwrite_output_dir, resume_from, extras)
    ga = args.gradient_accumulation_steps
    tokenizer, data, label_names, max_length = load_classification_data(args, accelerator, config, resume_from)
    train_dataloader, eval_dataloader = build_dataloaders(args, accelerator, tokenizer, data, max_length)
    steps_per_epoch, total_steps = count_optimizer_steps(train_dataloader, ga, accelerator.num_processes,
                                                         args.max_steps, args.num_train_epochs)
    record.add_data(tokenizer, steps_per_epoch)  # feature: resume guard
    # ---- model (new classification head), freezing, optimizer, schedule (in optimizer steps) -----------------------
    model, head = build_classifier(args, accelerator, label_names)
    trainable, total_params = count_parameters(model)
    optimizer, lr_scheduler = create_optimizer_and_scheduler(args, model, accelerator, total_steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    progress, log, guard = run.start(total_steps, steps_per_epoch, args.logging_steps,
                                     trackers=("finetune_classifier", vars(args)), progress=progress)
    logger.info(f"Model: {total_params / 1e6:.2f}M parameters, {trainable / 1e6:.2f}M trainable; {len(label_names)} "
                f"labels {label_names}; {len(data['train'])} training examples, {steps_per_epoch} optimizer steps per "
                f"epoch, {total_steps} in all; global batch "
                f"{args.per_device_train_batch_size * ga * accelerator.num_processes}")
    # ---- training loop: equal-size micro-batches (drop_last), so the mean of their means is the step's mean --------
    export, best = exporter(args), BestModel(args, accelerator, resume_from, extras)  # a resume restores the best
    guard = NonFiniteGuard(accelerator, progress, args.max_nonfinite_steps)  # feature: divergence guard
    guard.stop_signalled = catch_stop_signals()  # feature: preemption
    train_start = time.perf_counter()
    model.train()
    for window in optimizer_step_windows(train_dataloader, progress, steps_per_epoch, total_steps, ga):
        window_loss = torch.zeros((), device=accelerator.device)
        for batch in window:
            with accelerator.accumulate(model):
                loss = model(**batch).loss  # mean over the micro-batch's examples
                accelerator.backward(loss)
                window_loss += loss.detach() / (ga * accelerator.num_processes)
                log.count_tokens(batch)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)
                    verdict = guard.check(window_loss, grad_norm).verdict
                    lr = lr_scheduler.get_last_lr()[0]
                    if verdict is Verdict.APPLY:
                        optimizer.step()
                        if not accelerator.optimizer_step_was_skipped:
                            lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
        step = progress.step
        saving = bool(args.checkpointing_steps) and step % args.checkpointing_steps == 0
        checked = guard.step_check(read=saving or log.writes_row(step))
        if checked.verdict is Verdict.DIVERGED:
            return DIVERGED_STATUS
        log.step(step, lr, checked)
        stop = checked.stop_requested
        if args.eval_steps and step % args.eval_steps == 0 and step < total_steps and not stop:
            with log.untimed():
                metrics = evaluate(model, eval_dataloader, accelerator, len(label_names))
                log.write_eval(step, metrics)
                if best.update(step, metrics) and args.load_best_model_at_end and not export(
                        accelerator, model, tokenizer, args.output_dir):
                    return DIVERGED_STATUS
        if stop or saving:
            with log.untimed():
                checkpoint = save_checkpoint(accelerator, args.output_dir, step, args.save_total_limit, extras)
            if checkpoint is None:
                return DIVERGED_STATUS
        if stop:
            wait_for_checkpoint(extras)  # feature: async checkpoint
            announce_stop(step, checkpoint)  # feature: preemption
            return STOPPED_STATUS
    log.close()
    wait_for_checkpoint(extras)  # feature: async checkpoint
    train_runtime = time.perf_counter() - train_start
    # ---- final evaluation and export (the last model, or the best one already exported) ----------------------------
    last_metrics = evaluate(model, eval_dataloader, accelerator, len(label_names))
    log.write_eval(progress.step, last_metrics)
    if best.update(progress.step, last_metrics) or not args.load_best_model_at_end:
        if not export(accelerator, model, tokenizer, args.output_dir):
            return DIVERGED_STATUS
    if args.use_peft and args.merge_adapter:  # feature: lora
        export_merged(args, accelerator, tokenizer, head)
    exported_step, exported = best.exported(progress.step, last_metrics)
    results = {**exported, "exported_step": exported_step, "train_steps": progress.step,
               "train_runtime": train_runtime, "padding_fraction": log.padding_fraction,
               "num_parameters": total_params, "trainable_parameters": trainable, "labels": label_names,
               "per_device_train_batch_size": args.per_device_train_batch_size, "gradient_accumulation_steps": ga}
    results.update(compile_counts() if args.torch_compile else {})  # feature: torch compile
    log.write_results(results)
    return 0


def build_classifier(args, accelerator, label_names: list[str]):
    """The pretrained encoder with a new head for the labels, frozen as flagged (with --use_peft: a frozen, maybe
    4-bit, base, a LoRA adapter and the trained head); and the head's `from_pretrained` arguments."""
    head = dict(num_labels=len(label_names), id2label=dict(enumerate(label_names)),
                label2id={name: i for i, name in enumerate(label_names)}, problem_type="single_label_classification",
                ignore_mismatched_sizes=True)  # a checkpoint with another head (other classes) gets a fresh one
    load_kwargs = {"dtype": torch.float32}  # fp32 weights: mixed precision autocasts them
    if args.use_peft:  # feature: lora
        load_kwargs = base_model_kwargs(args, accelerator, "SEQ_CLS")  # a 16-bit (or 4-bit) frozen base
    model = load_pretrained(AutoModelForSequenceClassification.from_pretrained, args.model_name_or_path,
                            attn_implementation=args.attn_implementation, **head, **load_kwargs)
    model.config.use_cache = False  # an encoder classifier never generates: no cache notice under checkpointing
    freeze_parameters(model, args.freeze_embeddings, args.freeze_layers)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if args.selective_ac_option or args.activation_offloading:  # feature: activation memory
        reduce_activation_memory(model, args.selective_ac_option, args.activation_offloading)
    if args.use_peft:  # feature: lora
        model = add_adapter(args, accelerator, model, "SEQ_CLS")
    if args.torch_compile:  # feature: torch compile
        compile_model(model, args.torch_compile_whole_model, args.torch_compile_backend, args.torch_compile_mode,
                      lengths_vary=True)
    return model, head


class BestModel:
    """The best evaluation so far by `--metric_for_best_model` (lower is better for loss, higher otherwise).

    With --load_best_model_at_end each improvement is exported to --output_dir at once, and every checkpoint keeps a
    copy of that export and its figures (BEST_DIR), restored on resume: the resumed run compares its evaluations with
    the best before the interruption and exports the model the uninterrupted run exports.
    """

    def __init__(self, args, accelerator, resume_from: str | None, extras: CheckpointExtras) -> None:
        metric = args.metric_for_best_model
        self.key, self.sign = f"eval_{metric}", -1 if metric == "loss" else 1
        self.step, self.metrics = None, None
        self.output_dir, self.load_best = args.output_dir, args.load_best_model_at_end
        if args.load_best_model_at_end:
            write = extras.write  # what the checkpoint holds besides: the best model's export too

            def write_with_best(path: str) -> None:
                if write:
                    write(path)
                self.save(path)

            extras.write = write_with_best
            kept = os.path.join(resume_from or "", BEST_DIR)
            if resume_from and os.path.isdir(kept):  # absent: no evaluation before it, or an older checkpoint
                with open(os.path.join(kept, "best.json"), encoding="utf-8") as f:
                    saved = json.load(f)
                self.step, self.metrics = saved["step"], saved["metrics"]
                if accelerator.is_main_process:  # the export in --output_dir may be another (later) model's
                    for name in set(os.listdir(kept)) - {"best.json"}:
                        shutil.copy2(os.path.join(kept, name), self.output_dir)
                accelerator.wait_for_everyone()

    def save(self, checkpoint: str) -> None:
        """Into a checkpoint being written (main process): a copy of the best model's export and its figures."""
        if self.step is None:
            return
        kept = os.path.join(checkpoint, BEST_DIR)
        os.makedirs(kept)
        exported = {p for pattern in EXPORT_FILES for p in glob.glob(os.path.join(glob.escape(self.output_dir), pattern))}
        for path in sorted(p for p in exported if os.path.isfile(p)):
            shutil.copy2(path, kept)
        with open(os.path.join(kept, "best.json"), "w", encoding="utf-8") as f:
            json.dump({"step": self.step, "metrics": self.metrics}, f)

    def exported(self, last_step: int, last_metrics: dict) -> tuple[int, dict]:
        """The step and figures of the exported model: the best one's with --load_best_model_at_end, else the last's."""
        step, metrics = (self.step, self.metrics) if self.load_best else (last_step, last_metrics)
        logger.info(f"Exported model (step {step}): eval_accuracy {metrics['eval_accuracy']:.4f}")
        return step, metrics

    def update(self, step: int, metrics: dict) -> bool:
        """True when `metrics` beat the best so far (they then become the best)."""
        if self.metrics is not None and self.sign * metrics[self.key] <= self.sign * self.metrics[self.key]:
            return False
        self.step, self.metrics = step, metrics
        return True


def discover_labels(raw, column: str) -> tuple[list[str], dict]:
    """(label names in id order, {value in the data: id}). A `ClassLabel` column keeps its names and ids; other
    values (strings, numbers) are sorted, so the ids do not depend on the order of the rows."""
    feature = raw["train"].features[column]
    if isinstance(feature, ClassLabel):
        return list(feature.names), {i: i for i in range(len(feature.names))}
    values = set(raw["train"][column])
    if None in values:
        fail(f"the training split has rows without a label (column '{column}')")
    values = sorted(values)
    if len(values) < 2:
        fail(f"column '{column}' holds a single label value ({values}); a classifier needs at least two")
    unseen = set(raw["validation"][column]) - set(values)
    if unseen:
        fail(f"the validation split has labels the training split lacks: {sorted(map(str, unseen))[:5]}")
    return [str(v) for v in values], {v: i for i, v in enumerate(values)}


def find_unusable_label(raw, column: str) -> tuple[str, int, str] | None:
    """The first row (split, index, problem) whose label is missing or of another kind than the first label's.

    Mixed, every spelling would be a class of its own: a CSV column of `0`, `1`, `yes` and `no` (all strings to
    `datasets`) trains four classes where the user meant two. Names only, or numbers only, are taken as they are.
    """
    first = None  # (split, row, label): the kind of the first label is the one every label must have
    for split in ("train", "validation"):
        if split not in raw or column not in raw[split].column_names or \
                isinstance(raw[split].features[column], ClassLabel):
            continue  # the column check names a missing column; a ClassLabel holds ids of named classes
        for row, label in enumerate(raw[split][column]):
            if label is None:
                return split, row, f"has no label (column '{column}')"
            if first is None:
                first = (split, row, label)
            elif label_kind(label) != label_kind(first[2]):
                where = f"row {first[1] + 1}" + (" of the training data" if first[0] != split else "")
                return split, row, (f"has label {label!r}, {label_kind(label)}, where {where} has {first[2]!r}, "
                                    f"{label_kind(first[2])}: write every label as a name or every label as a number "
                                    "(mixed, each spelling would train a class of its own)")
    return None


def label_kind(label) -> str:
    """A number, a number written as text (as `datasets` reads a CSV column that also holds names), or a name."""
    if isinstance(label, str):
        number = re.fullmatch(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*", label)
        return "a number written as text" if number else "a name"
    return "a number" if isinstance(label, (int, float)) and not isinstance(label, bool) else "a name"


@torch.no_grad()
def evaluate(model, dataloader, accelerator, num_labels: int) -> dict[str, float]:
    """Loss and accuracy over the whole evaluation set (F1 of label id 1 when there are two labels).

    `gather_for_metrics` drops the examples a process repeated to even out the last batch: the figures are the same
    for any number of processes.
    """
    model.eval()
    predictions, references, losses = [], [], []
    full_rows = None
    for batch in dataloader:
        labels = batch.pop("labels")
        full_rows = full_rows or len(labels)
        logits = model(**full_batch(batch, full_rows)).logits[:len(labels)].float()
        loss = F.cross_entropy(logits, labels, reduction="none")
        p, r, l = accelerator.gather_for_metrics((logits.argmax(-1), labels, loss))
        predictions.append(p)
        references.append(r)
        losses.append(l)
    model.train()
    predictions, references = torch.cat(predictions), torch.cat(references)
    results = {"eval_loss": torch.cat(losses).mean().item(),
               "eval_accuracy": (predictions == references).float().mean().item()}
    if num_labels == 2:
        tp = ((predictions == 1) & (references == 1)).sum().item()
        fp = ((predictions == 1) & (references == 0)).sum().item()
        fn = ((predictions == 0) & (references == 1)).sum().item()
        results["eval_f1"] = 2 * tp / max(2 * tp + fp + fn, 1)
    return results


if __name__ == "__main__":
    main = record_exit_status(main)  # feature: exit status
    main()
