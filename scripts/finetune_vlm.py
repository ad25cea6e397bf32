#!/usr/bin/env python
"""Vision-language fine-tuning with Accelerate: images and text in, the loss on the assistant's answers only.

    accelerate launch scripts/finetune_vlm.py                      # the embedded default: shapes drawn here, tiny VLM
    accelerate launch scripts/finetune_vlm.py --model_name_or_path Qwen/Qwen2.5-VL-3B-Instruct \\
        --train_file receipts.jsonl --bf16 --freeze_vision_tower --gradient_checkpointing

Models: any `AutoModelForImageTextToText` with its `AutoProcessor` (LLaVA-style, Qwen2-VL-style, Idefics3/SmolVLM;
Qwen2-VL's processor needs torchvision, not pinned: docs/vlm.md).
Data: TRL's formats (jsonl/csv/parquet or a hub dataset): a `messages` column of chat turns whose content lists hold
`{"type": "image"}` placeholders and an `images` column (paths relative to the data file, bytes, or Image features),
or prompt/completion rows with images. Images are decoded and processed in the data loader's workers; labels are
the assistant tokens only, never an image or vision token. Without data, the default task is built here: questions
about shapes drawn with Pillow, and a tiny LLaVA-style model around the README pipeline's pretrained Llama
(outputs/pretrain) when it exists. Held-out answer accuracy is reported before and after training (docs/vlm.md).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from accelerate.logging import get_logger
from datasets import Image, List
from torch.utils.data import DataLoader
from transformers import AutoModelForImageTextToText

from common.accumulation import backward_loss, check_loss_honours_num_items, count_label_tokens
from common.checkpoint import CheckpointExtras, find_checkpoint_to_resume, save_checkpoint
from common.errors import fail
from common.export import export_model
from common.flags import ArgumentParser, add_data_args, add_model_args, add_training_args, check_common_flags
from common.guard import DIVERGED_STATUS, STOPPED_STATUS, Verdict
from common.inputs import from_pretrained_or_fail
from common.inputs.batching import EpochLengthGroupedSampler, pad_to_multiple_of
from common.inputs.data import HeldOut, Source, check_data_files, load_raw_datasets
from common.inputs.images import (ImageTextCollator, as_messages, check_processor, check_takes_images,
                                  evaluate_image_text, image_problem, load_processor, row_cutting_an_image,
                                  sample_answer, tokenize_image_rows, vision_token_ids)
from common.inputs.modeling import (add_finetuning_args, check_finetuning_flags, count_parameters,
                                    enable_gradient_checkpointing, load_finetuning_config)
from common.inputs.responses import naming_the_failing_row, rows_of
from common.inputs.shapes import build_shapes_task, build_tiny_vlm
from common.inputs.vision_models import fit_engines, freeze_vision_parts, language_model_linears, shard_units
from common.lifecycle import RunLifecycle, finish
from common.optim import create_optimizer_and_scheduler
from common.runtime import build_accelerator
from common.steps import count_optimizer_steps, optimizer_step_windows
from common.features.async_checkpoint import (add_async_checkpoint_args, save_in_background,
                                              wait_for_checkpoint)  # feature: async checkpoint
from common.features.checksums import record_files, verify_checkpoint  # feature: checksums
from common.features.compile import add_compile_args, check_compile_flags, compile_counts, compile_model  # feature: torch compile
from common.features.cpu_threads import use_all_cores  # feature: cpu threads
from common.features.deepspeed_check import check_deepspeed_config  # feature: deepspeed check
from common.features.divergence import (NonFiniteGuard, add_divergence_args, check_divergence_flags,
                                        export_if_finite, finite_weights)  # feature: divergence guard
from common.features.disk import explain_full_disk, stop_if_disk_full, stop_on_full_disk  # feature: full disk
from common.features.exit_status import record_exit_status  # feature: exit status
from common.features.folder_lock import lock_output_dir  # feature: folder lock
from common.features.fsdp_on_cpu import use_fsdp2_on_cpu  # feature: fsdp2 on cpu
from common.features.lora import (add_adapter, add_peft_args, base_model_kwargs, check_adapter_targets,
                                  check_peft_flags, export_adapter, export_and_merge,
                                  frozen_base_left_out)  # feature: lora
from common.features.preemption import announce_stop, catch_stop_signals, stop_when_launcher_dies  # feature: preemption
from common.features.resume_guard import RunRecord  # feature: resume guard

logger = get_logger(__name__)
DATA_FLAGS = ("prompt_column", "completion_column", "messages_column", "images_column")  # a resume keeps them
PRETRAINED_LANGUAGE_MODEL = "outputs/pretrain"  # the README pipeline's first step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_data_args(parser)
    add_training_args(parser)
    add_divergence_args(parser)  # feature: divergence guard
    add_compile_args(parser)  # feature: torch compile
    add_async_checkpoint_args(parser)  # feature: async checkpoint
    add_finetuning_args(parser)
    add_peft_args(parser)  # feature: lora
    parser.set_defaults(learning_rate=2e-5, weight_decay=0.0, adam_beta2=0.999, attn_implementation=None)
    g = parser.add_argument_group("vision-language fine-tuning")
    g.add_argument("--messages_column", default="messages", help="Chat turns with content parts, used if present.")
    g.add_argument("--prompt_column", default="prompt", help="Prompt (text or turns) of prompt/completion rows.")
    g.add_argument("--completion_column", default="completion", help="Completion of prompt/completion rows.")
    g.add_argument("--images_column", default="images", help="The row's images (paths, bytes or Image features).")
    g.add_argument("--chat_template", help="A Jinja chat template file, for a processor that has none.")
    g.add_argument("--freeze_vision_tower", action="store_true",
                   help="Do not train the vision encoder (its projector still trains unless --freeze_projector).")
    g.add_argument("--freeze_projector", action="store_true",
                   help="Do not train the projector between the vision encoder and the language model.")
    args = parser.parse_args(argv)
    if args.model_name_or_path is None and not (args.train_file or args.dataset_name):
        args.model_name_or_path = ""  # the embedded default: the tiny VLM is built once the cache is known
    if args.model_name_or_path == "":
        check_common_flags(args)
    else:
        check_finetuning_flags(args)
    check_data_files(args.train_file, args.validation_file)
    check_divergence_flags(args)  # feature: divergence guard
    check_compile_flags(args)  # feature: torch compile
    check_peft_flags(args)  # feature: lora
    if args.chat_template and not os.path.isfile(args.chat_template):
        fail(f"--chat_template {args.chat_template}: no such file")
    if args.freeze_embeddings or args.freeze_layers:
        fail("--freeze_embeddings/--freeze_layers are for text models here; use --freeze_vision_tower, "
             "--freeze_projector or --use_peft")
    return args


def main() -> None:
    args = parse_args()
    if args.model_name_or_path == "":  # the default task's model: built (or found) in the cache
        language_model = PRETRAINED_LANGUAGE_MODEL if os.path.isfile(
            os.path.join(PRETRAINED_LANGUAGE_MODEL, "config.json")) else None
        args.model_name_or_path = build_tiny_vlm(args.cache_dir, language_model)
    config = load_finetuning_config(args)  # cheap: checks the flags against the model before any heavy work
    check_takes_images(config)
    processor = load_processor(args.tokenizer_name or args.model_name_or_path,
                               "--tokenizer_name" if args.tokenizer_name else "--model_name_or_path")
    check_processor(processor)
    if args.chat_template:
        with open(args.chat_template, encoding="utf-8") as f:
            processor.chat_template = f.read()
    if not processor.chat_template:
        fail("the processor has no chat template: pass --chat_template FILE")
    if args.use_peft and args.lora_target_modules == ["all-linear"]:  # feature: lora
        args.lora_target_modules = language_model_linears(config)  # the language model's, not the vision tower's
    if args.use_peft:  # feature: lora
        check_adapter_targets(args, config, AutoModelForImageTextToText, "CAUSAL_LM")
    check_deepspeed_config(args)  # feature: deepspeed check
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
    training = train
    training = stop_on_full_disk(training, args.output_dir, extras)  # feature: full disk
    status = training(args, config, processor, accelerator, resume_from, extras)
    wait_for_checkpoint(extras)  # feature: async checkpoint
    finish(accelerator)
    sys.exit(status)


def data_folders(args) -> dict[str, str]:
    """Where each split's relative image paths start: the folder of its data file (or of a local dataset)."""
    if args.dataset_name:
        folder = args.dataset_name if os.path.isdir(args.dataset_name) else ""
        return {"train": folder, "validation": folder}
    return {"train": os.path.dirname(os.path.abspath(args.train_file)),
            "validation": os.path.dirname(os.path.abspath(args.validation_file or args.train_file))}


