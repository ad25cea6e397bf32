#!/usr/bin/env python
"""Reinforcement learning of a causal LM from verifiable rewards with GRPO (and DAPO, Dr. GRPO), with Accelerate.

    accelerate launch scripts/finetune_grpo.py --model_name_or_path outputs/docstring-to-body   # the SFT export
    accelerate launch scripts/finetune_grpo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --bf16 \\
        --train_file prompts.jsonl --reward_funcs my_rewards.py:exact_answer --num_generations 8

Each optimizer step: sample G = --num_generations completions of each of its prompts (transformers' `generate`, each
completion from its own noise: common/inputs/sampling.py), score them with the reward functions (called as TRL
calls them: common/inputs/rewards.py), turn the rewards into advantages within each group of G (minus the mean, divided
by the group's or the batch's std), then update the policy with TRL's clipped per-token loss; with
--num_iterations μ the same completions serve μ optimizer steps, their sampling log-probabilities kept.

Data: jsonl/csv/parquet or a hub dataset with a `prompt` column, plain text or chat turns; every other column reaches
the reward functions by name. Without data: the standard library's function signatures and docstrings (the SFT
default task's prompts), rewarded when prompt + completion compiles and when the completion stays a function body.
--per_device_train_batch_size counts completions; a step's prompts are global batch / G. Details: docs/grpo.md.
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
from accelerate.utils import DistributedType, gather_object, tqdm
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM
from transformers.modeling_outputs import ModelOutput

from common.accumulation import backward_loss
from common.checkpoint import CheckpointExtras, find_checkpoint_to_resume, save_checkpoint
from common.errors import fail_on_every_rank
from common.export import export_model
from common.flags import ArgumentParser, add_data_args, add_model_args, add_training_args
from common.guard import DIVERGED_STATUS, STOPPED_STATUS, Verdict
from common.inputs.data import check_data_files
from common.inputs.modeling import (add_finetuning_args, build_causal_lm, check_finetuning_flags, count_parameters,
                                    freeze_parameters, load_finetuning_config)
from common.inputs.policy import disable_dropout, frozen_copy, reference_forward, token_logps
from common.inputs.prompts import GroupSampler, check_grpo_flags, load_prompt_data, true_or_false
from common.inputs.rewards import RewardError, reward_functions
from common.inputs.rollouts import GroupMetrics, group_advantages, training_batch, weighted_sum
from common.inputs.sampling import sample, warpers
from common.lifecycle import RunLifecycle, finish
from common.optim import create_optimizer_and_scheduler
from common.runtime import build_accelerator
from common.steps import count_optimizer_steps, optimizer_step_windows
from common.features.async_checkpoint import (add_async_checkpoint_args, save_in_background,
                                              wait_for_checkpoint)  # feature: async checkpoint
from common.features.checksums import record_files, verify_checkpoint  # feature: checksums
from common.features.compile import (add_compile_args, check_compile_flags, compile_counts,
                                     compile_model)  # feature: torch compile
from common.features.cpu_threads import use_all_cores  # feature: cpu threads
from common.features.deepspeed_check import check_deepspeed_config  # feature: deepspeed check
from common.features.reference import shard_reference  # feature: sharded reference
from common.features.divergence import (NonFiniteGuard, add_divergence_args, check_divergence_flags,
                                        export_if_finite, finite_weights)  # feature: divergence guard
from common.features.disk import explain_full_disk, stop_if_disk_full, stop_on_full_disk  # feature: full disk
from common.features.folder_lock import lock_output_dir  # feature: folder lock
from common.features.fsdp_on_cpu import use_fsdp2_on_cpu  # feature: fsdp2 on cpu
from common.features.liger import add_liger_args, check_liger_kernel, use_liger_kernel  # feature: liger kernel
from common.features.lora import (add_adapter, add_peft_args, base_model_kwargs, check_adapter_targets,
                                  check_peft_flags, check_vocab_size, export_adapter, export_and_merge,
                                  frozen_base_left_out)  # feature: lora
from common.features.preemption import announce_stop, catch_stop_signals, stop_when_launcher_dies  # feature: preemption
from common.features.resume_guard import RunRecord  # feature: resume guard
from common.features.sequence_parallel import refuse_sequence_parallel  # feature: sequence parallel

logger = get_logger(__name__)
DATA_FLAGS = ("prompt_column", "max_seq_length", "num_generations", "max_completion_length")  # a resume keeps them
LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n")[0], conflict_handler="resolve")
    add_model_args(parser)
    add_data_args(parser)
    parser.add_argument("--text_column", default="text", help=argparse.SUPPRESS)  # unused: prompts' --prompt_column
    add_training_args(parser)
    add_divergence_args(parser)  # feature: divergence guard
    add_compile_args(parser)  # feature: torch compile
    add_liger_args(parser)  # feature: liger kernel
    add_async_checkpoint_args(parser)  # feature: async checkpoint
    add_finetuning_args(parser, truncates=False)
    add_peft_args(parser)  # feature: lora
    parser.set_defaults(learning_rate=1e-6, weight_decay=0.0, adam_beta2=0.999, attn_implementation=None)
    g = parser.add_argument_group("reinforcement learning (GRPO)")
    g.add_argument("--prompt_column", default="prompt", help="Column holding the prompt (text or chat turns).")
    g.add_argument("--reward_funcs", nargs="+", help="FILE.py:NAME or package.module:NAME, each called as TRL calls "
                   "it (common/inputs/rewards.py) -> list[float | None] (None: the default task's two rewards).")
    g.add_argument("--reward_weights", nargs="+", type=float, help="One weight per reward function (None: all 1).")
    g.add_argument("--num_generations", type=int, default=8, help="Completions sampled per prompt (G, a group).")
    g.add_argument("--max_completion_length", type=int, default=512, help="Most tokens a completion may have.")
    g.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature (> 0).")
    g.add_argument("--top_p", type=float, default=1.0, help="Nucleus sampling: the smallest set holding this mass.")
    g.add_argument("--top_k", type=int, default=0, help="Sample among the k likeliest tokens (0: all).")
    g.add_argument("--min_p", type=float, default=None, help="Drop tokens below min_p x the likeliest's probability.")
    g.add_argument("--mask_truncated_completions", action="store_true",
                   help="Leave completions that reach --max_completion_length without EOS out of the loss.")
    g.add_argument("--scale_rewards", default="group", choices=("group", "batch", "none"),
                   help="Divide advantages by the group's reward std, the batch's, or nothing (Dr. GRPO).")
    g.add_argument("--loss_type", default="dapo", choices=LOSS_TYPES, help="How token losses are averaged.")
    g.add_argument("--epsilon", type=float, default=0.2, help="Clip the probability ratio below at 1 - epsilon.")
    g.add_argument("--epsilon_high", type=float, default=None, help="... and above at 1 + epsilon_high (= epsilon).")
    g.add_argument("--beta", type=float, default=0.0, help="Weight of the k3 KL to the frozen reference (0: none).")
    g.add_argument("--use_bias_correction_kl", type=true_or_false, nargs="?", const=True, default=True,
                   help="Multiply the k3 KL by the importance ratio (TRL's default; false: the plain k3 KL).")
    g.add_argument("--num_iterations", type=int, default=1, help="Optimizer steps per generated batch (μ).")
    g.add_argument("--keep_dropout", action="store_true", help="Keep the model's dropout, as TRL does by default "
                   "(disable_dropout=False). Off here unless given: a step then equals for any micro-batch cut.")
    args = parser.parse_args(argv)
    check_finetuning_flags(args)
    check_data_files(args.train_file, args.validation_file)
    check_divergence_flags(args)  # feature: divergence guard
    check_compile_flags(args)  # feature: torch compile
    check_peft_flags(args)  # feature: lora
    check_grpo_flags(args)
    args.epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high  # TRL's None: = epsilon
    args.reward_functions = reward_functions(args)
    return args


def main() -> None:
    args = parse_args()
    config = load_finetuning_config(args)  # cheap: checks the flags against the model before any heavy work
    if args.use_peft:  # feature: lora
        check_adapter_targets(args, config, AutoModelForCausalLM, "CAUSAL_LM")
    if args.use_liger_kernel:  # feature: liger kernel
        check_liger_kernel(config, fused_loss=False)  # per-token log-probabilities: rope, RMSNorm, SwiGLU only
    check_deepspeed_config(args)  # feature: deepspeed check
    refuse_sequence_parallel("finetune_grpo.py")  # feature: sequence parallel
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


def build_dataloaders(args, accelerator, data):
    """Batches of completion slots (prompt position, generation index) in GroupSampler's order: an optimizer step's
    micro-batches on all processes hold whole groups. Evaluation: one slot per held-out prompt, each process a share."""
    ga, processes = args.gradient_accumulation_steps, accelerator.num_processes
    prompts_per_step = args.per_device_train_batch_size * ga * processes // args.num_generations
    sampler = GroupSampler(len(data["train"]), args.num_generations, prompts_per_step, args.num_iterations, args.seed)
    rounds = max(1, math.ceil(len(data["validation"]) / (processes * args.per_device_eval_batch_size)))
    eval_batch = max(1, math.ceil(len(data["validation"]) / (processes * rounds)))  # even shares (uneven: a few padded)
    slots = lambda items: [divmod(int(i), args.num_generations) for i in items]  # noqa: E731
    train_dataloader = DataLoader(range(len(data["train"]) * args.num_generations), sampler=sampler,
                                  batch_size=args.per_device_train_batch_size, collate_fn=slots)
    eval_dataloader = DataLoader(range(len(data["validation"])), batch_size=eval_batch,
                                 collate_fn=lambda items: [(int(i), 0) for i in items])
    return train_dataloader, eval_dataloader


# ---- rollouts: sample, score, advantages ---------------------------------------------------------------------------
class Rollouts:
    """Each optimizer step's micro-batches of completions, scored, with advantages; generated at the first step of
    each round of --num_iterations steps and kept for the others (and in checkpoints, so a resume within a round
    trains on the same completions and sampling log-probabilities)."""

    def __init__(self, args, accelerator, tokenizer, raw, data, reference_logps, metrics) -> None:
        self.args, self.accelerator, self.tokenizer, self.raw, self.data = args, accelerator, tokenizer, raw, data
        self.reference_logps, self.metrics, self.kept, self.round = reference_logps, metrics, [], None
        self.problem = None  # a reward function's misuse on this process, said once all processes know
        self.rewards = args.reward_functions  # common/inputs/rewards.py: called as TRL calls them
        self.weights = torch.tensor(args.reward_weights or [1.0] * len(self.rewards.funcs), dtype=torch.float64)
        self.filters = warpers(args.temperature, args.top_k, args.top_p, args.min_p)
        self.synced = accelerator.distributed_type == DistributedType.FSDP or getattr(  # weights gathered per forward
            accelerator.state.deepspeed_plugin, "zero_stage", 0) == 3

    def state_dict(self) -> dict:  # collective: every process's kept batches reach the main process's file
        kept = [{k: v.cpu() if torch.is_tensor(v) else v for k, v in b.items()} for b in self.kept]
        return {"round": self.round, "kept": gather_object([kept])}

    def load_state_dict(self, state: dict) -> None:
        if state["round"] is not None and len(state["kept"]) != self.accelerator.num_processes:
            fail_on_every_rank(self.accelerator, "a resume within a round of --num_iterations needs the process "
                               f"count it was saved with ({len(state['kept'])})")
        self.round, device = state["round"], self.accelerator.device
        self.kept = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()}
                     for b in (state["kept"][self.accelerator.process_index] if self.round else [])]

    def window(self, model, window: list[list[tuple]], step: int) -> list[dict]:
        """The micro-batches of optimizer step `step` (1-based), ready for the loss."""
        first = step - (step - 1) % self.args.num_iterations  # the round's first step keys its completions
        if self.round == first:
            return self.kept
        began, self.rewards.trainer_state.global_step = time.perf_counter(), first - 1  # steps done, as TRL's
        batches = [self.generate(model, slots, ("train", self.args.seed, first)) for slots in window]
        self.stop_on_reward_error()
        self.metrics.add_generation(batches, time.perf_counter() - began)
        self.advantages(batches, first)
        for batch in batches:  # the sampling policy's log-probabilities: needed once the policy has moved
            if self.args.num_iterations > 1:
                with torch.no_grad():
                    batch["old_logps"] = completion_logps(model, batch, self.args.temperature)
            if self.reference_logps is not None:
                batch["ref_logps"] = self.reference_logps(batch)
        if self.args.num_iterations > 1:  # μ = 1 keeps nothing: a checkpoint resumes on any process count
            self.round, self.kept = first, batches
        return batches

    def generate(self, model, slots: list[tuple], key: tuple, split: str = "train") -> dict:
        """One micro-batch: a completion per slot (prompt position, generation index), the training rows (left-padded
        prompt, completion; position ids from the mask) and the rewards (completions x functions)."""
        rows = [self.data[split][position] for position, _ in slots]
        keys = [key + (row["index"], g) for row, (_, g) in zip(rows, slots)]
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        with self.accelerator.autocast():
            out = sample(self.accelerator.unwrap_model(model), [row["prompt_ids"] for row in rows], keys,
                         self.args.max_completion_length, self.filters, pad, eos, self.synced)
        batch = training_batch(out, [row["index"] for row in rows], self.args.mask_truncated_completions)
        ids = [c[:int(m.sum())].tolist() for c, m in zip(out["completion_ids"], out["completion_mask"])]
        texts = [self.tokenizer.decode(i, skip_special_tokens=True) for i in ids]
        raw = [{**self.raw[split][row["index"]], "__index__": row["index"]} for row in rows]
        if not isinstance(raw[0][self.args.prompt_column], str):
            texts = [[{"role": "assistant", "content": text}] for text in texts]
        try:
            batch["rewards"] = self.rewards(raw, texts, ids, split).to(batch["labels"].device)
        except RewardError as e:
            self.problem, batch["rewards"] = str(e), torch.full((len(ids), len(self.rewards.funcs)), math.nan)
        return batch

    def stop_on_reward_error(self) -> None:
        """One line on every process when a reward function failed on any (before any update uses its values)."""
        found = [p for p in gather_object([self.problem]) if p] if self.accelerator.num_processes > 1 else \
            [self.problem] if self.problem else []
        if found:
            fail_on_every_rank(self.accelerator, found[0])

    def advantages(self, batches: list[dict], step: int) -> None:
        """The rewards of the step's completions on all processes (groups may span micro-batches and processes) ->
        `group_advantages`; each batch gets its own rows' (a step that no function scored: `check_scored`)."""
        local = torch.cat([b["rewards"] for b in batches])
        groups = torch.cat([b["prompt_index"] for b in batches])
        rewards_all = self.accelerator.gather(local)
        groups_all = self.accelerator.gather(groups)
        total = weighted_sum(rewards_all, self.weights)
        self.metrics.check_scored(total, step)
        advantages, std = group_advantages(total, groups_all, self.args.scale_rewards)
        self.metrics.add_rewards(rewards_all, total, std, groups_all.unique(return_inverse=True)[1])
        start = self.accelerator.process_index * len(local)
        for b in batches:
            b["advantages"] = advantages[start:start + len(b["rewards"])].float()
            start += len(b["rewards"])


