#!/usr/bin/env python
"""The benchmark's other peer: the pretraining job through transformers' `Trainer` at its best settings.

    python benchmarks/trainer_loop.py --model_preset 1b --block_size 2048 --per_device_train_batch_size 4 --bf16 \\
        --torch_compile --optim adamw_torch_fused --max_steps 15 --logging_steps 1

It takes the flags of benchmarks/plain_loop.py and the same inputs (data pipeline, tokenizer, blocks, model and
initialisation), and hands them to `Trainer` with the settings its documentation gives for speed: `torch_compile=True`
(Trainer compiles the whole model; it has no per-layer compilation), `optim` from `--optim` (`adamw_torch_fused`:
fused AdamW), `bf16`, and `use_cache=False` in the model's config (Trainer calls `model(**batch)`: else transformers
builds a KV cache in training). Clipping, schedule and warm-up as the recipe's flags say. Trainer shuffles with its own
sampler: the same tokens per step, not the same batches, so the losses are not the recipe's.

A callback writes a metrics.jsonl row in the recipe's format every `--logging_steps` steps, which
benchmarks/benchmark.py reads: it waits for the device (`torch.cuda.synchronize`) before it stops the step's timer.
"""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from accelerate import PartialState
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator, set_seed

from benchmarks.plain_loop import parse_args
from common.inputs.data import HeldOut, Source, get_tokenizer, load_raw_datasets, tokenize_and_pack
from common.inputs.modeling import build_causal_lm, check_block_size, count_parameters, flops_per_token, load_config
from common.metrics import (MetricsWriter, Throughput, peak_flops_per_device, peak_memory_bytes,
                            write_all_results)


class StepRows(TrainerCallback):
    """The recipe's metrics rows from inside Trainer: the step's timer stops once the device is done (on_step_end,
    after the optimizer step), and the row is written when Trainer logs that step's loss (on_log)."""

    def __init__(self, writer: MetricsWriter, tokens_per_step: int, step_flops: float) -> None:
        self.writer, self.tokens_per_step, self.step_flops = writer, tokens_per_step, step_flops
        self.peak_flops = peak_flops_per_device()
        self.throughput = Throughput()
        self.row: dict = {}
        self.last: dict = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.throughput = Throughput()  # after Trainer's setup: the first step's time is its own

    def on_step_end(self, args, state, control, **kwargs):
        self.throughput.add(self.tokens_per_step)
        if control.should_log:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the step's device work inside its time
            rate = self.throughput.report()
            self.row = {"step": state.global_step, "epoch": state.epoch, "tokens_per_second": rate,
                        "peak_memory_bytes": peak_memory_bytes()}
            if self.peak_flops:
                self.row["mfu"] = rate * self.step_flops / self.peak_flops
            if torch.cuda.is_available():
                self.row["peak_memory_reserved_bytes"] = torch.cuda.max_memory_reserved()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.row and logs and "loss" in logs:
            self.last = {**self.row, "loss": logs["loss"], "lr": logs.get("learning_rate"),
                         "grad_norm": logs.get("grad_norm")}
            self.writer.write(self.last)
            self.row = {}


def main() -> None:
    args = parse_args()
    config = load_config(args)
    check_block_size(config, args.block_size)
    set_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    state = PartialState()  # common/inputs/data.py orders processes through it; Trainer has its own
    source = Source.from_flags(args)
    raw = load_raw_datasets(source, HeldOut.from_flags(args), args.cache_dir)
    tokenizer = get_tokenizer(args, state, raw, None, args.tokenizer_vocab_size, source.text_column)
    data = tokenize_and_pack(state, raw, source, tokenizer, args.block_size, args.preprocessing_num_workers)["train"]
    model = build_causal_lm(args, config, len(tokenizer))
    model.config.use_cache = False  # Trainer calls model(**batch): no KV cache in training
    _, total_params = count_parameters(model)
    step_flops = flops_per_token(model.config, total_params, model.get_input_embeddings().weight.numel(),
                                 args.block_size)
    ga = args.gradient_accumulation_steps
    steps_per_epoch = len(data) // (args.per_device_train_batch_size * ga)
    total_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=total_steps, per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=ga, learning_rate=args.learning_rate, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_epsilon=args.adam_epsilon,
        max_grad_norm=args.max_grad_norm, optim=args.optim, lr_scheduler_type=args.lr_scheduler_type,
        lr_scheduler_kwargs={"min_lr_rate": 0.1} if args.lr_scheduler_type == "cosine_with_min_lr" else {},
        warmup_steps=args.warmup_steps if args.warmup_steps is not None else int(0.05 * total_steps),
        bf16=args.mixed_precision == "bf16", fp16=args.mixed_precision == "fp16", tf32=args.tf32 or None,
        torch_compile=args.torch_compile, torch_compile_backend=args.torch_compile_backend if args.torch_compile
        else None, torch_compile_mode=args.torch_compile_mode, logging_steps=args.logging_steps, seed=args.seed,
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=args.dataloader_num_workers,
        dataloader_pin_memory=args.dataloader_pin_memory, use_cpu=not torch.cuda.is_available())
    rows = StepRows(MetricsWriter(args.output_dir, True), args.per_device_train_batch_size * ga * args.block_size,
                    step_flops)
    trainer = Trainer(model=model, args=training_args, train_dataset=data, data_collator=default_data_collator,
                      callbacks=[rows])
    trainer.train()
    write_all_results(args.output_dir, {"train_loss": rows.last.get("loss"), "train_steps": total_steps,
                                        "num_processes": 1, "num_parameters": total_params,
                                        "peak_memory_bytes": peak_memory_bytes()})


if __name__ == "__main__":
    main()