def find_unusable_row(raw, args) -> tuple[str, int, str] | None:
    """The first row (split, index, problem) that cannot give an example (common/inputs/images.py:image_problem)."""
    names = raw["train"].column_names
    columns = [c for c in (args.messages_column, args.prompt_column, args.completion_column, args.images_column,
                           "image") if c in names]
    if args.messages_column not in names and not {args.prompt_column, args.completion_column} <= set(names):
        fail(f"the train split has neither a '{args.messages_column}' column nor '{args.prompt_column}' and "
             f"'{args.completion_column}' (columns: {', '.join(raw['train'].column_names)})")
    folders = data_folders(args)
    for split, index, values in rows_of(raw, columns, args):
        problem = image_problem(dict(zip(columns, values)), args, folders[split])
        if problem:
            return split, index, problem
    return None


def load_image_text_data(args, accelerator, processor, config):
    """Rows -> rendered text, token ids with assistant labels, image references, lengths (no pixels decoded)."""
    if not args.train_file and not args.dataset_name:
        with accelerator.main_process_first():
            args.train_file, args.validation_file = build_shapes_task(args.cache_dir)
    raw = load_raw_datasets(Source.from_flags(args), HeldOut.from_flags(args), args.cache_dir, columns={},
                            check_rows=partial(find_unusable_row, args=args))
    for split in raw:
        feature = raw[split].features.get(args.images_column)
        if isinstance(feature, Image) or isinstance(getattr(feature, "feature", None), Image):
            raw[split] = raw[split].cast_column(args.images_column, List(Image(decode=False)) if
                                                isinstance(feature, List) else Image(decode=False))
    folders = data_folders(args)
    with accelerator.main_process_first(), naming_the_failing_row(args, [args.messages_column]):
        data = {split: raw[split].map(tokenize_image_rows, batched=True, num_proc=args.preprocessing_num_workers,
                                      fn_kwargs=dict(processor=processor, columns=args, folder=folders[split]),
                                      remove_columns=raw[split].column_names, desc="Tokenizing")
                for split in ("train", "validation")}
    vision_ids = vision_token_ids(processor, config)
    for split in ("train", "validation"):
        found = row_cutting_an_image(data[split], args.max_seq_length, vision_ids) if args.max_seq_length else None
        if found:
            fail(f"{split} row {found[0] + 1} is {found[1]} tokens with its images: --max_seq_length "
                 f"{args.max_seq_length} would cut inside an image's tokens; raise it or shorten the row")
    logger.info(f"{len(data['train'])} training rows, {sum(map(len, data['train']['images']))} images")
    return data, vision_ids


