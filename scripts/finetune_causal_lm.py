#!/usr/bin/env python
"""Supervised fine-tuning (SFT) of a causal LM with Accelerate: the loss is on the responses only.

    accelerate launch scripts/finetune_causal_lm.py --model_name_or_path outputs/pretrain   # the pretraining export
    accelerate launch scripts/finetune_causal_lm.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --train_file chats.jsonl --packing --bf16 --gradient_checkpointing

Data: jsonl/csv/parquet or a hub dataset with `prompt` and `completion` columns (the text is prompt + completion, then
EOS), or a `messages` column of chat turns rendered with the tokenizer's chat template (the loss is on the assistant
turns). Without data, the default task is built from this Python's standard library: write a function's body from its
signature and docstring. Examples keep their own lengths: batches are padded to their longest example, or with
`--packing` concatenated into one row with per-example position ids (no padding at all). With lengths this uneven,
the loss of an optimizer step must be the mean over all its response tokens (common/accumulation.py), not the mean
of micro-batch means.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM  # feature: lora
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

from common.accumulation import (backward_loss, check_loss_honours_num_items, count_label_tokens,
                                 router_aux_loss_coefficient)
from common.checkpoint import CheckpointExtras, find_checkpoint_to_resume, save_checkpoint
from common.errors import fail, fail_on_every_rank
from common.evaluation import evaluate_causal_lm
from common.export import export_model
from common.flags import ArgumentParser, add_data_args, add_model_args, add_training_args
from common.guard import DIVERGED_STATUS, STOPPED_STATUS, Verdict
from common.inputs.batching import EpochLengthGroupedSampler, pad_to_multiple_of
from common.inputs.data import HeldOut, Source, check_data_files, get_tokenizer, load_raw_datasets
from common.inputs.modeling import (add_finetuning_args, build_causal_lm, check_finetuning_flags, count_parameters,
                                    freeze_parameters, load_finetuning_config)
from common.inputs.responses import (build_docstring_task, chat_problem, check_tokenized, naming_the_failing_row,
                                     render_chat, rows_of, text_problem, tokenize_with_response_labels)
from common.lifecycle import RunLifecycle, finish
from common.optim import create_optimizer_and_scheduler
from common.runtime import build_accelerator
from common.steps import count_optimizer_steps, optimizer_step_windows
from common.upstream import attention_implementation
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
from common.features.liger import add_liger_args, check_liger_kernel, use_liger_kernel  # feature: liger kernel
from common.features.lora import (add_adapter, add_peft_args, base_model_kwargs, check_adapter_targets,
                                  check_peft_flags, check_vocab_size, export_adapter, export_and_merge,
                                  frozen_base_left_out)  # feature: lora
from common.features.preemption import announce_stop, catch_stop_signals, stop_when_launcher_dies  # feature: preemption
from common.features.resume_guard import RunRecord  # feature: resume guard
from common.features.sequence_parallel import refuse_sequence_parallel  # feature: sequence parallel
from common.features.tensor_parallel import (check_tensor_parallel, hide_parallelism_config_on_cpu, shard_model,
                                             sharding_figures, tensor_parallel_prepared,
                                             use_tensor_parallel)  # feature: tensor parallel

logger = get_logger(__name__)
DATA_FLAGS = ("prompt_column", "completion_column", "messages_column")  # decide the examples: a resume keeps them


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
    add_chunked_loss_args(parser)  # feature: chunked loss
    add_liger_args(parser)  # feature: liger kernel
    add_peft_args(parser)  # feature: lora
    parser.set_defaults(learning_rate=2e-5, weight_decay=0.0, adam_beta2=0.999, attn_implementation=None)
    g = parser.add_argument_group("supervised fine-tuning")
    g.add_argument("--prompt_column", default="prompt", help="Column holding the prompt (no loss on it).")
    g.add_argument("--completion_column", default="completion", help="Column holding the response (the loss).")
    g.add_argument("--messages_column", default="messages", help="Chat turns [{role, content}, ...], used if present.")
    g.add_argument("--chat_template", help="A Jinja chat template file, for a tokenizer that has none.")
    g.add_argument("--packing", action="store_true",
                   help="Concatenate each batch's examples into one row with per-example position ids (no padding).")
    args = parser.parse_args(argv)
    check_finetuning_flags(args)
    check_data_files(args.train_file, args.validation_file)
    check_divergence_flags(args)  # feature: divergence guard
    check_compile_flags(args)  # feature: torch compile
    check_peft_flags(args)  # feature: lora
    if args.packing and args.group_by_length:
        fail("--group_by_length saves nothing with --packing (packed batches have no padding)")
    if args.chat_template and not os.path.isfile(args.chat_template):
        fail(f"--chat_template {args.chat_template}: no such file")
    return args


def main() -> None:
    args = parse_args()
    config = load_finetuning_config(args)  # cheap: checks the flags against the model before any heavy work
    check_activation_memory(args, config)  # feature: activation memory
    if args.chunked_cross_entropy:  # feature: chunked loss
        check_chunked_loss(config)
    if args.use_liger_kernel:  # feature: liger kernel
        chunked = getattr(args, "chunked_cross_entropy", False)  # absent from a copy without that feature
        check_liger_kernel(config, fused_loss=True, chunked_cross_entropy=chunked)
    if args.use_peft:  # feature: lora
        check_adapter_targets(args, config, AutoModelForCausalLM, "CAUSAL_LM")
    check_deepspeed_config(args)  # feature: deepspeed check
    refuse_sequence_parallel("finetune_causal_lm.py")  # feature: sequence parallel
    check_tensor_parallel(args, config)  # feature: tensor parallel
    stop_when_launcher_dies()  # feature: preemption
    use_all_cores()  # feature: cpu threads
    hide_parallelism_config_on_cpu()  # feature: tensor parallel
    accelerator = build_accelerator(args)
    use_fsdp2_on_cpu(accelerator)  # feature: fsdp2 on cpu
    use_tensor_parallel(accelerator)  # feature: tensor parallel
    extras = CheckpointExtras()
    extras.record_files, extras.verify = record_files, verify_checkpoint  # feature: checksums
    extras.explain_failed_save = stop_if_disk_full  # feature: full disk
    extras.can_save = finite_weights  # feature: divergence guard
    extras.save = save_in_background(args, accelerator)  # feature: async checkpoint
    extras.state_kwargs = partial(frozen_base_left_out, accelerator)  # feature: lora
    resume_from = find_checkpoint_to_resume(args.output_dir, args.resume_from_checkpoint, accelerator, extras.verify)
    training = train
    training = stop_on_full_disk(training, args.output_dir, extras)  # feature: full disk
    status = training(args, config, accelerator, resume_from, extras)
    wait_for_checkpoint(extras)  # feature: async checkpoint
    finish(accelerator)
    sys.exit(status)


def load_sft_data(args, accelerator, config, resume_from: str | None):
    """Rows -> text + response spans -> tokens with the prompt masked (-100): (tokenizer, datasets, chat turns?)."""
    if not args.train_file and not args.dataset_name:
        with accelerator.main_process_first():
            args.train_file, args.validation_file = build_docstring_task(args.cache_dir)
    raw = load_raw_datasets(Source.from_flags(args), HeldOut.from_flags(args), args.cache_dir, columns={},
                            check_rows=partial(find_untrainable_row, args=args))
    use_messages = args.messages_column in raw["train"].column_names
    for column, flag in ([(args.messages_column, "--messages_column")] if use_messages else
                         [(args.prompt_column, "--prompt_column"), (args.completion_column, "--completion_column")]):
        for split in ("train", "validation"):
            if column not in raw[split].column_names:
                fail(f"no column '{column}' in the {split} split (columns: {', '.join(raw[split].column_names)}); "
                     f"set {flag}, or give a '{args.messages_column}' column of chat turns")
    tokenizer = get_tokenizer(args, accelerator, raw, resume_from)
    if args.chat_template:
        with open(args.chat_template, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    if use_messages and not tokenizer.chat_template:
        fail(f"the data has chat turns ('{args.messages_column}') but the tokenizer has no chat template: pass "
             "--chat_template FILE, or use prompt/completion columns")
    max_length = args.max_seq_length or min(tokenizer.model_max_length,
                                            getattr(config, "max_position_embeddings", None) or 2048, 2048)
    columns = dict(messages_column=args.messages_column) if use_messages else \
        dict(prompt_column=args.prompt_column, completion_column=args.completion_column)
    with accelerator.main_process_first(), naming_the_failing_row(args, [args.messages_column]):
        data = raw.map(tokenize_sft_rows, batched=True, num_proc=args.preprocessing_num_workers,
                       fn_kwargs=dict(tokenizer=tokenizer, max_length=max_length, **columns),
                       remove_columns=raw["train"].column_names, desc="Tokenizing")
    check_tokenized(raw, data, max_length, "examples")
    logger.info(f"{len(data['train'])} training examples ({'chat template' if use_messages else 'prompt + completion'}"
                f", at most {max_length} tokens)")
    return tokenizer, data


def tokenize_sft_rows(batch: dict, tokenizer, max_length: int, messages_column: str | None = None,
                      prompt_column: str | None = None, completion_column: str | None = None) -> dict:
    """`datasets.map` function: chat turns (`messages_column`) or prompt + completion -> ids, labels, length.

    Examples whose prompt alone fills `max_length` are dropped: they have nothing to learn.
    """
    out = {"input_ids": [], "attention_mask": [], "labels": [], "length": []}
    for i in range(len(next(iter(batch.values())))):
        if messages_column:
            text, spans = render_chat(tokenizer, batch[messages_column][i])
        else:
            prompt, completion = batch[prompt_column][i], batch[completion_column][i]
            text, spans = prompt + completion, [(len(prompt), len(prompt) + len(completion))]
        ids, labels = tokenize_with_response_labels(tokenizer, text, spans, plain_text=not messages_column)
        ids, labels = ids[:max_length], labels[:max_length]
        if any(label != -100 for label in labels[1:]):
            out["input_ids"].append(ids)
            out["attention_mask"].append([1] * len(ids))
            out["labels"].append(labels)
            out["length"].append(len(ids))
    return out


def exporter(args):
    """How the trained model is written (common/export.py; the features below wrap or replace it)."""
    export = export_model
    if args.use_peft:  # feature: lora
        export = export_adapter  # the adapter alone, in peft's format
    if args.use_peft and args.merge_adapter:  # feature: lora
        export = export_and_merge(AutoModelForCausalLM, args.model_name_or_path)  # the adapter, then merged/
    export = explain_full_disk(export)  # feature: full disk
    export = export_if_finite(export)  # feature: divergence guard
    return export


def build_dataloaders(args, accelerator, tokenizer, data):
    """Padded batches (or one packed row per batch with --packing), optionally grouped by length."""
    collate_tokenizer = copy.copy(tokenizer)  # the export keeps the tokenizer's own padding side
    collate_tokenizer.padding_side = "right"  # positions count from the left
    padded = DataCollatorForSeq2Seq(collate_tokenizer, label_pad_token_id=-100,
                                    pad_to_multiple_of=pad_to_multiple_of(accelerator))
    # Packing: one row per batch, position ids restart at 0 for each example, and labels get -100 at each start.
    train_collator = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100) if args.packing else padded
    sampler = None
    if args.group_by_length:
        sampler = EpochLengthGroupedSampler(data["train"]["length"], args.per_device_train_batch_size, args.seed)
        data["validation"] = data["validation"].sort("length")  # order is free: the loss is gathered, not streamed
    data = data.remove_columns("length")
    loader_kwargs = dict(num_workers=args.dataloader_num_workers,
                         pin_memory=args.dataloader_pin_memory and torch.cuda.is_available())
    # Its own generator: a resumed run draws the uninterrupted run's dropout masks (scripts/pretrain_llama.py)
    train_dataloader = DataLoader(data["train"], sampler=sampler, shuffle=sampler is None,
                                  batch_size=args.per_device_train_batch_size, collate_fn=train_collator,
                                  generator=torch.Generator(), **loader_kwargs)
    eval_dataloader = DataLoader(data["validation"], batch_size=args.per_device_eval_batch_size, collate_fn=padded,
                                 **loader_kwargs)
    return train_dataloader, eval_dataloader


def train(args, config, accelerator, resume_from: str | None, extras: CheckpointExtras) -> int:
    """The whole run; returns the exit status (see scripts/pretrain_llama.py, whose loop this one follows)."""
    record = RunRecord(args, "finetune_causal_lm", accelerator, config, DATA_FLAGS, resume_from)  # feature: resume guard
    extras.write, extras.check, extras.keep = record.write, record.check, record.keep  # feature: resume guard
    lock_output_dir(args.output_dir, accelerator.is_main_process)  # feature: folder lock
    run = RunLifecycle(accelerator, args.output_dir, args.overwrite_output_dir, resume_from, extras)
    ga = args.gradient_accumulation_steps
    tokenizer, data = load_sft_data(args, accelerator, config, resume_from)
    train_dataloader, eval_dataloader = build_dataloaders(args, accelerator, tokenizer, data)
    dp = accelerator.num_processes // getattr(accelerator.parallelism_config, "tp_size", 1)  # tp processes: one batch
    steps_per_epoch, total_steps = count_optimizer_steps(train_dataloader, ga, dp, args.max_steps,
                                                         args.num_train_epochs)
    record.add_data(tokenizer, steps_per_epoch)  # feature: resume guard
    # ---- model (with --use_peft: a frozen, maybe 4-bit, base and a LoRA adapter), freezing, optimizer, schedule ------
    model = build_model(args, config, accelerator, len(tokenizer))
    trainable, total_params = count_parameters(model)
    router_aux_loss_coef = router_aux_loss_coefficient(model.config)
    optimizer, lr_scheduler = create_optimizer_and_scheduler(args, model, accelerator, total_steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    tensor_parallel_prepared(accelerator, model)  # feature: tensor parallel
    check_loss_honours_num_items(model, accelerator, router_aux_loss_coef)
    if args.packing:
        check_packing(accelerator, model)
    progress, log, guard = run.start(total_steps, steps_per_epoch, args.logging_steps,
                                     trackers=("finetune_causal_lm", vars(args)))
    logger.info(f"Model: {total_params / 1e6:.2f}M parameters, {trainable / 1e6:.2f}M trainable "
                f"({100 * trainable / total_params:.1f}%); {steps_per_epoch} optimizer steps per epoch, {total_steps} "
                f"in all; global batch {args.per_device_train_batch_size * ga * dp} examples")
    # ---- training loop: the loss is the mean over all response tokens of the step -----------------------------------
    guard = NonFiniteGuard(accelerator, progress, args.max_nonfinite_steps)  # feature: divergence guard
    guard.stop_signalled = catch_stop_signals()  # feature: preemption
    train_start = time.perf_counter()
    model.train()
    for window in optimizer_step_windows(train_dataloader, progress, steps_per_epoch, total_steps, ga):
        num_items = count_label_tokens(window, accelerator)  # response tokens in the window, all processes
        window_loss = torch.zeros((), device=accelerator.device)
        for batch in window:
            with accelerator.accumulate(model):
                # No KV cache in training (measured, transformers 5.23: with one, the packed-sequence mask is skipped).
                outputs = model(**batch, num_items_in_batch=num_items, use_cache=False)
                loss, token_loss = backward_loss(outputs, accelerator, router_aux_loss_coef)
                accelerator.backward(loss)
                window_loss += token_loss
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
                eval_metrics = evaluate_causal_lm(model, eval_dataloader, accelerator)
            log.write_eval(step, eval_metrics)
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
    # ---- final evaluation (loss on the responses) and export --------------------------------------------------------
    eval_metrics = evaluate_causal_lm(model, eval_dataloader, accelerator)
    log.write_eval(progress.step, eval_metrics)
    if not exporter(args)(accelerator, model, tokenizer, args.output_dir):
        return DIVERGED_STATUS
    results = {**eval_metrics, "train_steps": progress.step, "train_runtime": train_runtime,
               "padding_fraction": log.padding_fraction, "num_parameters": total_params,
               "trainable_parameters": trainable, "train_examples": len(data["train"])}
    results.update(compile_counts() if args.torch_compile else {})  # feature: torch compile
    results.update(sharding_figures(model, accelerator))  # feature: tensor parallel
    log.write_results(results)
    return 0


def build_model(args, config, accelerator, vocab_size: int):
    """The pretrained model, frozen as flagged; with --use_peft a frozen (16-bit or 4-bit) base and a LoRA adapter."""
    load_kwargs = {"dtype": torch.float32}  # fp32 weights: mixed precision autocasts them
    if args.use_peft:  # feature: lora
        check_vocab_size(config, vocab_size)
        load_kwargs = base_model_kwargs(args, accelerator, "CAUSAL_LM")  # a 16-bit (or 4-bit) frozen base
    model = build_causal_lm(args, config, vocab_size, **load_kwargs)
    if args.use_liger_kernel:  # feature: liger kernel
        use_liger_kernel(model, fused_loss=True)
    if args.chunked_cross_entropy:  # feature: chunked loss
        use_chunked_loss(model)
    if args.selective_ac_option or args.activation_offloading:  # feature: activation memory
        reduce_activation_memory(model, args.selective_ac_option, args.activation_offloading)
    freeze_parameters(model, args.freeze_embeddings, args.freeze_layers)
    if args.use_peft:  # feature: lora
        model = add_adapter(args, accelerator, model, "CAUSAL_LM")
    if args.torch_compile:  # feature: torch compile
        compile_model(model, args.torch_compile_whole_model, args.torch_compile_backend, args.torch_compile_mode,
                      lengths_vary=not args.packing)
    model = shard_model(model, accelerator)  # feature: tensor parallel
    return model


def find_untrainable_row(raw, args) -> tuple[str, int, str] | None:
    """The first row (split, index, problem) that cannot give an example: chat turns with a role other than CHAT_ROLES,
    no assistant turn or an empty one, or a missing prompt or completion (`datasets` gives None for a key a JSON row
    lacks) or an empty completion."""
    use_messages = args.messages_column in raw["train"].column_names
    columns = [args.messages_column] if use_messages else [args.prompt_column, args.completion_column]
    for split, index, values in rows_of(raw, columns, args):
        problem = chat_problem(values[0], args.messages_column) if use_messages else \
            text_problem(dict(zip(columns, values)), args.completion_column)
        if problem:
            return split, index, problem
    return None


@torch.no_grad()
def check_packing(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """Stop unless the model, with its attention implementation, keeps packed examples apart: the second of two
    packed examples must give the logits it gives alone (a model that ignores the position ids would mix them).

    Runs on the prepared model, on its device and in its precision, with every process doing the same forward: under
    ZeRO-3 and FSDP the parameters are gathered by the processes together (before `prepare` a ZeRO-3 model holds none).
    """
    module = accelerator.unwrap_model(model, keep_torch_compile=False)
    ids = (torch.arange(1, 9, device=accelerator.device) % module.config.vocab_size).unsqueeze(0)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]], device=accelerator.device)
    module.eval()
    with torch.compiler.set_stance("force_eager"):  # nothing compiled for the two probe shapes
        alone = module(input_ids=ids[:, 4:], use_cache=False).logits.float()
        packed = module(input_ids=ids, position_ids=positions, use_cache=False).logits[:, 4:].float()
    module.train()
    # Relative to the spread of the logits; examples that attend to each other differ by O(1) (measured: 1.2-1.6).
    difference = ((alone - packed).abs().max() / (alone - alone.mean(-1, keepdim=True)).abs().max()).item()
    tolerance = 1e-3 if accelerator.mixed_precision == "no" else 3e-2  # bf16/fp16 rounding, also DeepSpeed's
    if not difference <= tolerance:
        fail_on_every_rank(accelerator, f"--packing: {type(module).__name__} with attn_implementation="
                           f"{attention_implementation(module.config)} lets packed examples attend to each other "
                           f"(logits differ by {difference:.2g}); use --attn_implementation flash_attention_2 or "
                           "drop --packing")


if __name__ == "__main__":
    main = record_exit_status(main)  # feature: exit status
    main()