# ---- the loss: TRL's clipped per-token objective, k3 KL, four ways to average -------------------------------------
def completion_logps(model, batch: dict, temperature: float, with_entropy: bool = False):
    """Per completion position: the token's log-probability under the policy's logits / temperature (and the
    entropy there); logits are computed from the position that predicts the completion's first token on."""
    return token_logps(model, batch, temperature, with_entropy, first=batch["prompt_length"] - 1)


def token_losses(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor | None,
                 advantages: torch.Tensor, epsilon_low: float, epsilon_high: float, beta: float,
                 bias_correction_kl: bool = True):
    """Per token: -min(ratio A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) A) + beta KL, with ratio =
    exp(log pi - log pi_old) and KL = exp(ref - log pi) - (ref - log pi) - 1 (k3), times the ratio with
    `bias_correction_kl` (TRL's default: the gradient of the reverse KL, unbiased); returns (losses, ratio, KL)."""
    ratio = torch.exp(logps - old_logps)
    a = advantages.unsqueeze(1)
    losses = -torch.min(ratio * a, ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * a)
    kl = None
    if beta > 0:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        kl = kl * ratio if bias_correction_kl else kl
        losses = losses + beta * kl
    return losses, ratio, kl


def aggregate(losses: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """This micro-batch's part of the step's loss, before the division by `count_items`: dapo, a token sum (the
    step's token mean); grpo, the sum of per-completion token means; dr_grpo, a token sum / max_completion_length
    (both then over completions); bnpo, this micro-batch's token mean (then over micro-batches)."""
    masked = losses * mask
    if loss_type == "grpo":
        return (masked.sum(1) / mask.sum(1).clamp(min=1)).sum()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1)
    return masked.sum() / (max_completion_length if loss_type == "dr_grpo" else 1)


