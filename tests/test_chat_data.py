"""Chat data as users write it, in every recipe that reads chats (SFT, DPO, GRPO): content in parts, extra message
keys, values of mixed types past the first 10 MB of a file or in the validation file only, and a chat template that
fails on a later row. In-process: each recipe's data function, no model."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import types

import pytest

from conftest import SCRIPTS

# a template that takes text content, as most text models' templates do (a list would render as its Python repr),
# and the message keys it may use
EACH_TURN = ("<|{{ m['role'] }}|>{{ m['content'] }}{% if m.name is defined %}({{ m.name }}){% endif %}"
             "{% if m.weight is defined %}[w{{ m.weight }}]{% endif %}<|end|>{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEMPLATES = {"text": "{% for m in messages %}" + EACH_TURN,  # and two that fail on a turn whose content is 'boom'
             "raises": "{% for m in messages %}{% if m.content == 'boom' %}{{ raise_exception('no booms here') }}"
                       "{% endif %}" + EACH_TURN,
             "undefined": "{% for m in messages %}{% if m.content == 'boom' %}{{ m.missing.attribute }}{% endif %}"
                          + EACH_TURN}
WORDS = ["alpha", "beta", "gamma", "delta", "the model", "reads", "tokens", "and", "answers"]
PADDING = "x" * (10 << 20)  # row 1 alone fills the 10 MB that datasets reads first and takes the column types from
NO_ACCELERATOR = types.SimpleNamespace(main_process_first=contextlib.nullcontext)


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RECIPES = {name: load_script(name) for name in ("finetune_causal_lm", "finetune_dpo", "finetune_grpo")}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, str]:
    """A byte-level BPE tokenizer (a few seconds) saved with the test template, and with templates failing on a row
    whose content is 'boom' (GRPO takes the tokenizer's own template; SFT and DPO take --chat_template files too)."""
    from accelerate import PartialState

    from common.inputs.data import train_bpe_tokenizer

    PartialState()  # the recipes' loggers need it
    tokenizer = train_bpe_tokenizer([" ".join(WORDS) + " <|user|> <|assistant|> <|end|>"] * 20, 300)
    folders = {}
    for name, template in TEMPLATES.items():
        folders[name] = str(tmp_path_factory.mktemp(name))
        tokenizer.chat_template = template
        tokenizer.save_pretrained(folders[name])
        with open(os.path.join(folders[name], "chat.jinja"), "w", encoding="utf-8") as f:
            f.write(template)
    return folders


def turn(role: str, texts: list[str], parts: bool) -> dict:
    """A message whose content is `texts` as text parts, or as the one string they spell (joined with a newline)."""
    return {"role": role, "content": [{"type": "text", "text": t} for t in texts] if parts else "\n".join(texts)}


def rows_for(recipe: str, count: int, parts_from: int, offset: int = 0) -> list[dict]:
    """`count` rows of the recipe's columns, in parts from row `parts_from` on; an `answer` column of numbers, then of
    text, and a padding column that pushes every row after the first past datasets' first 10 MB."""
    rows = []
    for i in range(offset, offset + count):
        parts = i - offset >= parts_from
        words = [WORDS[(i + k) % len(WORDS)] for k in range(4)]
        user, system = turn("user", words[:2], parts), turn("system", ["be brief", words[3]], parts)
        answer, other = turn("assistant", words[2:], parts), turn("assistant", [words[0]], False)
        row = {"finetune_causal_lm": {"messages": [system, user, answer]},
               "finetune_dpo": {"prompt": [system, user], "chosen": [answer], "rejected": [other]},
               "finetune_grpo": {"prompt": [system, user]}}[recipe]
        rows.append({**row, "answer": i if i < offset + 3 else f"#{i}", "padding": PADDING if i == offset else ""})
    return rows


def write(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def load(recipe: str, tokenizer: str, train: str, validation: str, tmp_path, chat_template: str | None = None):
    """The recipe's data function as the recipe calls it: (raw splits or None, tokenized splits)."""
    script = RECIPES[recipe]
    argv = ["--model_name_or_path", tokenizer, "--train_file", train, "--validation_file", validation,
            "--output_dir", str(tmp_path / "out"), "--cache_dir", str(tmp_path / "cache")]
    argv += ["--chat_template", chat_template] if chat_template else []
    if recipe == "finetune_grpo":
        from common.inputs.prompts import load_prompt_data

        tmp_path.mkdir(parents=True, exist_ok=True)
        (tmp_path / "rewards.py").write_text("def unused(prompts, completions, **columns):\n    return []\n")
        args = script.parse_args(argv + ["--reward_funcs", f"{tmp_path / 'rewards.py'}:unused",
                                         "--max_completion_length", "8"])
        _, raw, data = load_prompt_data(args, NO_ACCELERATOR, None, None)
        return raw, data
    args = script.parse_args(argv)
    if recipe == "finetune_causal_lm":
        return None, script.load_sft_data(args, NO_ACCELERATOR, None, None)[1]
    return None, script.load_preference_data(args, NO_ACCELERATOR, None, None)[1]


TOKENS = {"finetune_causal_lm": ("input_ids", "labels"), "finetune_dpo": ("prompt_ids", "chosen_ids", "rejected_ids"),
          "finetune_grpo": ("prompt_ids",)}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_row_in_parts_trains_as_the_same_row_written_as_text(tokenizers, tmp_path, recipe):
    """Content in text parts (`[{"type": "text", "text": ...}]`) in some rows only, past the first 10 MB of the train
    file and in the validation file: `datasets` cast them to the first rows' types and the recipes trained them as JSON
    text (or the template got a Python list). Each message in parts is now the text its parts spell, joined with a
    newline: the token ids (and labels) of every row equal those of the same rows written as text, so the losses do
    too. And no column reaches a recipe in another type than the file holds (GRPO's `answer`: numbers, then text)."""
    text_rows, parts_rows = {}, {}
    for split, offset in (("train", 0), ("validation", 10)):
        text_rows[split] = write(tmp_path / f"text-{split}.jsonl", rows_for(recipe, 6, 6, offset))
        parts_rows[split] = write(tmp_path / f"parts-{split}.jsonl", rows_for(recipe, 6, 2, offset))
    as_text = load(recipe, tokenizers["text"], text_rows["train"], text_rows["validation"], tmp_path / "a")[1]
    raw, in_parts = load(recipe, tokenizers["text"], parts_rows["train"], parts_rows["validation"], tmp_path / "b")
    for split in ("train", "validation"):
        assert len(in_parts[split]) == 6
        for column in TOKENS[recipe]:
            assert in_parts[split][column] == as_text[split][column], (split, column)
    if raw is not None:  # the other columns reach the reward functions as the file holds them
        for split in ("train", "validation"):
            with open(parts_rows[split], encoding="utf-8") as f:
                assert raw[split]["answer"] == [json.loads(line)["answer"] for line in f]


@pytest.mark.parametrize("recipe,column", [("finetune_causal_lm", "messages"), ("finetune_dpo", "chosen"),
                                           ("finetune_dpo", "prompt"), ("finetune_grpo", "prompt")])
def test_a_part_a_text_model_cannot_take_is_one_line_naming_the_row(capsys, tmp_path, recipe, column):
    """An image part for a text-only model: one line naming the file, the row and the turn, before the tokenizer
    loads (exit status 2). DPO's line named a prompt's part as in 'chosen', and counted a response's turns after the
    prompt's."""
    rows = rows_for(recipe, 3, 1)
    rows[2][column][0]["content"] = [{"type": "text", "text": "what is this?"},
                                     {"type": "image_url", "image_url": {"url": "cat.png"}}]
    train = write(tmp_path / "train.jsonl", rows_for(recipe, 2, 0))
    validation = write(tmp_path / "validation.jsonl", rows)
    with pytest.raises(SystemExit) as exc:
        load(recipe, "unused", train, validation, tmp_path)
    assert exc.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --validation_file {validation}: row 3 has a part of type 'image_url' in turn 1 of "
                      f"'{column}': the recipes train text-only models, which take text parts only "
                      '({"type": "text", "text": ...})'], errors


def test_a_preference_rows_problem_names_the_column_and_turn_it_is_in():
    """DPO checks a prompt's turns and a response's as one conversation: a problem in the prompt was named as in
    'chosen', and a response's turns were counted after the prompt's."""
    from common.inputs.pairs import pair_problem

    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "alpha"}]
    row = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "beta"}],
           "rejected": [{"role": "assistant", "content": 3}]}
    assert pair_problem(row, "prompt", "chosen", "rejected") == \
        "has content 3 in turn 1 of 'rejected': give text or a list of text parts"
    row["prompt"] = prompt[:1] + [{"role": "human", "content": "alpha"}]
    assert pair_problem(row, "prompt", "chosen", "rejected") == \
        "has role 'human' in turn 2 of 'prompt' (the roles are system, user, assistant, tool)"