def build_dataloaders(args, accelerator, processor, data, vision_ids):
    """Padded batches of decoded, processed images and their text, optionally grouped by length."""
    # With more than one process, a batch without images runs the encoder on a blank one (ZeRO and FSDP need it)
    collate = ImageTextCollator(processor, vision_ids, args.max_seq_length, pad_to_multiple_of(accelerator),
                                vision_in_every_batch=accelerator.num_processes > 1)
    sampler = None
    if args.group_by_length:
        sampler = EpochLengthGroupedSampler(data["train"]["length"], args.per_device_train_batch_size, args.seed)
    loader_kwargs = dict(num_workers=args.dataloader_num_workers, collate_fn=collate,
                         pin_memory=args.dataloader_pin_memory and torch.cuda.is_available())
    # Its own generator: a resumed run draws the uninterrupted run's dropout masks (scripts/pretrain_llama.py)
    train_dataloader = DataLoader(data["train"], sampler=sampler, shuffle=sampler is None,
                                  batch_size=args.per_device_train_batch_size, generator=torch.Generator(),
                                  **loader_kwargs)
    eval_dataloader = DataLoader(data["validation"], batch_size=args.per_device_eval_batch_size, **loader_kwargs)
    return train_dataloader, eval_dataloader


def exporter(args):
    """How the trained model is written with its processor (common/export.py; the features wrap or replace it)."""
    export = export_model
    if args.use_peft:  # feature: lora
        export = export_adapter  # the adapter alone, in peft's format
    if args.use_peft and args.merge_adapter:  # feature: lora
        export = export_and_merge(AutoModelForImageTextToText, args.model_name_or_path)  # the adapter, then merged/
    export = explain_full_disk(export)  # feature: full disk
    export = export_if_finite(export)  # feature: divergence guard
    return export


