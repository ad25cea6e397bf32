"""Prompts (scripts/finetune_grpo.py): the GRPO flags checked, prompt rows read, checked and tokenized, and the order
in which completion slots (prompt, generation index) reach the batches. Reward functions: common/inputs/rewards.py.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from accelerate.logging import get_logger

from common.errors import fail
from common.inputs.data import HeldOut, Source, get_tokenizer, load_raw_datasets
from common.inputs.responses import (apply_template, build_docstring_task, chat_problem, naming_the_failing_row,
                                     rows_of, with_parts_joined)
from common.inputs.rewards import check_reward_columns

logger = get_logger(__name__)


def true_or_false(text: str) -> bool:
    """A boolean flag's value as HfArgumentParser reads it (true/false, yes/no, 1/0)."""
    if text.lower() not in ("true", "false", "yes", "no", "1", "0"):
        raise argparse.ArgumentTypeError(f"give true or false (got {text!r})")
    return text.lower() in ("true", "yes", "1")


def check_grpo_flags(args: argparse.Namespace) -> None:
    """One line for a GRPO flag that cannot work, before any model or data work."""
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    completions = args.per_device_train_batch_size * args.gradient_accumulation_steps * processes
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    problems = [
        (args.num_generations < 2, f"--num_generations must be at least 2 (got {args.num_generations}): "
                                   "advantages compare the completions of a prompt"),
        (completions % args.num_generations != 0,
         f"the global batch ({args.per_device_train_batch_size} completions x {args.gradient_accumulation_steps} "
         f"accumulation x {processes} processes = {completions}) must be a multiple of --num_generations "
         f"{args.num_generations}"),
        (not 0 < args.epsilon < math.inf or not 0 < epsilon_high < math.inf,
         f"--epsilon and --epsilon_high must be finite numbers > 0 (got {args.epsilon}, {epsilon_high})"),
        (not 0 <= args.beta < math.inf, f"--beta must be a finite number >= 0 (got {args.beta})"),
        (not 0 < args.temperature < math.inf, f"--temperature must be a finite number > 0 (got {args.temperature})"),
        (not 0 < args.top_p <= 1, f"--top_p must be in (0, 1] (got {args.top_p})"),
        (args.top_k < 0 or not 0 <= (args.min_p or 0) < 1, "--top_k must be >= 0 and --min_p in [0, 1)"),
        (args.max_completion_length < 1 or args.num_iterations < 1,
         "--max_completion_length and --num_iterations must be at least 1"),
        (args.group_by_length, "--group_by_length does not apply: a step's batches are groups of completions"),
        (args.text_column != "text", "--text_column does not apply: the prompts are read from --prompt_column"),
    ]
    for bad, message in problems:
        if bad:
            fail(message)


# ---- prompt rows ---------------------------------------------------------------------------------------------------
def load_prompt_data(args: argparse.Namespace, accelerator, config, resume_from: str | None):
    """(tokenizer, raw splits, tokenized splits with `prompt_ids` and `index`). Rows are checked before the tokenizer
    loads; a prompt that leaves less than --max_completion_length tokens of the context stops the run in one line
    naming its row (the default task's prompts that do not fit are left out, and counted in the log)."""
    default = not args.train_file and not args.dataset_name
    if default:
        with accelerator.main_process_first():
            args.train_file, args.validation_file = build_docstring_task(args.cache_dir)
    raw = load_raw_datasets(Source.from_flags(args), HeldOut.from_flags(args), args.cache_dir,
                            columns={args.prompt_column: "--prompt_column"},
                            check_rows=lambda raw: find_unusable_prompt(raw, args.prompt_column, args))
    if default:  # a prompt ending in a lone newline token is one the SFT model never saw: it would stop at once
        raw = raw.map(lambda row: {"prompt": row["prompt"].rstrip("\n")}, desc="Prompts without their last newline")
    for split in raw:  # a function requiring a column the rows lack: TRL's TypeError at the first step, here now
        check_reward_columns(args.reward_functions.funcs, [c for c in raw[split].column_names
                                                           if c != args.prompt_column], f"the {split} split")
    tokenizer = get_tokenizer(args, accelerator, raw, resume_from)
    if not isinstance(raw["train"][0][args.prompt_column], str) and not tokenizer.chat_template:
        fail(f"the data has chat turns ('{args.prompt_column}') but the tokenizer has no chat template: use "
             "plain-text prompts or a model whose tokenizer has one")
    context = args.max_seq_length or min(tokenizer.model_max_length,
                                         getattr(config, "max_position_embeddings", None) or 2048)
    room = context - args.max_completion_length
    with accelerator.main_process_first(), naming_the_failing_row(args, [args.prompt_column]):
        data = raw.map(tokenize_prompts, batched=True, with_indices=True, remove_columns=raw["train"].column_names,
                       fn_kwargs=dict(tokenizer=tokenizer, column=args.prompt_column), desc="Tokenizing prompts")
    for split in ("train", "validation"):
        lengths = data[split]["length"]
        too_long = [i for i, length in enumerate(lengths) if length > room]
        if too_long and not default:
            fail(f"{split} row {too_long[0] + 1}: its prompt has {lengths[too_long[0]]} tokens, more than the "
                 f"{room} the context of {context} leaves beside --max_completion_length "
                 f"{args.max_completion_length} (--max_seq_length)")
        if too_long:
            data[split] = data[split].filter(lambda length: length <= room, input_columns="length")
            logger.info(f"{len(too_long)} {split} prompts left out: longer than {room} tokens")
    logger.info(f"{len(data['train'])} training prompts, {len(data['validation'])} held out")
    return tokenizer, raw, data


