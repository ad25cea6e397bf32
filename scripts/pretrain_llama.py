#!/usr/bin/env python
"""Pretrain a Llama-architecture causal LM (or a Mixtral-style MoE) with Accelerate.

    accelerate launch scripts/pretrain_llama.py                      # embedded default: this Python's stdlib sources
    accelerate launch scripts/pretrain_llama.py --train_file my.jsonl --model_preset 125m --bf16
    accelerate launch --config_file accelerate_configs/<pick>.yaml scripts/pretrain_llama.py ...

The loop below is the whole training procedure: prepare, accumulate, backward, clip, step, log, evaluate,
checkpoint, export. `common/` holds only the pieces the scripts share (arguments, data, model, optimizer, the exact
accumulation loss, checkpoints, metrics).
"""

from __future__ import annotations

import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import torch
from accelerate import skip_first_batches
from accelerate.logging import get_logger
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator

from common.accumulation import accumulation_windows, backward_loss, count_label_tokens
from common.args import ArgumentParser, add_data_args, add_model_args, add_training_args, fail, validate_common
from common.checkpoint import TrainingProgress, export_model, save_checkpoint
from common.data import get_tokenizer, load_raw_datasets, tokenize_and_pack
from common.evaluation import evaluate_causal_lm
from common.metrics import StepLog, flops_per_token, peak_memory_bytes, write_all_results
from common.modeling import (PRESETS, build_causal_lm, check_block_size, count_parameters, full_numel, load_config,
                             outside_zero3)
from common.optim import create_optimizer_and_scheduler
from common.runtime import build_accelerator, finish, init_trackers

logger = get_logger(__name__)


def parse_args(argv: list[str] | None = None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser, PRESETS)
    add_data_args(parser)
    add_training_args(parser)
    g = parser.add_argument_group("pretraining")
    g.add_argument("--block_size", type=int, default=256, help="Tokens per packed training sequence.")
    g.add_argument("--tokenizer_vocab_size", type=int, default=8192, help="When a tokenizer is trained here.")
    g.add_argument("--sample_prompt", default="def ", help="Prompt for the sample generated at the end.")
    g.add_argument("--sample_max_new_tokens", type=int, default=64, help="0: no sample.")
    args = parser.parse_args(argv)
    validate_common(args)
    if args.block_size < 2:
        fail(f"--block_size must be >= 2 (got {args.block_size})")
    if sum(x is not None for x in (args.model_name_or_path, args.config_name, args.model_preset)) > 1:
        fail("give only one of --model_name_or_path, --config_name, --model_preset")
    return args


def main() -> None:
    args = parse_args()
    config = load_config(args)  # cheap: checked against the flags before any heavy work
    check_block_size(config, args.block_size)
    accelerator = build_accelerator(args)
    train(args, config, accelerator)
    finish(accelerator)