def train(args, config, processor, accelerator, resume_from: str | None, extras: CheckpointExtras) -> int:
    """The whole run; returns the exit status (see scripts/pretrain_llama.py, whose loop this one follows)."""
    record = RunRecord(args, "finetune_vlm", accelerator, config, DATA_FLAGS, resume_from)  # feature: resume guard
    extras.write, extras.check, extras.keep = record.write, record.check, record.keep  # feature: resume guard
    lock_output_dir(args.output_dir, accelerator.is_main_process)  # feature: folder lock
    run = RunLifecycle(accelerator, args.output_dir, args.overwrite_output_dir, resume_from, extras)
    ga = args.gradient_accumulation_steps
    data, vision_ids = load_image_text_data(args, accelerator, processor, config)
    train_dataloader, eval_dataloader = build_dataloaders(args, accelerator, processor, data, vision_ids)
    dp = accelerator.num_processes
    steps_per_epoch, total_steps = count_optimizer_steps(train_dataloader, ga, dp, args.max_steps,
                                                         args.num_train_epochs)
    record.add_data(processor.tokenizer, steps_per_epoch)  # feature: resume guard
    # ---- model (with --use_peft: a frozen base and a LoRA adapter on the language model), optimizer, schedule -------
    model = build_model(args, config, accelerator)
    trainable, total_params = count_parameters(model)
    optimizer, lr_scheduler = create_optimizer_and_scheduler(args, model, accelerator, total_steps)
    fit_engines(accelerator, model)  # DeepSpeed's bucket sizes, FSDP2's shard units, DDP's unused parameters
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    if accelerator.is_fsdp2:
        logger.info(f"FSDP2 shard units: {shard_units(model)}")
    check_loss_honours_num_items(model, accelerator)
    progress, log, guard = run.start(total_steps, steps_per_epoch, args.logging_steps,
                                     trackers=("finetune_vlm", vars(args)))
    logger.info(f"Model: {total_params / 1e6:.2f}M parameters, {trainable / 1e6:.2f}M trainable "
                f"({100 * trainable / total_params:.1f}%); {steps_per_epoch} optimizer steps per epoch, {total_steps} "
                f"in all; global batch {args.per_device_train_batch_size * ga * dp} rows")
    before = evaluate_image_text(model, eval_dataloader, accelerator) if progress.step == 0 else None
    # ---- training loop: the loss is the mean over all answer tokens of the step -------------------------------------
    guard = NonFiniteGuard(accelerator, progress, args.max_nonfinite_steps)  # feature: divergence guard
    guard.stop_signalled = catch_stop_signals()  # feature: preemption
    train_start, start_step = time.perf_counter(), progress.step
    model.train()
    for window in optimizer_step_windows(train_dataloader, progress, steps_per_epoch, total_steps, ga):
        num_items = count_label_tokens(window, accelerator)  # answer tokens in the window, all processes
        window_loss = torch.zeros((), device=accelerator.device)
        for batch in window:
            with accelerator.accumulate(model):
                outputs = model(**batch, num_items_in_batch=num_items, use_cache=False)
                loss, token_loss = backward_loss(outputs, accelerator)
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
                eval_metrics = evaluate_image_text(model, eval_dataloader, accelerator)
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
    # ---- final evaluation (answer loss and accuracy), export, and one answer from the reloaded export ---------------
    eval_metrics = evaluate_image_text(model, eval_dataloader, accelerator)
    log.write_eval(progress.step, eval_metrics)
    if not exporter(args)(accelerator, model, processor, args.output_dir):
        return DIVERGED_STATUS
    rows_seen = (progress.step - start_step) * args.per_device_train_batch_size * ga * dp
    results = {**eval_metrics, "train_steps": progress.step, "train_runtime": train_runtime,
               "padding_fraction": log.padding_fraction, "num_parameters": total_params,
               "trainable_parameters": trainable, "train_examples": len(data["train"]),
               **accuracy_and_image_rate(data, before, eval_metrics, rows_seen, train_runtime)}
    results.update(compile_counts() if args.torch_compile else {})  # feature: torch compile
    log.write_results(results)
    show_sample_answer(args, accelerator)
    return 0


