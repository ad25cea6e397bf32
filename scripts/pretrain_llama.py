#!/usr/bin/env python
"""Pretrain a Llama-architecture causal LM (or a Mixtral-style MoE) with Accelerate.

    accelerate launch scripts/pretrain_llama.py                      # embedded default: this Python's stdlib sources
    accelerate launch scripts/pretrain_llama.py --train_file my.jsonl --model_preset 125m --bf16
    accelerate launch --config_file accelerate_configs/<pick>.yaml scripts/pretrain_llama.py ...

The loop below is the whole training procedure: prepare, accumulate, backward, clip, step, log, evaluate,
checkpoint, export. `common/` holds the core the recipes share (flags, the exact accumulation loss, step bookkeeping,
optimizer, checkpoints, metrics, export), `common/inputs/` the data and model building a copier replaces, and
`common/features/` the optional features: each is wired in by the lines marked `# feature: <name>` (docs/layout.md).
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
from common.checkpoint import CheckpointExtras, find_checkpoint_to_resume, save_checkpoint
from common.errors import fail
from common.export import export_model
from common.flags import ArgumentParser, add_data_args, add_model_args, add_training_args, check_common_flags
from common.guard import DIVERGED_STATUS, STOPPED_STATUS, Verdict
from common.inputs.mixture import (TokensPerSource, add_mixture_args, evaluate_sources, load_mixed_blocks,
                                   read_sources)
from common.inputs.modeling import (PRESETS, build_causal_lm, check_block_size, count_parameters, flops_per_token,
                                    full_numel, load_config, outside_zero3)
from common.lifecycle import RunLifecycle, finish
from common.optim import create_optimizer_and_scheduler
from common.runtime import build_accelerator
from common.steps import count_optimizer_steps, optimizer_step_windows
from common.features.activation_memory import (add_activation_memory_args, check_activation_memory,
                                               reduce_activation_memory)  # feature: activation memory
from common.features.async_checkpoint import (add_async_checkpoint_args, save_in_background,
                                              wait_for_checkpoint)  # feature: async checkpoint
from common.features.checksums import record_files, verify_checkpoint  # feature: checksums
from common.features.chunked_loss import (add_chunked_loss_args, check_chunked_loss, use_chunked_loss)  # feature: chunked loss
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
from common.features.liger import (add_liger_args, check_liger_kernel, undo_liger_kernel,
                                   use_liger_kernel)  # feature: liger kernel
from common.features.muon import add_muon_args, check_muon_flags, muon_optimizer  # feature: muon
from common.features.preemption import announce_stop, catch_stop_signals, stop_when_launcher_dies  # feature: preemption
from common.features.resume_guard import RunRecord  # feature: resume guard
from common.features.sequence_parallel import (accumulate_slices, check_sequence_parallel, slice_windows,
                                               unsliced)  # feature: sequence parallel
from common.features.streaming import (add_streaming_args, check_streaming_flags, load_streaming_data)  # feature: streaming
from common.features.wsd import add_wsd_args, check_wsd_flags, wsd_schedule  # feature: warmup stable decay
from common.features.tensor_parallel import (check_tensor_parallel, hide_parallelism_config_on_cpu, shard_model,
                                             sharding_figures, tensor_parallel_prepared,
                                             use_tensor_parallel)  # feature: tensor parallel

logger = get_logger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser, PRESETS)
    add_data_args(parser, files="+")  # one file per source of a mixture
    add_mixture_args(parser)
    add_training_args(parser)
    add_divergence_args(parser)  # feature: divergence guard
    add_compile_args(parser)  # feature: torch compile
    add_async_checkpoint_args(parser)  # feature: async checkpoint
    add_activation_memory_args(parser)  # feature: activation memory
    add_chunked_loss_args(parser)  # feature: chunked loss
    add_liger_args(parser)  # feature: liger kernel
    add_streaming_args(parser)  # feature: streaming
    add_muon_args(parser)  # feature: muon
    add_wsd_args(parser)  # feature: warmup stable decay
    # The defaults: Muon + warmup-stable-decay at 8e-3, measured against AdamW on the default run (docs/muon-and-wsd.md)
    parser.set_defaults(optim="muon", learning_rate=8e-3)  # feature: muon
    parser.set_defaults(lr_scheduler_type="warmup_stable_decay")  # feature: warmup stable decay
    g = parser.add_argument_group("pretraining")
    g.add_argument("--block_size", type=int, default=256, help="Tokens per packed training sequence.")
    g.add_argument("--tokenizer_vocab_size", type=int, default=8192, help="Vocabulary of a tokenizer trained here.")
    g.add_argument("--sample_prompt", default="def ", help="Prompt for the sample generated at the end.")
    g.add_argument("--sample_max_new_tokens", type=int, default=64, help="Tokens of that sample; 0: no sample.")
    args = parser.parse_args(argv)
    check_common_flags(args)
    read_sources(args)  # each source checked (one line naming it) before any data is read
    check_divergence_flags(args)  # feature: divergence guard
    check_compile_flags(args)  # feature: torch compile
    if args.block_size < 2:
        fail(f"--block_size must be >= 2 (got {args.block_size})")
    check_streaming_flags(args)  # feature: streaming
    check_muon_flags(args)  # feature: muon
    check_wsd_flags(args)  # feature: warmup stable decay
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
    check_activation_memory(args, config)  # feature: activation memory
    if args.chunked_cross_entropy:  # feature: chunked loss
        check_chunked_loss(config)
    if args.use_liger_kernel:  # feature: liger kernel
        chunked = getattr(args, "chunked_cross_entropy", False)  # absent from a copy without that feature
        check_liger_kernel(config, fused_loss=True, chunked_cross_entropy=chunked)
    check_deepspeed_config(args)  # feature: deepspeed check
    check_sequence_parallel(args, config, args.block_size)  # feature: sequence parallel
    check_tensor_parallel(args, config)  # feature: tensor parallel
    stop_when_launcher_dies()  # feature: preemption
    use_all_cores()  # feature: cpu threads
    hide_parallelism_config_on_cpu()  # feature: tensor parallel
    accelerator = build_accelerator(args)
    use_fsdp2_on_cpu(accelerator)  # feature: fsdp2 on cpu
    use_tensor_parallel(accelerator)  # feature: tensor parallel
    accumulate_slices(accelerator)  # feature: sequence parallel
    extras = CheckpointExtras()  # what the features below add to checkpoints
    extras.record_files, extras.verify = record_files, verify_checkpoint  # feature: checksums
    extras.explain_failed_save = stop_if_disk_full  # feature: full disk
    extras.can_save = finite_weights  # feature: divergence guard
    extras.save = save_in_background(args, accelerator)  # feature: async checkpoint
    # None: a fresh start (with checksums: every file of the checkpoint is checked first).
    resume_from = find_checkpoint_to_resume(args.output_dir, args.resume_from_checkpoint, accelerator, extras.verify)
    training = train
    training = stop_on_full_disk(training, args.output_dir, extras)  # feature: full disk
    status = training(args, config, accelerator, resume_from, extras)
    wait_for_checkpoint(extras)  # feature: async checkpoint
    finish(accelerator)  # after train() has returned: its model is gone
    sys.exit(status)


def load_data(args, accelerator, resume_from: str | None):
    """Sources -> (mix) -> fast tokenizer -> packed blocks -> (tokenizer, train dataloader, an eval dataloader per
    source, mixture); the stages are common/inputs/ (map-style) or common/features/streaming.py (a stream)."""
    sources = read_sources(args)
    if args.streaming:  # feature: streaming
        return load_streaming_data(args, accelerator, resume_from, sources)  # no length: --max_steps long
    tokenizer, train_blocks, eval_blocks, mixture = load_mixed_blocks(args, accelerator, resume_from, sources)
    loader_kwargs = dict(collate_fn=default_data_collator, num_workers=args.dataloader_num_workers,
                         pin_memory=args.dataloader_pin_memory and torch.cuda.is_available())
    # One corpus is shuffled by the sampler; a mixture is read in its own order, which is its shuffle (a function of
    # the seed, the epoch and the position). Its own generator: each new iterator draws a seed from it, not from the
    # global RNG that dropout uses (a run resumed mid-epoch creates its iterator after the checkpoint's RNG is
    # restored, the uninterrupted run at the epoch's start: that one extra draw would change every later mask).
    train_dataloader = DataLoader(train_blocks, shuffle=len(sources) == 1, generator=torch.Generator(),
                                  batch_size=args.per_device_train_batch_size, **loader_kwargs)
    eval_dataloaders = [DataLoader(blocks, batch_size=args.per_device_eval_batch_size, **loader_kwargs)
                        for blocks in eval_blocks.values()]
    return tokenizer, train_dataloader, eval_dataloaders, mixture


def train(args, config, accelerator, resume_from: str | None, extras: CheckpointExtras) -> int:
    """The whole run; returns the exit status: 0, STOPPED_STATUS (after a stop's checkpoint) or DIVERGED_STATUS."""
    record = RunRecord(args, "pretrain_llama", accelerator, config, data_flags(args), resume_from)  # feature: resume guard
    extras.write, extras.check, extras.keep = record.write, record.check, record.keep  # feature: resume guard
    lock_output_dir(args.output_dir, accelerator.is_main_process)  # feature: folder lock
    run = RunLifecycle(accelerator, args.output_dir, args.overwrite_output_dir, resume_from, extras)
    tokenizer, train_dataloader, eval_dataloaders, mixture = load_data(args, accelerator, resume_from)
    steps_per_epoch, total_steps, tokens = count_steps(args, accelerator, train_dataloader, mixture)
    record.add_data(tokenizer, steps_per_epoch, mixture=mixture.describe())  # feature: resume guard
    # ---- model, optimizer, schedule (in optimizer steps) ------------------------------------------------------------
    model = build_model(args, config, len(tokenizer), accelerator)
    total_params = count_parameters(model)[1]
    step_flops = flops_per_token(model.config, total_params, full_numel(model.get_input_embeddings().weight),
                                 args.block_size)
    router_aux_loss_coef = router_aux_loss_coefficient(model.config)
    optimizer, lr_scheduler = optimizer_and_schedule(args, model, accelerator, total_steps)
    model, optimizer, train_dataloader, lr_scheduler, *eval_dataloaders = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler, *eval_dataloaders)  # one eval dataloader per source
    tensor_parallel_prepared(accelerator, model)  # feature: tensor parallel
    train_dataloader, *eval_dataloaders = unsliced(train_dataloader, *eval_dataloaders)  # feature: sequence parallel
    check_loss_honours_num_items(model, accelerator, router_aux_loss_coef)  # else backward_loss's scale is wrong
    # restores a checkpoint, starts the trackers: the step counter, step log and divergence guard start from there
    progress, log, guard = run.start(total_steps, steps_per_epoch, args.logging_steps,
                                     trackers=("pretrain_llama", vars(args)), flops_per_token=step_flops)
    describe_run(args, accelerator, model, train_dataloader, steps_per_epoch, total_steps)
    tokens.progress, log.row_extras = progress, tokens.row  # train_tokens/<source> in each row
    # ---- training loop: it ends at total_steps, or returns early on a stop signal or divergence ---------------------
    guard = NonFiniteGuard(accelerator, progress, args.max_nonfinite_steps)  # feature: divergence guard
    guard.stop_signalled = catch_stop_signals()  # feature: preemption
    train_start = time.perf_counter()
    model.train()
    # one optimizer step's micro-batches at a time; progress.step is the step the window completes
    windows = optimizer_step_windows(train_dataloader, progress, steps_per_epoch, total_steps,
                                     args.gradient_accumulation_steps)
    windows = slice_windows(windows, accelerator)  # feature: sequence parallel
    for window in windows:
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
                    verdict = guard.check(window_loss, grad_norm).verdict  # no read: skips on the device
                    lr = lr_scheduler.get_last_lr()[0]  # after the check, which settles the last step
                    if verdict is Verdict.APPLY:
                        optimizer.step()
                        if not accelerator.optimizer_step_was_skipped:  # fp16 overflow or DeepSpeed's own skip
                            lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
        step = progress.step
        saving = bool(args.checkpointing_steps) and step % args.checkpointing_steps == 0
        checked = guard.step_check(read=saving or log.writes_row(step))  # the figures a row or save needs
        if checked.verdict is Verdict.DIVERGED:
            return DIVERGED_STATUS  # the guard has said why; the newest checkpoint holds finite weights
        log.step(step, lr, checked)
        stop = checked.stop_requested  # a stop signal on any rank: every rank saves this step and returns
        if args.eval_steps and step % args.eval_steps == 0 and step < total_steps and not stop:
            with log.untimed():
                eval_metrics = evaluate_sources(model, eval_dataloaders, mixture.names, accelerator)
            log.write_eval(step, eval_metrics)
        if stop or saving:
            with log.untimed():
                checkpoint = save_checkpoint(accelerator, args.output_dir, step, args.save_total_limit, extras)
            if checkpoint is None:
                return DIVERGED_STATUS  # a non-finite weight: nothing saved, the reason printed
        if stop:
            wait_for_checkpoint(extras)  # feature: async checkpoint
            announce_stop(step, checkpoint)  # feature: preemption
            return STOPPED_STATUS
    log.close()
    wait_for_checkpoint(extras)  # feature: async checkpoint
    train_runtime = time.perf_counter() - train_start
    # ---- final evaluation and export --------------------------------------------------------------------------------
    eval_metrics = evaluate_sources(model, eval_dataloaders, mixture.names, accelerator)
    log.write_eval(progress.step, eval_metrics)
    if not exporter(args)(accelerator, model, tokenizer, args.output_dir):
        return DIVERGED_STATUS  # a non-finite weight: nothing exported, the reason printed
    results = {**eval_metrics, "train_steps": progress.step, "train_runtime": train_runtime,
               "num_parameters": total_params, **(tokens.row() | tokens.passes(progress.step))}
    if args.sample_max_new_tokens > 0 and accelerator.is_main_process:
        results["sample"] = generate_sample(args.output_dir, args.sample_prompt, args.sample_max_new_tokens)
    results.update(compile_counts() if args.torch_compile else {})  # feature: torch compile
    results.update(sharding_figures(model, accelerator))  # feature: tensor parallel
    log.write_results(results)
    return 0


