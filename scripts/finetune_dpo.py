#!/usr/bin/env python
"""Preference training of a causal LM with DPO (Direct Preference Optimization), with Accelerate.

    accelerate launch scripts/finetune_dpo.py --model_name_or_path outputs/docstring-to-body   # the SFT export
    accelerate launch scripts/finetune_dpo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --train_file pairs.jsonl --bf16 --use_peft --precompute_ref_log_probs

Data: jsonl/csv/parquet or a hub dataset with `prompt`, `chosen` and `rejected` columns: plain strings (each response
gets an EOS), or lists of chat turns rendered with the tokenizer's chat template (the prompt's turns, then each
response's). Prompt tokens are the prompt's alone; a response's tokens follow them unchanged. Without data, the
default task is built from this Python's standard library: prompt = a function's signature and docstring, chosen =
its body, rejected = the body cut short.

Loss (TRL's definitions, `--loss_type`): with the log-probabilities of the response tokens summed per sequence, under
the policy (pi) and the frozen reference (ref), delta = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected);
sigmoid: -log sigmoid(beta delta); hinge: relu(1 - beta delta); ipo: (delta' - 1 / (2 beta))^2, delta' from per-token
averages. Chosen and rejected rows go through the model in one forward (chosen rows first). The loss of an optimizer
step is the mean over all its pairs, on all processes and micro-batches: each micro-batch's pair-loss sum is divided
by the window's pair count (common/accumulation.py's mechanism, with pairs for tokens).

Reference: a second copy of the pretrained model, frozen, in eval mode, on the run's engine; with --use_peft the
policy itself with its adapter disabled; with --precompute_ref_log_probs its log-probabilities computed once before
training (a checksummed --cache_dir entry keyed by content: common/features/reference.py) and the reference freed.
Dropout is off in both models unless --keep_dropout. Pairs are read, checked and collated in common/inputs/pairs.py.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, tqdm
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM
from transformers.modeling_outputs import ModelOutput

from common.accumulation import backward_loss
from common.checkpoint import CheckpointExtras, find_checkpoint_to_resume, save_checkpoint
from common.errors import fail
from common.export import export_model
from common.flags import ArgumentParser, add_data_args, add_model_args, add_training_args
from common.guard import DIVERGED_STATUS, STOPPED_STATUS, Verdict
from common.inputs.batching import EpochLengthGroupedSampler, pad_to_multiple_of
from common.inputs.data import check_data_files
from common.inputs.modeling import (add_finetuning_args, build_causal_lm, check_finetuning_flags, count_parameters,
                                    freeze_parameters, load_finetuning_config)
from common.inputs.pairs import PairCollator, check_chat_template, load_preference_data
from common.inputs.policy import disable_dropout, frozen_copy, reference_forward, sequence_logps
from common.lifecycle import RunLifecycle, finish
from common.optim import create_optimizer_and_scheduler
from common.runtime import build_accelerator
from common.steps import count_optimizer_steps, optimizer_step_windows
from common.features.async_checkpoint import (add_async_checkpoint_args, save_in_background,
                                              wait_for_checkpoint)  # feature: async checkpoint
from common.features.checksums import record_files, verify_checkpoint  # feature: checksums
from common.features.chunked_loss import (add_chunked_loss_args, check_chunked_loss, use_chunked_loss)  # feature: chunked loss
from common.features.compile import (add_compile_args, check_compile_flags, compile_counts,
                                     compile_model)  # feature: torch compile
from common.features.cpu_threads import use_all_cores  # feature: cpu threads
from common.features.deepspeed_check import check_deepspeed_config  # feature: deepspeed check
from common.features.reference import precompute_reference  # feature: precomputed reference
from common.features.reference import shard_reference  # feature: sharded reference
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
from common.features.tensor_parallel import refuse_tensor_parallel  # feature: tensor parallel

logger = get_logger(__name__)
DATA_FLAGS = ("prompt_column", "chosen_column", "rejected_column", "max_seq_length")  # a resume keeps them
LOSS_TYPES = ("sigmoid", "ipo", "hinge")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_data_args(parser)
    add_training_args(parser)
    add_divergence_args(parser)  # feature: divergence guard
    add_compile_args(parser)  # feature: torch compile
    add_chunked_loss_args(parser)  # feature: chunked loss
    add_liger_args(parser)  # feature: liger kernel
    add_async_checkpoint_args(parser)  # feature: async checkpoint
    add_finetuning_args(parser)
    add_peft_args(parser)  # feature: lora
    parser.set_defaults(learning_rate=1e-6, weight_decay=0.0, adam_beta2=0.999, attn_implementation=None)
    g = parser.add_argument_group("preference training (DPO)")
    g.add_argument("--prompt_column", default="prompt", help="Column holding the prompt (text or chat turns).")
    g.add_argument("--chosen_column", default="chosen", help="Column holding the preferred response.")
    g.add_argument("--rejected_column", default="rejected", help="Column holding the dispreferred response.")
    g.add_argument("--chat_template", help="A Jinja chat template file, for a tokenizer that has none.")
    g.add_argument("--beta", type=float, default=0.1, help="How far from the reference the policy may move.")
    g.add_argument("--loss_type", default="sigmoid", choices=LOSS_TYPES, help="DPO's loss, or IPO's, or a hinge.")
    g.add_argument("--precompute_ref_log_probs", action="store_true",  # feature: precomputed reference
                   help="Compute the reference's log-probabilities once before training, then free the reference.")
    g.add_argument("--keep_dropout", action="store_true",
                   help="Keep the model's dropout in the policy (off by default, as in TRL; the reference never has it).")
    args = parser.parse_args(argv)
    check_finetuning_flags(args)
    check_data_files(args.train_file, args.validation_file)
    check_divergence_flags(args)  # feature: divergence guard
    check_compile_flags(args)  # feature: torch compile
    check_peft_flags(args)  # feature: lora
    if not 0 < args.beta < math.inf:
        fail(f"--beta must be a finite number > 0 (got {args.beta})")
    if args.chat_template:
        check_chat_template(args.chat_template)
    return args


def main() -> None:
    args = parse_args()
    config = load_finetuning_config(args)  # cheap: checks the flags against the model before any heavy work
    if args.use_peft:  # feature: lora
        check_adapter_targets(args, config, AutoModelForCausalLM, "CAUSAL_LM")
    if args.chunked_cross_entropy:  # feature: chunked loss
        check_chunked_loss(config)
    if args.use_liger_kernel:  # feature: liger kernel
        check_liger_kernel(config, fused_loss=False)  # per-row log-probabilities: rope, RMSNorm, SwiGLU only
    check_deepspeed_config(args)  # feature: deepspeed check
    refuse_sequence_parallel("finetune_dpo.py")  # feature: sequence parallel
    refuse_tensor_parallel("finetune_dpo.py")  # feature: tensor parallel
    stop_when_launcher_dies()  # feature: preemption
    use_all_cores()  # feature: cpu threads
    accelerator = build_accelerator(args)
    use_fsdp2_on_cpu(accelerator)  # feature: fsdp2 on cpu
    extras = CheckpointExtras()
    extras.save = save_in_background(args, accelerator)  # feature: async checkpoint
    extras.record_files, extras.verify = record_files, verify_checkpoint  # feature: checksums
    extras.explain_failed_save = stop_if_disk_full  # feature: full disk
    extras.can_save = finite_weights  # feature: divergence guard
    extras.state_kwargs = partial(frozen_base_left_out, accelerator)  # feature: lora
    resume_from = find_checkpoint_to_resume(args.output_dir, args.resume_from_checkpoint, accelerator, extras.verify)
    training = train
    training = stop_on_full_disk(training, args.output_dir, extras)  # feature: full disk
    status = training(args, config, accelerator, resume_from, extras)
    wait_for_checkpoint(extras)  # feature: async checkpoint
    finish(accelerator)
    sys.exit(status)


def build_dataloaders(args, accelerator, tokenizer, data):
    """Batches of pairs (2B rows each), optionally grouped by length; both loaders share one collator per split so
    that precomputed reference values reach them."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    collators = {split: PairCollator(pad_id, pad_to_multiple_of(accelerator)) for split in ("train", "validation")}
    sampler = None
    if args.group_by_length:
        sampler = EpochLengthGroupedSampler(data["train"]["length"], args.per_device_train_batch_size, args.seed)
        data["validation"] = data["validation"].sort("length")
    data = data.remove_columns("length")
    loader_kwargs = dict(num_workers=args.dataloader_num_workers,
                         pin_memory=args.dataloader_pin_memory and torch.cuda.is_available())
    train_dataloader = DataLoader(data["train"], sampler=sampler, shuffle=sampler is None,
                                  batch_size=args.per_device_train_batch_size, collate_fn=collators["train"],
                                  generator=torch.Generator(), **loader_kwargs)
    eval_dataloader = DataLoader(data["validation"], batch_size=args.per_device_eval_batch_size,
                                 collate_fn=collators["validation"], **loader_kwargs)
    return train_dataloader, eval_dataloader, collators


