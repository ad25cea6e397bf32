#!/usr/bin/env python
"""Pretrain a Llama-architecture causal LM (or a Mixtral-style MoE) with Accelerate.

    accelerate launch scripts/pretrain_llama.py                      # embedded default: this Python's stdlib sources
    accelerate launch scripts/pretrain_llama.py --train_file my.jsonl --model_preset 125m --bf16
    accelerate launch --config_file accelerate_configs/<pick>.yaml scripts/pretrain_llama.py ...

The loop below is the whole training procedure: prepare, accumulate, backward, clip, step, log, evaluate,
checkpoint, export. `common/` holds only the pieces the scripts share (arguments, data, model, optimizer, the exact
accumulation loss, the step bookkeeping, checkpoints, metrics).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import torch
from accelerate.logging import get_logger
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator

from common.accumulation import (backward_loss, check_loss_honours_num_items, count_label_tokens,
                                 router_aux_loss_coefficient)
from common.checkpoint import find_checkpoint_to_resume, resume, save_checkpoint
from common.data import get_tokenizer, load_raw_datasets, tokenize_and_pack
from common.errors import fail
from common.evaluation import evaluate_causal_lm
from common.export import export_model
from common.flags import ArgumentParser, add_data_args, add_model_args, add_training_args
from common.guard import DIVERGED_STATUS, NonFiniteGuard, Verdict
from common.metrics import StepLog, flops_per_token, peak_memory_bytes, write_all_results
from common.modeling import (PRESETS, build_causal_lm, check_block_size, count_parameters, full_numel, load_config,
                             outside_zero3)
from common.optim import create_optimizer_and_scheduler
from common.output_dir import claim_output_dir
from common.preemption import STOPPED_STATUS, announce_stop, catch_stop_signals, stop_signalled
from common.run_record import RunRecord
from common.runtime import build_accelerator, finish, init_trackers
from common.steps import count_optimizer_steps, optimizer_step_windows, stream_step_windows, track_progress
from common.streaming import load_streaming_data
from common.validation import check_common_flags

logger = get_logger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser, PRESETS)
    add_data_args(parser)
    add_training_args(parser)
    g = parser.add_argument_group("pretraining")
    g.add_argument("--block_size", type=int, default=256, help="Tokens per packed training sequence.")
    g.add_argument("--tokenizer_vocab_size", type=int, default=8192, help="Vocabulary of a tokenizer trained here.")
    g.add_argument("--streaming", action="store_true",
                   help="Read the corpus as a stream: tokenized and packed on the fly, no cache; needs --max_steps.")
    g.add_argument("--sample_prompt", default="def ", help="Prompt for the sample generated at the end.")
    g.add_argument("--sample_max_new_tokens", type=int, default=64, help="Tokens of that sample; 0: no sample.")
    args = parser.parse_args(argv)
    check_common_flags(args)
    if args.block_size < 2:
        fail(f"--block_size must be >= 2 (got {args.block_size})")
    if args.streaming and args.max_steps <= 0:
        fail("--streaming needs --max_steps: a stream has no length to count epochs in")
    if sum(x is not None for x in (args.model_name_or_path, args.config_name, args.model_preset)) > 1:
        fail("give only one of --model_name_or_path, --config_name, --model_preset")
    return args


def data_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """This script's flags that decide which blocks a run trains on (a resume must keep them)."""
    trained_tokenizer = not (args.tokenizer_name or args.model_name_or_path)
    return ("block_size",) + (("tokenizer_vocab_size",) if trained_tokenizer else ())


def main() -> None:
    args = parse_args()
    config = load_config(args)  # cheap: checked against the flags before any heavy work
    check_block_size(config, args.block_size)
    accelerator = build_accelerator(args)
    # None: a fresh start. Every file of the checkpoint is checked against its recorded size and checksum first.
    resume_from = find_checkpoint_to_resume(args.output_dir, args.resume_from_checkpoint, accelerator)
    status = train(args, config, accelerator, resume_from)
    finish(accelerator)  # after train() has returned: its model is gone
    sys.exit(status)