def count_steps(args, accelerator, train_dataloader, mixture):
    """(optimizer steps per epoch, in all, the training tokens per source as a function of the step)."""
    processes = accelerator.num_processes // getattr(accelerator.parallelism_config, "tp_size", 1)  # tp: one batch
    ga = args.gradient_accumulation_steps
    steps_per_epoch, total_steps = count_optimizer_steps(train_dataloader, ga, processes, args.max_steps,
                                                         args.num_train_epochs, unit="blocks")
    if args.mixture_stopping == "first_exhausted" and steps_per_epoch:  # the epoch ends before a source repeats
        total_steps = min(total_steps, steps_per_epoch)
    drawn = getattr(train_dataloader, "blocks_drawn", None)  # a stream counts what it hands out
    global_batch = args.per_device_train_batch_size * ga * processes
    return steps_per_epoch, total_steps, TokensPerSource(accelerator, mixture, args.block_size, global_batch,
                                                         steps_per_epoch, drawn)


def optimizer_and_schedule(args, model, accelerator, total_steps: int):
    """The optimizer and LR schedule of common/optim.py: the core's (--optim, --lr_scheduler_type) unless a feature
    below chooses them."""
    create, schedule_kwargs = None, None
    create = muon_optimizer(args, model, accelerator)  # feature: muon
    schedule_kwargs = wsd_schedule(args, total_steps)  # feature: warmup stable decay
    return create_optimizer_and_scheduler(args, model, accelerator, total_steps, create, schedule_kwargs)