# ---- the loss: sequence log-probabilities (common/inputs/policy.py), the reference, DPO / IPO / hinge ------------
def chunked_head(args) -> bool:
    """--chunked_cross_entropy (absent from a copy without that feature)."""
    return getattr(args, "chunked_cross_entropy", False)


def pair_losses(policy: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor, beta: float, loss_type: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss of each pair, each row's reward beta * (pi - ref)); rows are the B chosen, then the B rejected."""
    ratios = policy - reference
    if loss_type == "ipo":  # per-token averages (TRL: confirmed with the IPO authors)
        ratios = ratios / counts.clamp(min=1)
    chosen, rejected = ratios.chunk(2)
    delta = chosen - rejected
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    else:
        losses = (delta - 1 / (2 * beta)) ** 2
    return losses, beta * (policy - reference).detach()


def pair_figures(losses: torch.Tensor, rewards: torch.Tensor, policy: torch.Tensor) -> torch.Tensor:
    """Per pair: loss and METRICS' figures (TRL's: accuracy when the chosen reward is strictly greater)."""
    chosen, rejected = rewards.chunk(2)
    logps_chosen, logps_rejected = policy.detach().chunk(2)
    return torch.stack([losses.detach(), chosen, rejected, (chosen > rejected).float(), chosen - rejected,
                        logps_chosen, logps_rejected], dim=1)


def dpo_forward(model, reference_logps, batch: dict, args, num_items: torch.Tensor) -> ModelOutput:
    """One micro-batch: `loss` = its pairs' loss sum / `num_items` (the window's pair count on all processes), so
    `backward_loss` scales it as the token losses of the other recipes; `figures`: per pair, for the metrics."""
    policy, counts = sequence_logps(model, batch, chunked_head(args))
    with torch.no_grad():
        reference = batch["ref_logps"] if "ref_logps" in batch else reference_logps(batch)
    losses, rewards = pair_losses(policy, reference.float(), counts, args.beta, args.loss_type)
    return ModelOutput(loss=losses.sum() / num_items, figures=pair_figures(losses, rewards, policy))


def count_pairs(window: list[dict], accelerator) -> torch.Tensor:
    """The pairs of the window on all processes (a batch's rows are its pairs' chosen and rejected)."""
    local = sum(batch["input_ids"].shape[0] // 2 for batch in window)
    return accelerator.reduce(torch.tensor(local, device=accelerator.device), reduction="sum")


class PairMetrics:
    """The METRICS of the pairs since the last logged row, summed on the device (read only when a row is written:
    `row()` is the step log's `row_extras`, collective)."""

    def __init__(self, accelerator) -> None:
        self.accelerator = accelerator
        self.sums = torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=accelerator.device)

    def add(self, outputs: ModelOutput) -> None:
        figures = outputs.figures.double()
        self.sums += torch.cat([figures[:, 1:].sum(0), figures.new_tensor([figures.shape[0]])])

    def row(self) -> dict:
        *sums, pairs = self.accelerator.reduce(self.sums, "sum").tolist()
        self.sums.zero_()
        return {name: total / max(pairs, 1) for name, total in zip(METRICS, sums)}


@torch.no_grad()
def evaluate_dpo(model, reference_logps, dataloader, accelerator, args) -> dict[str, float]:
    """The loss and METRICS over the whole eval set, each pair once (`gather_for_metrics`), for any process count."""
    model.eval()
    sums = torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=accelerator.device)
    pairs = 0
    for batch in tqdm(dataloader, desc="eval", leave=False):
        outputs = dpo_forward(model, reference_logps, batch, args, torch.ones((), device=accelerator.device))
        figures = accelerator.gather_for_metrics(outputs.figures)
        sums += figures.double().sum(0)
        pairs += figures.shape[0]
    model.train()
    means = (sums / max(pairs, 1)).tolist()
    return {"eval_loss": means[0], **{f"eval_{name}": value for name, value in zip(METRICS, means[1:])},
            "eval_pairs": pairs}