def tokenize_prompts(batch: dict, indices: list[int], tokenizer, column: str) -> dict:
    """`datasets.map` function: a prompt's token ids (plain text: with the tokenizer's special tokens; chat turns:
    rendered with the generation prompt), its row `index` and `length`."""
    ids = []
    for prompt in batch[column]:
        if isinstance(prompt, str):
            ids.append(tokenizer(prompt)["input_ids"])
        else:
            text = apply_template(tokenizer, with_parts_joined(prompt), (prompt,), add_generation_prompt=True)
            ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return {"prompt_ids": ids, "index": indices, "length": [len(i) for i in ids]}


def find_unusable_prompt(raw, column: str, args) -> tuple[str, int, str] | None:
    """The first row (split, index, problem) whose prompt is missing or empty, or chat turns that are not a
    conversation, or of another kind (text, chat) than the first row's."""
    first_kind = None
    for split, index, (prompt,) in rows_of(raw, [column], args):
        kind = "plain text" if isinstance(prompt, str) else "chat turns"
        first_kind = first_kind or kind
        if prompt is None or (isinstance(prompt, str) and not prompt.strip()) or not prompt:
            return split, index, f"has an empty '{column}'"
        if kind != first_kind:
            return split, index, f"holds {kind} where the first row holds {first_kind}: give every row the same kind"
        # the turn to be generated stands in for the assistant turn a conversation needs; it has no content yet
        turns = list(prompt) + [{"role": "assistant"}]
        problem = None if kind == "plain text" else chat_problem(turns, column, responses_from=len(turns))
        if problem:
            return split, index, problem
    return None


# ---- the order of completion slots ---------------------------------------------------------------------------------
class GroupSampler(torch.utils.data.Sampler):
    """Completion slots `prompt x G + generation` for one pass: the prompts shuffled by (seed, epoch), cut into the
    optimizer steps' blocks of `prompts_per_step`, each block's G x prompts slots in order and repeated
    `num_iterations` times (the steps that reuse one generation). Every process draws the same order (accelerate deals
    the batches out: one step's micro-batches on all processes hold whole groups); a trailing partial block is left
    out."""

    def __init__(self, num_prompts: int, num_generations: int, prompts_per_step: int, num_iterations: int,
                 seed: int) -> None:
        self.num_prompts, self.num_generations, self.prompts_per_step = num_prompts, num_generations, prompts_per_step
        self.num_iterations, self.seed, self.epoch = num_iterations, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        blocks = self.num_prompts // self.prompts_per_step
        return blocks * self.prompts_per_step * self.num_generations * self.num_iterations

    def __iter__(self):
        order = torch.randperm(self.num_prompts, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        for start in range(0, len(order) - self.prompts_per_step + 1, self.prompts_per_step):
            block = [p * self.num_generations + g for p in order[start:start + self.prompts_per_step].tolist()
                     for g in range(self.num_generations)]
            for _ in range(self.num_iterations):
                yield from block