def exporter(args):
    """How the trained model is written (common/export.py; the features below wrap or replace it)."""
    export = export_model
    export = explain_full_disk(export)  # feature: full disk
    export = export_if_finite(export)  # feature: divergence guard
    return export


def describe_run(args, accelerator, model, train_dataloader, steps_per_epoch: int | None, total_steps: int) -> None:
    trainable, total = count_parameters(model)
    blocks = len(train_dataloader.dataset) if steps_per_epoch else "a stream of"
    processes = accelerator.num_processes // getattr(accelerator.parallelism_config, "tp_size", 1)  # tp: one batch
    logger.info(f"Model: {total / 1e6:.2f}M parameters ({trainable / 1e6:.2f}M trainable), "
                f"{blocks} training blocks of {args.block_size} tokens, {steps_per_epoch or 'unknown'} "
                f"optimizer steps per epoch, {total_steps} in all; global batch "
                f"{args.per_device_train_batch_size * args.gradient_accumulation_steps * processes} sequences")


def build_model(args, config, vocab_size: int, accelerator):
    """The model to train: a fresh one from `config`, or pretrained weights (--model_name_or_path)."""
    model = build_causal_lm(args, config, vocab_size)
    if args.use_liger_kernel:  # feature: liger kernel
        use_liger_kernel(model, fused_loss=True)
    if args.chunked_cross_entropy:  # feature: chunked loss
        use_chunked_loss(model)
    if args.selective_ac_option or args.activation_offloading:  # feature: activation memory
        reduce_activation_memory(model, args.selective_ac_option, args.activation_offloading)
    if args.torch_compile:  # feature: torch compile
        compile_model(model, args.torch_compile_whole_model, args.torch_compile_backend, args.torch_compile_mode)
    model = shard_model(model, accelerator)  # feature: tensor parallel
    return model


def generate_sample(model_dir: str, prompt: str, max_new_tokens: int) -> str:
    """Reload the exported folder as a user would, and sample from it with its generation config (proves the export
    is complete: the sample stops at the tokenizer's end-of-text)."""
    undo_liger_kernel()  # feature: liger kernel
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with outside_zero3(), torch.no_grad():  # main process only: no partitioned build, no lockstep generation
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        inputs = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True, top_k=50, temperature=0.8)
    sample = tokenizer.decode(out[0], skip_special_tokens=True)
    logger.info(f"Sample from the exported model:\n{sample}")
    return sample


if __name__ == "__main__":
    main = record_exit_status(main)  # feature: exit status
    main()