def accuracy_and_image_rate(data, before: dict | None, after: dict, rows_seen: int, seconds: float) -> dict:
    """Images per second of training (the rows' mean image count), and the held-out accuracy before training."""
    images_per_row = sum(map(len, data["train"]["images"])) / len(data["train"])
    figures = {"images_per_second": images_per_row * rows_seen / max(seconds, 1e-9)}
    if before is not None:  # a resumed run did not see the model before training
        figures["eval_accuracy_before"] = before["eval_accuracy"]
        logger.info(f"held-out answer accuracy: {before['eval_accuracy']:.3f} before, {after['eval_accuracy']:.3f} "
                    "after training")
    return figures


def build_model(args, config, accelerator):
    """The pretrained VLM, frozen as flagged; with --use_peft a frozen base and a LoRA adapter on its language model."""
    load_kwargs = {"dtype": torch.float32}  # fp32 weights: mixed precision autocasts them
    if args.use_peft:  # feature: lora
        load_kwargs = base_model_kwargs(args, accelerator, "CAUSAL_LM")  # a 16-bit (or 4-bit) frozen base
    model = from_pretrained_or_fail(partial(AutoModelForImageTextToText.from_pretrained, config=config,
                                            attn_implementation=args.attn_implementation, **load_kwargs),
                                    args.model_name_or_path, "--model_name_or_path")
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    freeze_vision_parts(model, args.freeze_vision_tower, args.freeze_projector)
    if args.use_peft:  # feature: lora
        model = add_adapter(args, accelerator, model, "CAUSAL_LM")
    if args.torch_compile:  # feature: torch compile
        compile_model(model, args.torch_compile_whole_model, args.torch_compile_backend, args.torch_compile_mode,
                      lengths_vary=True)
    return model


def show_sample_answer(args, accelerator) -> None:
    """The export, reloaded with the Auto classes, answers the first held-out row (the main process only)."""
    if not accelerator.is_main_process:
        return
    folder = args.output_dir
    if args.use_peft:  # feature: lora
        folder = os.path.join(args.output_dir, "merged") if args.merge_adapter else None  # the adapter: with peft
    if folder is None:  # feature: lora
        return  # feature: lora
    raw = load_raw_datasets(Source.from_flags(args), HeldOut.from_flags(args), args.cache_dir, columns={})
    row = raw["validation"][0]
    question, answer, reference = sample_answer(folder, row, args, data_folders(args)["validation"])
    logger.info(f"sample answer of the reloaded export: {question!r} -> {answer!r} (reference: {reference!r})")


if __name__ == "__main__":
    main = record_exit_status(main)  # feature: exit status
    main()