# ---- the reference: a frozen copy on the run's engine, the disabled adapter, or values computed once ----------------
def build_reference(args, config, accelerator, model, vocab_size: int, data, collators):
    """After `prepare`: batch -> the reference's log-probabilities (`reference_forward`); None with
    --precompute_ref_log_probs, whose values then travel with the batches and whose reference is freed."""
    reference, chunked = load_reference(args, config, accelerator, vocab_size), chunked_head(args)
    forward = reference_forward(accelerator, model, reference, lambda m, batch: sequence_logps(m, batch, chunked)[0])
    if args.precompute_ref_log_probs:  # feature: precomputed reference
        precompute_reference(args, accelerator, config, forward, data, collators)
        del reference, forward
        gc.collect()
        return None
    return forward


def load_reference(args, config, accelerator, vocab_size: int):
    """The frozen copy of the pretrained model (common/inputs/policy.py), placed as the engine needs; None with
    --use_peft (the policy with its adapter disabled is the reference)."""
    if args.use_peft:  # feature: lora
        return None
    reference = frozen_copy(args, config, vocab_size)
    if args.use_liger_kernel:  # feature: liger kernel
        use_liger_kernel(reference, fused_loss=False)  # the policy's kernels: step 1's log-probabilities are equal
    if args.chunked_cross_entropy:  # feature: chunked loss
        use_chunked_loss(reference)
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):  # feature: sharded reference
        return shard_reference(accelerator, reference)
    return reference.to(accelerator.device)