def count_items(window: list[dict], loss_type: str, accelerator) -> torch.Tensor:
    """The step's divisor on all processes: completion tokens (dapo), completions (grpo, dr_grpo), micro-batches
    (bnpo)."""
    if loss_type == "dapo":
        local = sum(batch["completion_mask"].sum() for batch in window)
    else:
        local = sum(batch["completion_mask"].shape[0] if loss_type != "bnpo" else 1 for batch in window)
    return accelerator.reduce(torch.as_tensor(local, device=accelerator.device), reduction="sum")


def grpo_forward(model, batch: dict, args, num_items: torch.Tensor) -> ModelOutput:
    """One micro-batch: `loss` = its part / `num_items`, so that `backward_loss` scales it as the token losses of the
    other recipes; `figures`: its token counts of TOKEN_FIGURES, for the metrics."""
    logps, entropy = completion_logps(model, batch, args.temperature, with_entropy=True)
    old = batch["old_logps"] if "old_logps" in batch else logps.detach()  # μ = 1: the sampling policy is this one
    losses, ratio, kl = token_losses(logps, old, batch.get("ref_logps"), batch["advantages"], args.epsilon,
                                     args.epsilon_high, args.beta, args.use_bias_correction_kl)
    mask = batch["completion_mask"].float()
    a = batch["advantages"].unsqueeze(1)
    low, high = (ratio < 1 - args.epsilon) & (a < 0), (ratio > 1 + args.epsilon_high) & (a > 0)
    figures = torch.stack([mask.sum(), (low * mask).sum(), (high * mask).sum(), ((low | high) * mask).sum(),
                           (kl.detach() * mask).sum() if kl is not None else mask.new_zeros(()),
                           (entropy * mask).sum()])
    return ModelOutput(loss=aggregate(losses, mask, args.loss_type, args.max_completion_length) / num_items,
                       figures=figures.double())