def train(args, config, accelerator) -> None:
    os.makedirs(args.output_dir, exist_ok=True)
    ga = args.gradient_accumulation_steps

    # ---- data: corpus -> fast tokenizer -> packed blocks ------------------------------------------------------------
    raw = load_raw_datasets(args)
    tokenizer = get_tokenizer(args, accelerator, raw)
    data = tokenize_and_pack(args, accelerator, raw, tokenizer, args.block_size)
    pin = args.dataloader_pin_memory and torch.cuda.is_available()
    train_dataloader = DataLoader(data["train"], shuffle=True, batch_size=args.per_device_train_batch_size,
                                  collate_fn=default_data_collator, num_workers=args.dataloader_num_workers,
                                  pin_memory=pin)
    eval_dataloader = DataLoader(data["validation"], batch_size=args.per_device_eval_batch_size,
                                 collate_fn=default_data_collator, num_workers=args.dataloader_num_workers,
                                 pin_memory=pin)
    steps_per_epoch = math.ceil(len(train_dataloader) / accelerator.num_processes) // ga
    if steps_per_epoch == 0:
        fail(f"{len(data['train'])} training blocks are fewer than one optimizer step needs "
             f"({args.per_device_train_batch_size} x {ga} accumulation x {accelerator.num_processes} processes)")
    total_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
    num_epochs = math.ceil(total_steps / steps_per_epoch)

    # ---- model, optimizer, schedule (in optimizer steps) ------------------------------------------------------------
    model = build_causal_lm(args, config, len(tokenizer))
    trainable, total_params = count_parameters(model)
    step_flops = flops_per_token(model.config, total_params, full_numel(model.get_input_embeddings().weight),
                                 args.block_size)
    router_aux_loss_coef = getattr(model.config, "router_aux_loss_coef", 0.0) \
        if getattr(model.config, "output_router_logits", False) else 0.0
    optimizer, lr_scheduler = create_optimizer_and_scheduler(args, model, accelerator, total_steps)

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)

    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        logger.info(f"Resumed from {args.resume_from_checkpoint} at optimizer step {progress.step}")
    init_trackers(accelerator, args, "pretrain_llama")
    logger.info(f"Model: {total_params / 1e6:.2f}M parameters ({trainable / 1e6:.2f}M trainable), "
                f"{len(data['train'])} training blocks of {args.block_size} tokens, {steps_per_epoch} optimizer "
                f"steps per epoch, {total_steps} in all; global batch "
                f"{args.per_device_train_batch_size * ga * accelerator.num_processes} sequences")

    # ---- training loop ----------------------------------------------------------------------------------------------
    log = StepLog(accelerator, args.output_dir, resume_step=progress.step, flops_per_token=step_flops)
    last_log, train_start = {}, time.perf_counter()
    progress_bar = tqdm(total=total_steps, initial=progress.step, desc="train",
                        disable=not accelerator.is_local_main_process)
    model.train()
    start_epoch, skip_steps = divmod(progress.step, steps_per_epoch)
    for epoch in range(start_epoch, num_epochs):
        train_dataloader.set_epoch(epoch)  # the same shuffle per epoch, for any process count and after a resume
        batches = train_dataloader
        if epoch == start_epoch and skip_steps:  # resume mid-epoch: skip the micro-batches already trained on
            batches = skip_first_batches(train_dataloader, skip_steps * ga)
        for window in accumulation_windows(batches, ga):
            lr = lr_scheduler.get_last_lr()[0]
            num_items = count_label_tokens(window, accelerator)  # real label tokens in the window, all processes
            for batch in window:
                with accelerator.accumulate(model):
                    outputs = model(**batch, num_items_in_batch=num_items)
                    loss, token_loss = backward_loss(outputs, accelerator, router_aux_loss_coef)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:  # clip once per optimizer step, on the summed gradients
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)
                    optimizer.step()
                    if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                        lr_scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                log.add(token_loss, batch)
            progress.step += 1
            step = progress.step
            log.end_step()
            progress_bar.update(1)

            if step % args.logging_steps == 0 or step == total_steps:
                last_log = log.write_step(step, step / steps_per_epoch, lr, grad_norm)
                progress_bar.set_postfix(loss=f"{last_log['loss']:.4f}", lr=f"{lr:.2e}",
                                         tok_s=f"{last_log['tokens_per_second']:,.0f}")
            if args.eval_steps and step % args.eval_steps == 0 and step < total_steps:
                with log.paused():
                    eval_metrics = evaluate_causal_lm(model, eval_dataloader, accelerator)
                log.write_eval(step, eval_metrics)
                logger.info(f"step {step}: eval_loss {eval_metrics['eval_loss']:.4f} "
                            f"perplexity {eval_metrics['perplexity']:.2f}")
            if args.checkpointing_steps and step % args.checkpointing_steps == 0:
                with log.paused():
                    save_checkpoint(accelerator, args.output_dir, step, args.save_total_limit)
            if step >= total_steps:
                break
        if progress.step >= total_steps:
            break
    progress_bar.close()
    train_runtime = time.perf_counter() - train_start

    # ---- final evaluation and export --------------------------------------------------------------------------------
    eval_metrics = evaluate_causal_lm(model, eval_dataloader, accelerator)
    log.write_eval(progress.step, eval_metrics)
    logger.info(f"Final eval_loss {eval_metrics['eval_loss']:.4f}, perplexity {eval_metrics['perplexity']:.2f}")
    export_model(accelerator, model, tokenizer, args.output_dir)
    if accelerator.is_main_process:
        results = {**eval_metrics, "train_loss": last_log.get("loss"), "train_steps": progress.step,
                   "train_runtime": train_runtime, "num_parameters": total_params,
                   "num_processes": accelerator.num_processes, "peak_memory_bytes": peak_memory_bytes()}
        if args.sample_max_new_tokens > 0:
            results["sample"] = generate_sample(args.output_dir, args.sample_prompt, args.sample_max_new_tokens)
            logger.info(f"Sample from the exported model:\n{results['sample']}")
        write_all_results(args.output_dir, results)
        logger.info(f"Model, tokenizer, metrics.jsonl and all_results.json are in {args.output_dir}")


def generate_sample(model_dir: str, prompt: str, max_new_tokens: int) -> str:
    """Reload the exported folder as a user would, and sample from it (proves the export is complete)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with outside_zero3(), torch.no_grad():  # main process only: no partitioned build, no lockstep generation
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        inputs = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True, top_k=50, temperature=0.8,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)


if __name__ == "__main__":
    main()
