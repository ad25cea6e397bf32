"""Prompts and rewards (scripts/finetune_grpo.py): reward functions named on the command line and checked before any
work, the embedded default task's two rewards, prompt rows read, checked and tokenized, and the order in which
completion slots (prompt, generation index) reach the batches.

A reward function has TRL's signature, `f(prompts, completions, **columns) -> list[float | None]`: `prompts` as the
rows hold them (text, or chat turns), `completions` as text (chat prompts: `[{"role": "assistant", "content": ...}]`),
`completion_ids`, and every other column of the rows by name; None marks a completion the function cannot score.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
from collections.abc import Callable

import torch
from accelerate.logging import get_logger

from common.errors import fail
from common.inputs.data import get_tokenizer, load_raw_datasets
from common.inputs.responses import (apply_template, build_docstring_task, chat_problem, naming_the_failing_row,
                                     rows_of, with_parts_joined)

logger = get_logger(__name__)


# ---- the default task's rewards: programs anyone can read ----------------------------------------------------------
def compiles(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """1 when the prompt (a signature and docstring) followed by the completion compiles as Python (nothing runs)."""
    scores = []
    for prompt, completion in zip(prompts, completions):
        try:
            compile(prompt + completion, "<completion>", "exec")
            scores.append(1.0)
        except (SyntaxError, ValueError):
            scores.append(0.0)
    return scores


def stays_in_function(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """1 when the completion is a function body: it has a line of code, and every line that is not blank is indented
    (nothing after the function: no second definition, no text at the module's level)."""
    scores = []
    for completion in completions:
        lines = [line for line in completion.splitlines() if line.strip()]
        scores.append(float(bool(lines) and all(line[0] in " \t" for line in lines)))
    return scores


DEFAULT_REWARDS = (compiles, stays_in_function)


def load_reward_funcs(specs: list[str]) -> list[Callable]:
    """`FILE.py:NAME` or `package.module:NAME` -> the functions, each checked to be a callable that takes prompts and
    completions; one line naming the spec otherwise (before any model or data work)."""
    funcs = []
    for spec in specs:
        where, _, name = spec.rpartition(":")
        if not where or not name:
            fail(f"--reward_funcs {spec}: give FILE.py:NAME or package.module:NAME")
        if where.endswith(".py"):
            if not os.path.isfile(where):
                fail(f"--reward_funcs {spec}: no such file {where}")
            module_name = f"reward_{hashlib.sha256(os.path.abspath(where).encode()).hexdigest()[:8]}"
            loaded = importlib.util.spec_from_file_location(module_name, where)
            module = importlib.util.module_from_spec(loaded)
            sys.modules[module_name] = module  # dataclasses and pickling look a module up there
            load = lambda: loaded.loader.exec_module(module)  # noqa: E731
        else:
            module = None
            load = lambda: importlib.import_module(where)  # noqa: E731
        try:
            module = load() or module
        except Exception as e:  # the user's code: say which file and why, in one line
            fail(f"--reward_funcs {spec}: importing {where} failed ({type(e).__name__}: {e})")
        func = getattr(module, name, None)
        if not callable(func):
            fail(f"--reward_funcs {spec}: {where} has no function {name!r}")
        try:
            inspect.signature(func).bind([], [])
        except TypeError:
            fail(f"--reward_funcs {spec}: {name} must take (prompts, completions, **columns), as TRL's reward "
                 "functions do")
        funcs.append(func)
    return funcs


def score(funcs: list[Callable], rows: list[dict], prompt_column: str, completions: list, completion_ids: list
          ) -> torch.Tensor:
    """(completions x functions) rewards, NaN where a function returned None; one line naming the function and the
    row when one raises, returns a list of the wrong length or a value that is not a number."""
    prompts = [row[prompt_column] for row in rows]
    columns = {key: [row[key] for row in rows] for key in rows[0] if key not in (prompt_column, "__index__")}
    scores = torch.full((len(rows), len(funcs)), math.nan, dtype=torch.float64)
    for j, func in enumerate(funcs):
        name = getattr(func, "__name__", repr(func))
        try:
            values = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:
            raise RewardError(f"reward function {name} raised {type(e).__name__}: {e} (on rows "
                              f"{', '.join(str(row['__index__'] + 1) for row in rows)} of the prompts)") from e
        if not isinstance(values, (list, tuple)) or len(values) != len(rows):
            count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise RewardError(f"reward function {name} returned {count} values for {len(rows)} completions")
        for i, value in enumerate(values):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RewardError(f"reward function {name} returned {value!r} for row {rows[i]['__index__'] + 1} of "
                                  "the prompts: give a finite number, or None for a completion it cannot score")
            scores[i, j] = float(value)
    return scores


class RewardError(Exception):
    """A reward function's misuse, said in one line by the recipe on every process."""


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
    ]
    for bad, message in problems:
        if bad:
            fail(message)


def reward_functions(args: argparse.Namespace) -> list[Callable]:
    """--reward_funcs loaded and checked (the default task's two rewards without data flags), --reward_weights
    counted against them: one line otherwise, before any model or data work."""
    if not args.reward_funcs and (args.train_file or args.dataset_name):
        fail("no reward function: pass --reward_funcs FILE.py:NAME ... (the built-in rewards score the default task)")
    funcs = load_reward_funcs(args.reward_funcs) if args.reward_funcs else list(DEFAULT_REWARDS)
    if args.reward_weights and len(args.reward_weights) != len(funcs):
        fail(f"--reward_weights has {len(args.reward_weights)} weights for {len(funcs)} reward functions")
    return funcs


# ---- prompt rows ---------------------------------------------------------------------------------------------------
def load_prompt_data(args: argparse.Namespace, accelerator, config, resume_from: str | None):
    """(tokenizer, raw splits, tokenized splits with `prompt_ids` and `index`). Rows are checked before the tokenizer
    loads; a prompt that leaves less than --max_completion_length tokens of the context stops the run in one line
    naming its row (the default task's prompts that do not fit are left out, and counted in the log)."""
    default = not args.train_file and not args.dataset_name
    if default:
        with accelerator.main_process_first():
            args.train_file, args.validation_file = build_docstring_task(args.cache_dir)
    raw = load_raw_datasets(args, columns={args.prompt_column: "--prompt_column"},
                            check_rows=lambda raw: find_unusable_prompt(raw, args.prompt_column, args))
    if default:  # a prompt ending in a lone newline token is one the SFT model never saw: it would stop at once
        raw = raw.map(lambda row: {"prompt": row["prompt"].rstrip("\n")}, desc="Prompts without their last newline")
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