def test_extra_message_keys_reach_the_template_as_the_file_holds_them(tokenizers, tmp_path):
    """`name`, `weight`, `tool_calls` in the validation file's messages only: `datasets` stopped with "cannot read
    ...: Couldn't cast array of type" (no file, row or key). Each message now reaches the template with exactly its
    own keys: none missing, none added as None to the others."""
    from common.inputs.data import HeldOut, Source, load_raw_datasets

    rows = rows_for("finetune_causal_lm", 3, 3)
    train = write(tmp_path / "train.jsonl", rows)
    rows[1]["messages"][1]["name"] = "bob"
    rows[1]["messages"][2].update(weight=0, tool_calls=[{"type": "function", "function": {"name": "f",
                                                                                          "arguments": {"x": 1}}}])
    validation = write(tmp_path / "validation.jsonl", rows)
    script = RECIPES["finetune_causal_lm"]
    args = script.parse_args(["--model_name_or_path", tokenizers["text"], "--train_file", train, "--validation_file",
                              validation, "--output_dir", str(tmp_path / "out"), "--cache_dir", str(tmp_path / "c")])
    raw = load_raw_datasets(Source.from_flags(args), HeldOut.from_flags(args), args.cache_dir, columns={})
    assert raw["validation"]["messages"] == [row["messages"] for row in rows]
    assert raw["train"]["messages"][1] == [{k: v for k, v in m.items() if k not in ("name", "weight", "tool_calls")}
                                           for m in rows[1]["messages"]]
    tokenizer, data = script.load_sft_data(args, NO_ACCELERATOR, None, None)
    texts = [tokenizer.decode(ids) for ids in data["validation"]["input_ids"]]
    assert "(bob)" in texts[1] and "[w0]" in texts[1] and not any("(" in t or "[w" in t for t in texts[::2])


