"""Prompt/response data, shared by supervised fine-tuning and preference training: chat turns rendered with the
tokenizer's chat template, token ids with response labels (-100 elsewhere), and the default tasks built from this
Python's standard library (write a function's body from its signature and docstring)."""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import random
import textwrap
from contextlib import contextmanager
from functools import partial

from accelerate.logging import get_logger
from datasets import load_dataset

from common.errors import fail
from common.inputs.cache import cached_folder
from common.inputs.data import build_default_corpus, data_format
from common.inputs.json_types import json_rows

logger = get_logger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "tool")


def rows_of(raw, columns: list[str], args: argparse.Namespace):
    """Each row of the train and validation splits as (split, index, values of `columns`), 1,000 rows at a time; a
    split without those columns is passed over (the column check names what is missing)."""
    for split in ("train", "validation"):
        if split not in raw or not set(columns) <= set(raw[split].column_names):
            continue
        rows = raw[split].select_columns(columns)
        for start in range(0, len(rows), 1000):
            batch = rows[start:start + 1000]
            for offset, values in enumerate(zip(*(batch[column] for column in columns))):
                yield split, start + offset, values


def chat_problem(messages, column: str, responses_from: int = 0, prompt_column: str | None = None,
                 text_only: bool = True) -> str | None:
    """What makes a row's chat turns untrainable, or None: an unknown role, no assistant turn, or an assistant turn
    from `responses_from` on with nothing in it (no text, no tool call), refused as an empty text response is; a part
    that is not text too, unless the model takes it (`text_only=False`: a vision-language model's images). With
    `prompt_column`, the turns before `responses_from` are that column's and the others are numbered from 1 in
    `column` (DPO: a prompt's turns, then a response's)."""
    if isinstance(messages, str):
        return f"holds plain text in '{column}', where chat turns are expected"
    if not messages:
        return f"has no chat turns in '{column}'"
    for number, message in enumerate(messages, 1):
        role = message.get("role") if isinstance(message, dict) else None
        turn, of = ((number, prompt_column) if number <= responses_from else
                    (number - responses_from, column)) if prompt_column else (number, column)
        if role not in CHAT_ROLES:
            return f"has role {role!r} in turn {turn} of '{of}' (the roles are {', '.join(CHAT_ROLES)})"
        content = message.get("content")
        if isinstance(content, list):
            other = next((part for part in content if text_only and not is_text_part(part)), None)
            if other is not None:
                kind = f"a part of type {other.get('type')!r}" if isinstance(other, dict) else f"a part {other!r}"
                return (f"has {kind} in turn {turn} of '{of}': the recipes train text-only models, which take "
                        'text parts only ({"type": "text", "text": ...})')
            content = joined_text(content) if text_only else content
        elif content is not None and not isinstance(content, str):
            return f"has content {content!r} in turn {turn} of '{of}': give text or a list of text parts"
        if role == "assistant" and number > responses_from and not message.get("tool_calls") and \
                not (content.strip() if isinstance(content, str) else content):
            return f"has an empty '{column}' response (turn {number - responses_from})"
    if not any(message["role"] == "assistant" for message in messages):
        return "has no assistant turn: nothing in it to learn"
    return None


def is_text_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def joined_text(parts: list[dict]) -> str:
    """The text that a message's text parts spell: joined with a newline, as vLLM's OpenAI-compatible server joins
    them for a chat template that takes text (vllm/entrypoints/chat_utils.py, `"\\n".join(texts)`)."""
    return "\n".join(part["text"] for part in parts)


def with_parts_joined(messages: list[dict]) -> list[dict]:
    """The messages with each content given in text parts (checked by `chat_problem`) as the text they spell: a row
    in parts renders, and trains, exactly as the same row written as text."""
    return [{**message, "content": joined_text(message["content"])}
            if isinstance(message, dict) and isinstance(message.get("content"), list) else message
            for message in messages]


class TemplateFailure(Exception):
    """The chat template failed on a row: (the row's values, the template's message). Raised inside `datasets.map`;
    `naming_the_failing_row` says it in one line."""


