"""Preference pairs (scripts/finetune_dpo.py): rows of prompt, chosen and rejected (plain text or chat turns) checked
before the tokenizer loads, tokenized (the prompt's tokens alone, each response's following them unchanged) and
collated into batches of 2B rows, the B chosen rows then the B rejected ones."""

from __future__ import annotations

import argparse
import logging
import os
from functools import partial

import jinja2
import torch
from transformers.utils.chat_template_utils import render_jinja_template

from common.errors import fail
from common.inputs.data import HeldOut, Source, get_tokenizer, load_raw_datasets
from common.inputs.responses import (build_preference_task, chat_problem, check_tokenized, naming_the_failing_row,
                                     rows_of, tokenize_prompt_and_responses)

logger = logging.getLogger(__name__)


def check_chat_template(path: str) -> None:
    """--chat_template: a file holding a Jinja template that compiles (checked before any data work; rendering an
    empty conversation compiles it as transformers does, with its extensions)."""
    if not os.path.isfile(path):
        fail(f"--chat_template {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            template = f.read()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"--chat_template {path}: cannot be read ({getattr(e, 'strerror', None) or e})")
    try:
        render_jinja_template(conversations=[[]], chat_template=template)
    except jinja2.TemplateSyntaxError as e:
        fail(f"--chat_template {path}: not a Jinja template (line {e.lineno}: {e.message})")
    except Exception:  # it compiled: an empty conversation may be refused by the template itself
        pass


def load_preference_data(args: argparse.Namespace, accelerator, config, resume_from: str | None):
    """Rows -> prompt and response token ids: (tokenizer, datasets with prompt_ids/chosen_ids/rejected_ids/index/
    length). Every row is checked before the tokenizer loads (`find_untrainable_pair`)."""
    if not args.train_file and not args.dataset_name:
        with accelerator.main_process_first():
            args.train_file, args.validation_file = build_preference_task(args.cache_dir)
    columns = {args.prompt_column: "--prompt_column", args.chosen_column: "--chosen_column",
               args.rejected_column: "--rejected_column"}
    raw = load_raw_datasets(Source.from_flags(args), HeldOut.from_flags(args), args.cache_dir, columns,
                            check_rows=partial(find_untrainable_pair, args=args))
    tokenizer = get_tokenizer(args, accelerator, raw, resume_from)
    if args.chat_template:
        with open(args.chat_template, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    first = raw["train"][0]
    if not isinstance(first[args.prompt_column], str) and not tokenizer.chat_template:
        fail(f"the data has chat turns ('{args.prompt_column}') but the tokenizer has no chat template: pass "
             "--chat_template FILE, or use plain-text columns")
    max_length = args.max_seq_length or min(tokenizer.model_max_length,
                                            getattr(config, "max_position_embeddings", None) or 2048, 2048)
    with accelerator.main_process_first(), naming_the_failing_row(args, list(columns)):
        data = raw.map(tokenize_pairs, batched=True, with_indices=True, num_proc=args.preprocessing_num_workers,
                       fn_kwargs=dict(tokenizer=tokenizer, max_length=max_length, columns=tuple(columns)),
                       remove_columns=raw["train"].column_names, desc="Tokenizing")
    check_tokenized(raw, data, max_length, "pairs")
    logger.info(f"{len(data['train'])} training pairs (at most {max_length} tokens a sequence)")
    return tokenizer, data


def tokenize_pairs(batch: dict, indices: list[int], tokenizer, max_length: int, columns: tuple[str, str, str]) -> dict:
    """`datasets.map` function: prompt, chosen, rejected -> token ids, responses cut to fit `max_length` with their
    prompt. `index` (the row's position) keys the precomputed reference values. Pairs whose prompt alone fills
    `max_length` are dropped: they have nothing to learn."""
    out = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": [], "index": [], "length": []}
    prompt_column, chosen_column, rejected_column = columns
    for i, index in enumerate(indices):
        prompt_ids, (chosen, rejected) = tokenize_prompt_and_responses(
            tokenizer, batch[prompt_column][i], [batch[chosen_column][i], batch[rejected_column][i]])
        room = max_length - len(prompt_ids)
        if room < 1:
            continue
        out["prompt_ids"].append(prompt_ids)
        out["chosen_ids"].append(chosen[:room])
        out["rejected_ids"].append(rejected[:room])
        out["index"].append(index)
        out["length"].append(len(prompt_ids) + max(len(chosen[:room]), len(rejected[:room])))
    return out


class PairCollator:
    """Pairs -> one batch of 2B rows, the B chosen rows then the B rejected ones: prompt + response ids right-padded
    (the pad id is never attended to nor learned), labels -100 on the prompt and the padding. With precomputed
    reference values (`reference_logps[index]`: chosen, rejected), the batch carries them as `ref_logps`."""

    def __init__(self, pad_token_id: int, multiple: int) -> None:
        self.pad_token_id, self.multiple = pad_token_id, multiple
        self.reference_logps: torch.Tensor | None = None

    def __call__(self, examples: list[dict]) -> dict:
        rows = [(e["prompt_ids"], e[key]) for key in ("chosen_ids", "rejected_ids") for e in examples]
        width = max(len(p) + len(r) for p, r in rows)
        width = -(-width // self.multiple) * self.multiple
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, (prompt, response) in enumerate(rows):
            n = len(prompt) + len(response)
            input_ids[row, :n] = torch.tensor(prompt + response)
            labels[row, len(prompt):n] = torch.tensor(response)
            attention_mask[row, :n] = 1
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        if self.reference_logps is not None:
            index = torch.tensor([e["index"] for e in examples])
            batch["ref_logps"] = self.reference_logps[index].T.reshape(-1)  # chosen rows, then rejected rows
        return batch


def find_untrainable_pair(raw, args: argparse.Namespace) -> tuple[str, int, str] | None:
    """The first row (split, index, problem) that cannot give a pair: a missing or empty prompt or response, chosen
    equal to rejected, text mixed with chat turns (in a row, or across rows: one tokenization serves them all; rows
    read as their file holds them, `rows_of`), or chat turns that are not a conversation ending in an answer."""
    columns = [args.prompt_column, args.chosen_column, args.rejected_column]
    first_kind = None  # (split, row, "plain text" or "chat turns") of the first row
    for split, index, values in rows_of(raw, columns, args):
        problem = pair_problem(dict(zip(columns, values)), *columns)
        kind = "plain text" if isinstance(values[0], str) else "chat turns"
        first_kind = first_kind or (split, index, kind)
        if not problem and kind != first_kind[2]:
            problem = (f"holds {kind} where row {first_kind[1] + 1} of the {first_kind[0]} split holds "
                       f"{first_kind[2]}: give every row the same kind")
        if problem:
            return split, index, problem
    return None


def pair_problem(row: dict, prompt_column: str, chosen_column: str, rejected_column: str) -> str | None:
    prompt, chosen, rejected = row[prompt_column], row[chosen_column], row[rejected_column]
    for column, value in row.items():
        if value is None or (isinstance(value, str) and not value.strip() and column != prompt_column):
            return f"has no '{column}' text" if value is None else f"has an empty '{column}' response"
    if isinstance(prompt, str) != isinstance(chosen, str) or isinstance(chosen, str) != isinstance(rejected, str):
        return f"mixes plain text and chat turns in '{prompt_column}', '{chosen_column}', '{rejected_column}'"
    if chosen == rejected:
        return f"has the same '{chosen_column}' and '{rejected_column}': nothing to prefer"
    if not isinstance(prompt, str):
        for column, response in ((chosen_column, chosen), (rejected_column, rejected)):
            problem = f"has no chat turns in '{column}'" if not response else \
                chat_problem(list(prompt) + list(response), column, len(prompt), prompt_column)
            if problem or response[-1].get("role") != "assistant":
                return problem or f"has no assistant turn at the end of '{column}': nothing to learn"
    return None