def test_a_value_no_column_type_keeps_is_one_line_naming_file_row_and_column(capsys, tmp_path):
    """Where a file truly cannot be read as it holds its values: a column of numbers with the text "3" in it (a
    column of mixed kinds is kept as JSON, and text that is itself JSON would come back as the number it spells). One
    line naming the file, the row and the column."""
    from common.inputs.data import HeldOut, Source, load_raw_datasets

    rows = rows_for("finetune_grpo", 3, 3)
    train = write(tmp_path / "train.jsonl", rows)
    validation = write(tmp_path / "validation.jsonl", rows[:1] + [{**rows[1], "answer": "3"}])
    args = RECIPES["finetune_causal_lm"].parse_args([
        "--model_name_or_path", "unused", "--train_file", train, "--validation_file", validation, "--output_dir",
        str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exc:
        load_raw_datasets(Source.from_flags(args), HeldOut.from_flags(args), args.cache_dir, columns={})
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --validation_file {validation}: row 2 has '3' in 'answer', text that is also JSON, where other rows "
        "hold int: it would be read as the value it spells; give the column one kind of value")


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("failure,message", [("raises", "no booms here"),
                                             ("undefined", "'dict object' has no attribute 'missing'")])
def test_a_template_failing_on_a_later_row_is_one_line_naming_it(capsys, tokenizers, tmp_path, recipe, failure,
                                                                  message):
    """A template that fails on row 3 of the validation file (its own `raise_exception`, an undefined attribute):
    jinja2's traceback of some 65 lines, status 1. One line naming the template, the file, the row and the
    template's message, status 2, in each recipe (GRPO: the tokenizer's own template)."""
    train = write(tmp_path / "train.jsonl", rows_for(recipe, 4, 4))
    rows = rows_for(recipe, 4, 4, offset=10)
    rows[2]["prompt" if recipe != "finetune_causal_lm" else "messages"][1]["content"] = "boom"
    validation = write(tmp_path / "validation.jsonl", rows)
    chat = None if recipe == "finetune_grpo" else os.path.join(tokenizers[failure], "chat.jinja")
    with pytest.raises(SystemExit) as exc:
        load(recipe, tokenizers["text" if chat else failure], train, validation, tmp_path, chat_template=chat)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    template = f"--chat_template {chat}" if chat else f"the chat template of {tokenizers[failure]}"
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: {template} fails on row 3 of --validation_file {validation}: {message}"], err
    assert "Traceback" not in err