def apply_template(tokenizer, messages: list[dict], row: tuple, **kwargs) -> str:
    """The chat template's text for `messages` (whose parts are joined already); a template that compiles may still
    fail on a conversation (`messages[7]` of a shorter one, its own `raise_exception`, an undefined name): that is a
    TemplateFailure carrying `row`, the values of the row being rendered, and the template's own message."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - what a template raises: jinja2's errors, or Python's from its expressions
        raise TemplateFailure(row, (str(e).strip().splitlines() or [type(e).__name__])[0]) from None


@contextmanager
def naming_the_failing_row(args: argparse.Namespace, columns: list[str]):
    """Around the tokenizing pass: a TemplateFailure becomes one line naming the template, the file and the row (the
    first row of the files, in their order, holding the failing values), and the template's message."""
    try:
        yield
    except TemplateFailure as failure:
        values, message = failure.args
        name = getattr(args, "chat_template", None)
        template = f"--chat_template {name}" if name else \
            f"the chat template of {args.tokenizer_name or args.model_name_or_path}"
        for where, index, row in rows_in_file_order(args):
            if tuple(row.get(column) for column in columns) == tuple(values):
                fail(f"{template} fails on row {index + 1} of {where}: {message}")
        fail(f"{template} fails on a row: {message}")


def rows_in_file_order(args: argparse.Namespace):
    """(where, index, row) for each row of the data files, or of the dataset's splits, in the order they hold them
    (before any validation split is cut from the train file): read again, only after a failure."""
    if args.dataset_name:
        for split, rows in load_dataset(args.dataset_name, args.dataset_config_name).items():
            yield from ((f"--dataset_name {args.dataset_name} ({split} split)", i, row) for i, row in enumerate(rows))
        return
    for flag, path in (("--train_file", args.train_file), ("--validation_file", args.validation_file)):
        if path:
            rows = json_rows(path) if data_format(path) == "json" else \
                load_dataset(data_format(path), data_files=path, split="train")
            yield from ((f"{flag} {path}", i, row) for i, row in enumerate(rows))


def text_problem(row: dict, response_column: str) -> str | None:
    """What makes a row of plain-text columns untrainable, or None: a missing value, chat turns, an empty response."""
    for column, value in row.items():
        if not isinstance(value, str):
            return f"holds chat turns in '{column}', where plain text is expected" if isinstance(value, list) else \
                f"has no '{column}' text"
        if column == response_column and not value.strip():
            return f"has an empty '{column}' response"
    return None


def render_chat(tokenizer, messages: list[dict], join_parts: bool = True) -> tuple[str, list[tuple[int, int]]]:
    """The conversation as the chat template writes it, and the character spans of the assistant turns; text parts
    joined (`join_parts`), or left to the template (a processor's template places its images among them).

    A turn's span runs from the end of the conversation rendered up to it (with the generation prompt, e.g.
    `<|im_start|>assistant\\n`) to the end of the conversation rendered through it (its end-of-turn token included).
    """
    row, messages = (messages,), with_parts_joined(messages) if join_parts else messages
    text = apply_template(tokenizer, messages, row)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = apply_template(tokenizer, messages[:i], row, add_generation_prompt=True) if i else ""
        through = apply_template(tokenizer, messages[:i + 1], row)
        if not (text.startswith(before) and text.startswith(through)):
            fail("the chat template renders a conversation differently from its beginning (it may rewrite earlier "
                 "turns), so the assistant turns cannot be located; give prompt/completion columns instead")
        spans.append((len(before), len(through)))
    return text, spans