def train(args, config, accelerator, resume_from: str | None, extras: CheckpointExtras) -> int:
    """The whole run; returns the exit status (see scripts/pretrain_llama.py, whose loop this one follows)."""
    record = RunRecord(args, "finetune_dpo", accelerator, config, DATA_FLAGS, resume_from)  # feature: resume guard
    extras.write, extras.check, extras.keep = record.write, record.check, record.keep  # feature: resume guard
    lock_output_dir(args.output_dir, accelerator.is_main_process)  # feature: folder lock
    run = RunLifecycle(accelerator, args.output_dir, args.overwrite_output_dir, resume_from, extras)
    ga = args.gradient_accumulation_steps
    tokenizer, data = load_preference_data(args, accelerator, config, resume_from)
    train_dataloader, eval_dataloader, collators = build_dataloaders(args, accelerator, tokenizer, data)
    steps_per_epoch, total_steps = count_optimizer_steps(train_dataloader, ga, accelerator.num_processes,
                                                         args.max_steps, args.num_train_epochs, unit="pairs")
    record.add_data(tokenizer, steps_per_epoch)  # feature: resume guard

    # ---- policy (with --use_peft: a frozen base and a LoRA adapter), reference, optimizer, schedule ----------------
    model = build_model(args, config, accelerator, len(tokenizer))
    trainable, total_params = count_parameters(model)
    optimizer, lr_scheduler = create_optimizer_and_scheduler(args, model, accelerator, total_steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    reference_logps = build_reference(args, config, accelerator, model, len(tokenizer), data, collators)
    progress, log, guard = run.start(total_steps, steps_per_epoch, args.logging_steps,
                                     trackers=("finetune_dpo", vars(args)))
    rewards = PairMetrics(accelerator)
    log.row_extras = rewards.row
    log.carry(rewards.sums)  # a resumed run's first row counts the pairs before the checkpoint
    logger.info(f"Model: {total_params / 1e6:.2f}M parameters, {trainable / 1e6:.2f}M trainable; reference "
                f"{'live' if reference_logps else 'precomputed'}; "
                f"{steps_per_epoch} optimizer steps per epoch, {total_steps} in all; global batch "
                f"{args.per_device_train_batch_size * ga * accelerator.num_processes} pairs")

    # ---- training loop: the loss is the mean over all pairs of the step ----------------------------------------------
    guard = NonFiniteGuard(accelerator, progress, args.max_nonfinite_steps)  # feature: divergence guard
    guard.stop_signalled = catch_stop_signals()  # feature: preemption
    train_start = time.perf_counter()
    model.train()
    for window in optimizer_step_windows(train_dataloader, progress, steps_per_epoch, total_steps, ga):
        num_items = count_pairs(window, accelerator)  # pairs in the window, all processes
        window_loss = torch.zeros((), device=accelerator.device)
        for batch in window:
            with accelerator.accumulate(model):
                outputs = dpo_forward(model, reference_logps, batch, args, num_items)
                loss, pair_loss = backward_loss(outputs, accelerator)
                accelerator.backward(loss)
                window_loss += pair_loss
                rewards.add(outputs)
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
                eval_metrics = evaluate_dpo(model, reference_logps, eval_dataloader, accelerator, args)
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
    # ---- final evaluation (loss and rewards on held-out pairs) and export ------------------------------------------
    eval_metrics = evaluate_dpo(model, reference_logps, eval_dataloader, accelerator, args)
    log.write_eval(progress.step, eval_metrics)
    export = exporter(args)
    if not export(accelerator, model, tokenizer, args.output_dir):
        return DIVERGED_STATUS
    results = {**eval_metrics, "train_steps": progress.step, "train_runtime": train_runtime,
               "padding_fraction": log.padding_fraction, "num_parameters": total_params,
               "trainable_parameters": trainable, "train_pairs": len(data["train"])}
    results.update(compile_counts() if args.torch_compile else {})  # feature: torch compile
    log.write_results(results)
    return 0


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


def build_model(args, config, accelerator, vocab_size: int):
    """The policy: the pretrained model, frozen as flagged, dropout off unless --keep_dropout; with --use_peft a
    frozen (16-bit or 4-bit) base and a LoRA adapter."""
    load_kwargs = {"dtype": torch.float32}  # fp32 weights: mixed precision autocasts them
    if args.use_peft:  # feature: lora
        check_vocab_size(config, vocab_size)
        load_kwargs = base_model_kwargs(args, accelerator, "CAUSAL_LM")  # a 16-bit (or 4-bit) frozen base
    model = build_causal_lm(args, config, vocab_size, **load_kwargs)
    if args.use_liger_kernel:  # feature: liger kernel
        use_liger_kernel(model, fused_loss=False)
    freeze_parameters(model, args.freeze_embeddings, args.freeze_layers)
    if args.chunked_cross_entropy:  # feature: chunked loss
        use_chunked_loss(model)
    if args.use_peft:  # feature: lora
        model = add_adapter(args, accelerator, model, "CAUSAL_LM")
    if not args.keep_dropout:
        disable_dropout(model)
    if args.torch_compile:  # feature: torch compile
        compile_model(model, args.torch_compile_whole_model, args.torch_compile_backend, args.torch_compile_mode,
                      lengths_vary=True)
    return model


if __name__ == "__main__":
    main = record_exit_status(main)  # feature: exit status
    main()