def load_data(args, accelerator, resume_from: str | None):
    """Corpus -> fast tokenizer -> packed blocks -> (tokenizer, train dataloader, eval dataloader)."""
    raw = load_raw_datasets(args)
    tokenizer = get_tokenizer(args, accelerator, raw, resume_from, args.tokenizer_vocab_size)
    data = tokenize_and_pack(args, accelerator, raw, tokenizer, args.block_size)
    loader_kwargs = dict(collate_fn=default_data_collator, num_workers=args.dataloader_num_workers,
                         pin_memory=args.dataloader_pin_memory and torch.cuda.is_available())
    # Its own generator: each new iterator draws a seed from it, not from the global RNG that dropout uses. A run
    # resumed mid-epoch creates its iterator after the checkpoint's RNG is restored (the uninterrupted run did so at
    # the epoch's start): from the global RNG, that one extra draw would change every later dropout mask.
    train_dataloader = DataLoader(data["train"], shuffle=True, batch_size=args.per_device_train_batch_size,
                                  generator=torch.Generator(), **loader_kwargs)
    eval_dataloader = DataLoader(data["validation"], batch_size=args.per_device_eval_batch_size, **loader_kwargs)
    return tokenizer, train_dataloader, eval_dataloader


def train(args, config, accelerator, resume_from: str | None) -> int:
    """The whole run; returns the exit status: 0, STOPPED_STATUS (a stop signal, after its checkpoint) or
    DIVERGED_STATUS."""
    run = RunRecord(args, "pretrain_llama", accelerator, config, data_flags(args), resume_from)  # checks a resume
    claim_output_dir(args, accelerator)  # the lock, --overwrite_output_dir, leftovers of interrupted saves
    ga = args.gradient_accumulation_steps
    if args.streaming:  # no length: --max_steps long; epochs are passes over each process's share of the stream
        tokenizer, train_dataloader, eval_dataloader = load_streaming_data(args, accelerator, resume_from)
        steps_per_epoch, total_steps = None, args.max_steps
    else:
        tokenizer, train_dataloader, eval_dataloader = load_data(args, accelerator, resume_from)
        steps_per_epoch, total_steps = count_optimizer_steps(train_dataloader, ga, accelerator.num_processes,
                                                             args.max_steps, args.num_train_epochs, unit="blocks")
    run.add_data(tokenizer, steps_per_epoch)

    # ---- model, optimizer, schedule (in optimizer steps) ------------------------------------------------------------
    model = build_causal_lm(args, config, len(tokenizer))
    trainable, total_params = count_parameters(model)
    step_flops = flops_per_token(model.config, total_params, full_numel(model.get_input_embeddings().weight),
                                 args.block_size)
    router_aux_loss_coef = router_aux_loss_coefficient(model.config)
    optimizer, lr_scheduler = create_optimizer_and_scheduler(args, model, accelerator, total_steps)

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    check_loss_honours_num_items(model, accelerator, router_aux_loss_coef)  # else backward_loss's scale is wrong
    progress = track_progress(accelerator)
    resume(accelerator, resume_from, progress, run)
    init_trackers(accelerator, args, "pretrain_llama")
    blocks = "a stream of" if args.streaming else len(train_dataloader.dataset)
    logger.info(f"Model: {total_params / 1e6:.2f}M parameters ({trainable / 1e6:.2f}M trainable), "
                f"{blocks} training blocks of {args.block_size} tokens, {steps_per_epoch or 'unknown'} "
                f"optimizer steps per epoch, {total_steps} in all; global batch "
                f"{args.per_device_train_batch_size * ga * accelerator.num_processes} sequences")

    # ---- training loop: it ends at total_steps, or returns early on a stop signal or divergence ---------------------
    log = StepLog(accelerator, args.output_dir, progress.step, total_steps, steps_per_epoch, args.logging_steps,
                  flops_per_token=step_flops)
    guard = NonFiniteGuard(accelerator, progress, args.max_nonfinite_steps)
    catch_stop_signals()  # from here on SIGTERM/SIGINT/SIGUSR1 end the run after the current step, with a checkpoint
    train_start = time.perf_counter()
    model.train()
    windows = (stream_step_windows(train_dataloader, progress, total_steps, ga) if args.streaming else
               optimizer_step_windows(train_dataloader, progress, steps_per_epoch, total_steps, ga))
    for window in windows:  # one optimizer step's micro-batches; progress.step is the step it completes
        lr = lr_scheduler.get_last_lr()[0]
        num_items = count_label_tokens(window, accelerator)  # real label tokens in the window, all processes
        window_loss = torch.zeros((), device=accelerator.device)  # this process's share of the step's loss
        for batch in window:
            with accelerator.accumulate(model):
                outputs = model(**batch, num_items_in_batch=num_items, use_cache=False)
                loss, token_loss = backward_loss(outputs, accelerator, router_aux_loss_coef)
                accelerator.backward(loss)
                window_loss += token_loss
                log.count_tokens(batch)
                if accelerator.sync_gradients:  # once per optimizer step, on the summed gradients
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)
                    # the step's one read to the host: loss, grad norm, any rank's stop signal; one verdict everywhere
                    checked = guard.check(window_loss, grad_norm, stop_signalled())
                    if checked.verdict is Verdict.APPLY:
                        optimizer.step()
                        if not accelerator.optimizer_step_was_skipped:  # fp16 overflow or DeepSpeed's own skip
                            lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
        if checked.verdict is Verdict.DIVERGED:
            return DIVERGED_STATUS  # the guard has said why; the newest checkpoint holds finite weights
        step = progress.step
        log.step(step, lr, checked.loss, checked.grad_norm)

        stop = checked.stop_requested  # a stop signal on any rank: every rank saves this step and returns
        if args.eval_steps and step % args.eval_steps == 0 and step < total_steps and not stop:
            with log.untimed():
                eval_metrics = evaluate_causal_lm(model, eval_dataloader, accelerator)
            log.write_eval(step, eval_metrics)
        if stop or (args.checkpointing_steps and step % args.checkpointing_steps == 0):
            with log.untimed():
                checkpoint = save_checkpoint(accelerator, args.output_dir, step, args.save_total_limit, run)
            if checkpoint is None:
                return DIVERGED_STATUS  # a non-finite weight: nothing saved, the reason printed
        if stop:
            announce_stop(step, checkpoint)  # where it stopped and the command that continues it
            return STOPPED_STATUS
    log.close()
    train_runtime = time.perf_counter() - train_start

    # ---- final evaluation and export --------------------------------------------------------------------------------
    eval_metrics = evaluate_causal_lm(model, eval_dataloader, accelerator)
    log.write_eval(progress.step, eval_metrics)
    if not export_model(accelerator, model, tokenizer, args.output_dir):
        return DIVERGED_STATUS  # a non-finite weight: nothing exported, the reason printed
    if accelerator.is_main_process:
        results = {**eval_metrics, "train_loss": log.last_row.get("loss"), "train_steps": progress.step,
                   "train_runtime": train_runtime, "num_parameters": total_params,
                   "num_processes": accelerator.num_processes, "peak_memory_bytes": peak_memory_bytes()}
        if args.sample_max_new_tokens > 0:
            results["sample"] = generate_sample(args.output_dir, args.sample_prompt, args.sample_max_new_tokens)
            logger.info(f"Sample from the exported model:\n{results['sample']}")
        write_all_results(args.output_dir, results)
        logger.info(f"Model, tokenizer, metrics.jsonl and all_results.json are in {args.output_dir}")
    return 0


def generate_sample(model_dir: str, prompt: str, max_new_tokens: int) -> str:
    """Reload the exported folder as a user would, and sample from it with its generation config (proves the export
    is complete: the sample stops at the tokenizer's end-of-text)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with outside_zero3(), torch.no_grad():  # main process only: no partitioned build, no lockstep generation
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        inputs = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True, top_k=50, temperature=0.8)
    return tokenizer.decode(out[0], skip_special_tokens=True)


if __name__ == "__main__":
    main()