def tokenize_with_response_labels(tokenizer, text: str, spans: list[tuple[int, int]], plain_text: bool
                                  ) -> tuple[list[int], list[int]]:
    """Token ids, and labels that keep the tokens overlapping a response span (-100 elsewhere).

    Plain prompt + completion text gets the tokenizer's special tokens (e.g. BOS) and an EOS after the response, so
    the model learns to stop; a chat template writes its own special tokens.
    """
    enc = tokenizer(text, add_special_tokens=plain_text, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    labels = [t if any(a < end and b > start for start, end in spans) else -100
              for t, (a, b) in zip(ids, enc["offset_mapping"])]
    if plain_text and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
        labels.append(tokenizer.eos_token_id)
    return ids, labels


def tokenize_prompt_and_responses(tokenizer, prompt, responses: list) -> tuple[list[int], list[list[int]]]:
    """The prompt's token ids, and each response's, tokenized apart: a response's tokens follow the prompt's as they
    are (joining the strings first could merge tokens across the boundary and move it).

    Plain text: the prompt gets the tokenizer's special tokens (e.g. BOS), each response an EOS. Chat turns (lists):
    the prompt is its turns rendered with the generation prompt, a response what the template adds for its turns.
    """
    if isinstance(prompt, str):
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        return (tokenizer(prompt)["input_ids"],
                [tokenizer(r, add_special_tokens=False)["input_ids"] + eos for r in responses])
    row, prompt = (prompt, *responses), with_parts_joined(prompt)
    prompt_text = apply_template(tokenizer, prompt, row, add_generation_prompt=True)
    response_ids = []
    for response in responses:
        text = apply_template(tokenizer, prompt + with_parts_joined(response), row)
        if not text.startswith(prompt_text):
            fail("the chat template renders the prompt's turns differently once a response follows them, so the "
                 "response cannot be located; give plain-text prompt/chosen/rejected columns instead")
        response_ids.append(tokenizer(text[len(prompt_text):], add_special_tokens=False)["input_ids"])
    return tokenizer(prompt_text, add_special_tokens=False)["input_ids"], response_ids


def check_tokenized(raw, data, max_length: int, unit: str) -> None:
    """Say how many rows of each split tokenizing dropped (a prompt that fills `max_length` leaves no response
    token), and stop in one line when a split has none left."""
    for split in ("train", "validation"):
        if len(data[split]) < len(raw[split]):
            logger.info(f"{len(raw[split]) - len(data[split])} {split} {unit} dropped: their prompt fills "
                        f"--max_seq_length {max_length}")
        if len(data[split]) == 0:
            fail(f"no {split} {unit[:-1]} has a response token within --max_seq_length {max_length}")


def build_docstring_task(cache_dir: str) -> tuple[str, str]:
    """The default SFT set: prompt = a documented function's signature and docstring, completion = its body, from
    the same standard-library sources (and train/validation split) as the pretraining default corpus. A cache entry
    (common/inputs/cache.py): written whole or not at all."""
    corpus = build_default_corpus(cache_dir)
    out_dir = os.path.join(cache_dir, "docstring-sft-" + hashlib.sha256(corpus["train"].encode()).hexdigest()[:12])
    cached_folder(out_dir, partial(write_docstring_task, corpus), "the default SFT task", corpus["train"])
    return split_files(out_dir)


def write_docstring_task(corpus: dict[str, str], out_dir: str) -> None:
    for split, path in zip(("train", "validation"), split_files(out_dir)):
        rows = []
        with open(corpus[split], encoding="utf-8") as f:
            for line in f:
                source = json.loads(line)["text"]
                try:
                    tree = ast.parse(source)
                except (SyntaxError, ValueError):
                    continue
                lines = source.splitlines(keepends=True)
                for node in ast.walk(tree):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node) \
                            and len(node.body) > 1:
                        function = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno])).splitlines(True)
                        cut = node.body[0].end_lineno - node.lineno + 1  # lines through the docstring
                        rows.append(json.dumps({"prompt": "".join(function[:cut]),
                                                "completion": "".join(function[cut:])}))
        write_jsonl(path, rows)


def build_preference_task(cache_dir: str) -> tuple[str, str]:
    """The default preference set, from the docstring task's rows: prompt = signature and docstring, chosen = the
    whole body, rejected = the body cut short (its first lines, at most half of them): an answer that stops before
    the function is done. Bodies of one line (or only blank lines in the cut) are left out. A cache entry too."""
    sources = build_docstring_task(cache_dir)
    out_dir = os.path.dirname(sources[0]).replace("docstring-sft-", "docstring-dpo-")
    cached_folder(out_dir, partial(write_preference_task, sources), "the default preference task", sources[0])
    return split_files(out_dir)


def write_preference_task(sources: tuple[str, str], out_dir: str) -> None:
    rng = random.Random(0)
    for source, path in zip(sources, split_files(out_dir)):
        rows = []
        with open(source, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                body = row["completion"].splitlines(keepends=True)
                if len(body) < 2:
                    continue
                rejected = "".join(body[:rng.randint(1, len(body) // 2)])
                if rejected.strip():  # a body opening with blank lines may give none
                    rows.append(json.dumps({"prompt": row["prompt"], "chosen": row["completion"],
                                            "rejected": rejected}))
        write_jsonl(path, rows)


def split_files(folder: str) -> tuple[str, str]:
    return tuple(os.path.join(folder, f"{split}.jsonl") for split in ("train", "validation"))


def write_jsonl(path: str, rows: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:  # inside the cache entry's temporary folder
        f.write("\n".join(rows) + "\n")