@torch.no_grad()
def evaluate_grpo(model, rollouts: Rollouts, dataloader, accelerator, args, step: int) -> dict[str, float]:
    """Mean reward (in all and per function) of one sampled completion per held-out prompt, at the run's temperature,
    each from noise fixed by its prompt (the same at every evaluation), each prompt once (`gather_for_metrics`)."""
    found, rollouts.rewards.trainer_state.global_step = [], step
    for slots in tqdm(dataloader, desc="eval", leave=False):
        batch = rollouts.generate(model, slots, ("eval", args.seed), split="validation")
        found.append(accelerator.gather_for_metrics(batch["rewards"]))
    rollouts.stop_on_reward_error()
    rewards = torch.cat(found)
    total = (rewards.nan_to_num() * rollouts.weights.to(rewards.device)).sum(1)
    known = ~rewards.isnan().all(1)
    metrics = {"eval_reward": total[known].mean().item() if known.any() else math.nan, "eval_prompts": len(rewards),
               **rollouts.rewards.logged_metrics(accelerator, "eval")}
    for name, column in zip(rollouts.metrics.names, rewards.T):
        metrics[f"eval_rewards/{name}/mean"] = column[~column.isnan()].mean().item()
    return metrics


# ---- the reference (--beta > 0): a frozen copy on the run's engine, or the disabled adapter -------------------------
def build_reference(args, config, accelerator, model, vocab_size: int):
    """After `prepare`: batch -> the reference's completion log-probabilities; None with --beta 0 (nothing loaded)."""
    if args.beta == 0:
        return None
    reference = load_reference(args, config, accelerator, vocab_size)
    return reference_forward(accelerator, model, reference, lambda m, b: completion_logps(m, b, args.temperature))


def load_reference(args, config, accelerator, vocab_size: int):
    """The frozen copy of the pretrained model (common/inputs/policy.py), placed as the engine needs; None with
    --use_peft (the policy with its adapter disabled is the reference)."""
    if args.use_peft:  # feature: lora
        return None
    reference = frozen_copy(args, config, vocab_size)
    if args.use_liger_kernel:  # feature: liger kernel
        use_liger_kernel(reference, fused_loss=False)
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):  # feature: sharded reference
        return shard_reference(accelerator, reference)
    return reference.to(accelerator.device)


def train(args, config, accelerator, resume_from: str | None, extras: CheckpointExtras) -> int:
    """The whole run; returns the exit status (see scripts/pretrain_llama.py, whose loop this one follows)."""
    record = RunRecord(args, "finetune_grpo", accelerator, config, DATA_FLAGS, resume_from)  # feature: resume guard
    extras.write, extras.check, extras.keep = record.write, record.check, record.keep  # feature: resume guard
    lock_output_dir(args.output_dir, accelerator.is_main_process)  # feature: folder lock
    run = RunLifecycle(accelerator, args.output_dir, args.overwrite_output_dir, resume_from, extras)
    ga = args.gradient_accumulation_steps
    tokenizer, raw, data = load_prompt_data(args, accelerator, config, resume_from)
    train_dataloader, eval_dataloader = build_dataloaders(args, accelerator, data)
    steps_per_epoch, total_steps = count_optimizer_steps(train_dataloader, ga, accelerator.num_processes,
                                                         args.max_steps, args.num_train_epochs, unit="completions")
    record.add_data(tokenizer, steps_per_epoch)  # feature: resume guard
    args.reward_functions.trainer_state.max_steps = total_steps  # what TRL's reward functions may read

    # ---- policy (with --use_peft: a frozen base and a LoRA adapter), reference, optimizer, schedule ----------------
    model = build_model(args, config, accelerator, len(tokenizer))
    trainable, total_params = count_parameters(model)
    optimizer, lr_scheduler = create_optimizer_and_scheduler(args, model, accelerator, total_steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    metrics = GroupMetrics(accelerator, args.reward_functions, args.beta)
    rollouts = Rollouts(args, accelerator, tokenizer, raw, data, build_reference(args, config, accelerator, model,
                                                                                  len(tokenizer)), metrics)
    accelerator.register_for_checkpointing(rollouts)  # a round of --num_iterations steps resumes on its completions
    progress, log, guard = run.start(total_steps, steps_per_epoch, args.logging_steps,
                                     trackers=("finetune_grpo", vars(args)))
    log.row_extras, log.bar_keys = metrics.row, ("reward",)  # the bar shows the reward: GRPO's loss is about 0
    log.carry(metrics.sums)  # a resumed run's first row counts the completions before the checkpoint
    logger.info(f"Model: {total_params / 1e6:.2f}M parameters, {trainable / 1e6:.2f}M trainable; {total_steps} steps")

    # ---- training loop: generate and score the step's completions, then the clipped loss over all of them ---------
    guard = NonFiniteGuard(accelerator, progress, args.max_nonfinite_steps)  # feature: divergence guard
    guard.stop_signalled = catch_stop_signals()  # feature: preemption
    train_start = time.perf_counter()
    model.train()
    for window in optimizer_step_windows(train_dataloader, progress, steps_per_epoch, total_steps, ga):
        window = rollouts.window(model, window, progress.step)
        num_items = count_items(window, args.loss_type, accelerator)
        window_loss = torch.zeros((), device=accelerator.device)
        for batch in window:
            with accelerator.accumulate(model):
                outputs = grpo_forward(model, batch, args, num_items)
                loss, token_loss = backward_loss(outputs, accelerator)
                accelerator.backward(loss)
                window_loss += token_loss
                metrics.add(outputs)
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
                eval_metrics = evaluate_grpo(model, rollouts, eval_dataloader, accelerator, args, step)
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
    # ---- final evaluation (mean reward on held-out prompts) and export ----------------------------------------------
    eval_metrics = evaluate_grpo(model, rollouts, eval_dataloader, accelerator, args, progress.step)
    log.write_eval(progress.step, eval_metrics)
    export = exporter(args)
    if not export(accelerator, model, tokenizer, args.output_dir):
        return DIVERGED_STATUS
    results = {**eval_metrics, "train_steps": progress.step, "train_runtime": train_runtime,
               "num_parameters": total_params, "trainable_parameters": trainable, "train_prompts": len(data["train"])}
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
    if args.use_peft:  # feature: lora
        model = add_adapter(args, accelerator, model, "CAUSAL_LM")
    if not args.keep_dropout:
        disable_dropout(model)
    if args.torch_compile:  # feature: torch compile
        compile_model(model, args.torch_compile_whole_model, args.torch_compile_backend, args.torch_compile_mode,
                      lengths_vary=True)
    return model


if __name__ == "__main__":
    main()
