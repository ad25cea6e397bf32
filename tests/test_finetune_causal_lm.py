"""Supervised fine-tuning: the exact token-mean loss under accumulation, processes and packing; prompt masking.

The data has widely varying prompt and response lengths, the case where the naive `loss / accumulation_steps`
goes wrong. Tolerances: the same weights within WEIGHT_TOL (float32 summation order), and the naive version is
shown, on the same data and model, to move the weights by more than 100 x WEIGHT_TOL away from the full batch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import random
import sys

import pytest
import torch
from conftest import SCRIPTS, launcher, read_metrics, run_script, train_losses, write_tiny_llama_task
from safetensors.torch import load_file

WEIGHT_TOL = 1e-5
LR = "1e-3"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> dict[str, str]:
    """A tiny Llama with its own byte-level BPE tokenizer, and prompt/completion data of very uneven lengths."""
    d = tmp_path_factory.mktemp("sft")
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    rows = []
    for _ in range(80):
        prompt = "Q: " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 60))) + "\nA:"
        completion = " " + " ".join(rng.choice(words) for _ in range(rng.choice([1, 2, 3, 40, 80])))
        rows.append({"prompt": prompt, "completion": completion})
    return write_tiny_llama_task(d, rows, [r["prompt"] + r["completion"] for r in rows], max_positions=512)


def finetune(sft: dict, out: str, *args: str, launcher: list[str] | None = None) -> str:
    run_script("finetune_causal_lm.py", "--model_name_or_path", sft["model"], "--train_file", sft["train"],
               "--validation_file", sft["validation"], "--output_dir", out, "--max_steps", "3", "--learning_rate", LR,
               "--logging_steps", "1", "--seed", "0", *args, launcher=launcher)
    return out


def weights(folder: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "model.safetensors"))


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_prompt_tokens_are_masked_and_eos_is_learned(sft):
    ft = load_script("finetune_causal_lm")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sft["model"])
    prompt, completion = "Q: alpha beta\nA:", " gamma delta"
    ids, labels = ft.tokenize_with_response_labels(tokenizer, prompt + completion,
                                                   [(len(prompt), len(prompt + completion))], plain_text=True)
    learned = [t for t in labels if t != -100]
    assert tokenizer.decode(learned[:-1]) == completion and learned[-1] == tokenizer.eos_token_id
    assert tokenizer.decode([t for t, label in zip(ids, labels) if label == -100]) == prompt


def test_chat_template_trains_on_assistant_turns_only(sft):
    ft = load_script("finetune_causal_lm")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sft["model"])
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "alpha?"},
                {"role": "assistant", "content": "beta"}, {"role": "user", "content": "gamma?"},
                {"role": "assistant", "content": "delta delta"}]
    text, spans = ft.render_chat(tokenizer, messages)
    assert [text[a:b] for a, b in spans] == ["beta<|endoftext|>", "delta delta<|endoftext|>"]
    ids, labels = ft.tokenize_with_response_labels(tokenizer, text, spans, plain_text=False)
    assert len(ids) == len(labels) and ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode([t for t in labels if t != -100]) == "beta<|endoftext|>delta delta<|endoftext|>"


def test_exact_loss_equals_full_batch_and_naive_does_not(sft):
    """In-process, on the script's own tokenization: 4 micro-batches of 2 vs one batch of 8, three AdamW steps."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq

    from common.accumulation import backward_loss, count_label_tokens

    ft = load_script("finetune_causal_lm")
    tokenizer = AutoTokenizer.from_pretrained(sft["model"])
    collate = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)
    with open(sft["train"]) as f:
        rows = [json.loads(line) for line in f][:24]
    examples = []
    for r in rows:
        text = r["prompt"] + r["completion"]
        ids, labels = ft.tokenize_with_response_labels(tokenizer, text, [(len(r["prompt"]), len(text))], True)
        examples.append({"input_ids": ids, "labels": labels})
    counts = [sum(label != -100 for label in e["labels"][1:]) for e in examples]
    assert max(counts) > 10 * min(counts)  # the lengths really are uneven

    def train(mode: str) -> dict[str, torch.Tensor]:
        ga = 1 if mode == "full" else 4
        AcceleratorState._reset_state(True)  # a process-wide singleton: an earlier test's (bf16, say) would be kept
        GradientState._reset_state()
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ga)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(sft["model"], dtype=torch.float32)
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=float(LR)))
        for step in range(3):
            chunk = examples[8 * step:8 * step + 8]
            window = [collate(chunk)] if mode == "full" else [collate(chunk[i:i + 2]) for i in range(0, 8, 2)]
            num_items = count_label_tokens(window, accelerator)
            for batch in window:
                with accelerator.accumulate(model):
                    if mode == "naive":  # the model's mean over this micro-batch, divided by accumulate()
                        loss = model(**batch).loss
                    else:
                        loss, _ = backward_loss(model(**batch, num_items_in_batch=num_items), accelerator)
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    full, exact, naive = train("full"), train("exact"), train("naive")
    assert max_difference(exact, full) < WEIGHT_TOL
    assert max_difference(naive, full) > 100 * WEIGHT_TOL


def test_accumulation_processes_and_packing_give_the_same_weights(sft):
    """8 x 1, 2 x 4, 2 processes x 2 x 2 and packed 2 x 4 train on the same examples per step: same weights."""
    d = sft["dir"]
    reference = weights(finetune(sft, f"{d}/b8", "--per_device_train_batch_size", "8"))
    runs = {
        "2x4": finetune(sft, f"{d}/b2ga4", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4"),
        "packed 2x4": finetune(sft, f"{d}/packed", "--per_device_train_batch_size", "2",
                               "--gradient_accumulation_steps", "4", "--packing"),
        "2 processes x 2 x 2": finetune(
            sft, f"{d}/ddp", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
            launcher=[os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--multi_gpu",
                      "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                      "--dynamo_backend", "no"]),
    }
    reference_losses = train_losses(f"{d}/b8")
    assert len(reference_losses) == 3
    for name, out in runs.items():
        assert max_difference(weights(out), reference) < WEIGHT_TOL, name
        assert train_losses(out) == pytest.approx(reference_losses, abs=1e-5), name
    packed_rows = [r for r in read_metrics(runs["packed 2x4"]) if "loss" in r]
    assert all(r["padding_fraction"] == 0.0 for r in packed_rows)
    with open(os.path.join(runs["2 processes x 2 x 2"], "all_results.json")) as f:
        assert json.load(f)["num_processes"] == 2


def test_zero3_run_ends_like_the_one_process_run(sft):
    """ZeRO-3 over 2 processes x 2 x 2 (parameters partitioned), packed, with the default end of run: the same losses,
    final evaluation and exported weights as one unpacked process with 8, and the full parameter counts. (The packing
    check runs on the partitioned model, the processes gathering its parameters together.)"""
    d = sft["dir"]
    reference = finetune(sft, f"{d}/zero3_reference", "--per_device_train_batch_size", "8")
    zero3 = finetune(sft, f"{d}/zero3", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                     "--packing", launcher=launcher("deepspeed_zero3.yaml"))
    results = {}
    for name, out in (("zero3", zero3), ("reference", reference)):
        with open(os.path.join(out, "all_results.json")) as f:
            results[name] = json.load(f)
    assert results["zero3"]["num_processes"] == 2
    for key in ("num_parameters", "trainable_parameters", "eval_tokens"):
        assert results["zero3"][key] == results["reference"][key], key
    assert results["zero3"]["eval_loss"] == pytest.approx(results["reference"]["eval_loss"], rel=1e-5)
    assert train_losses(zero3) == pytest.approx(train_losses(reference), abs=1e-5)
    assert all(r["padding_fraction"] == 0.0 for r in read_metrics(zero3) if "loss" in r)
    difference = max_difference(weights(zero3), weights(reference))
    print(f"ZeRO-3: {results['zero3']['num_parameters']} parameters, max weight difference {difference:.1e}")
    assert difference < WEIGHT_TOL


def test_packing_check_refuses_a_model_whose_packed_examples_attend_to_each_other(sft, capsys):
    """The check before a packed run: the script's model passes; one that ignores the position ids (so nothing marks
    where a packed example starts) is stopped with one line, on the prepared model as the script calls it."""
    from accelerate import Accelerator
    from transformers import LlamaForCausalLM

    class IgnoresPositions(LlamaForCausalLM):
        def forward(self, input_ids=None, position_ids=None, **kwargs):
            return super().forward(input_ids=input_ids, **kwargs)

    check_packing = load_script("finetune_causal_lm").check_packing
    accelerator = Accelerator(cpu=True)
    check_packing(accelerator, accelerator.prepare(LlamaForCausalLM.from_pretrained(sft["model"])))
    with pytest.raises(SystemExit) as stopped:
        check_packing(accelerator, accelerator.prepare(IgnoresPositions.from_pretrained(sft["model"])))
    assert stopped.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: --packing: IgnoresPositions with attn_implementation=sdpa lets packed examples")


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_pretrain_then_finetune_on_chat_turns(corpus, tmp_path):
    """The tutorial path: fine-tune the folder pretrain_llama.py exports, on chat data with a template file, with
    frozen embeddings. The evaluation counts exactly the assistant tokens (content + end-of-turn)."""
    from transformers import AutoTokenizer

    pretrained = str(tmp_path / "pretrain")
    run_script("pretrain_llama.py", "--train_file", corpus["train"], "--validation_file", corpus["validation"],
               "--tokenizer_vocab_size", "512", "--block_size", "64", "--cache_dir", str(tmp_path / "cache"),
               "--output_dir", pretrained, "--max_steps", "2", "--sample_max_new_tokens", "0")
    rng = random.Random(0)
    words = "the model reads tokens and learns to predict".split()
    say = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))  # noqa: E731
    paths = {}
    for split, n in (("train", 32), ("validation", 8)):
        paths[split] = tmp_path / f"chat_{split}.jsonl"
        with open(paths[split], "w") as f:
            for i in range(n):
                turns = [{"role": "user", "content": say()}, {"role": "assistant", "content": say()}]
                turns += [{"role": "user", "content": say()}, {"role": "assistant", "content": say()}] if i % 2 else []
                f.write(json.dumps({"messages": turns}) + "\n")
    (tmp_path / "chat.jinja").write_text(CHAT_TEMPLATE)
    out = str(tmp_path / "sft")
    run_script("finetune_causal_lm.py", "--model_name_or_path", pretrained, "--train_file", str(paths["train"]),
               "--validation_file", str(paths["validation"]), "--chat_template", str(tmp_path / "chat.jinja"),
               "--output_dir", out, "--max_steps", "2", "--per_device_train_batch_size", "4", "--freeze_embeddings")
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == CHAT_TEMPLATE  # exported with the model
    with open(paths["validation"]) as f:
        conversations = [json.loads(line)["messages"] for line in f]
    expected = sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) + 1  # + <|endoftext|>
                   for turns in conversations for m in turns if m["role"] == "assistant")
    with open(os.path.join(out, "all_results.json")) as f:
        r = json.load(f)
    assert r["eval_tokens"] == expected
    # --freeze_embeddings on a decoder: the input embedding keeps every bit, the (untied) output head trains.
    before, after = weights(pretrained), weights(out)
    assert torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert not torch.equal(before["lm_head.weight"], after["lm_head.weight"])
    assert r["trainable_parameters"] == r["num_parameters"] - before["model.embed_tokens.weight"].numel()


def test_resume_with_length_grouped_batches_continues_the_run(sft):
    """Length-grouped batches are reshuffled per epoch from the seed: a run resumed in its second epoch (step 5 of 8,
    4 steps per epoch) logs the same losses and ends with the same weights as the uninterrupted run."""
    d = sft["dir"]
    common = ("--max_steps", "8", "--max_train_samples", "16", "--per_device_train_batch_size", "2",
              "--gradient_accumulation_steps", "2", "--group_by_length")
    full = finetune(sft, f"{d}/grouped", *common, "--checkpointing_steps", "5")
    resumed = finetune(sft, f"{d}/grouped_resumed", *common,
                       "--resume_from_checkpoint", f"{full}/checkpoints/step_5")
    assert train_losses(resumed) == pytest.approx({s: v for s, v in train_losses(full).items() if s > 5}, abs=1e-6)
    assert max_difference(weights(resumed), weights(full)) < 1e-6


def test_a_copy_without_its_features_trains_exactly_as_the_original(sft, tmp_path):
    """tools/copy_recipe.py removes every `# feature:` line (LoRA, chunked loss, checksums, ...): the copy imports
    no feature and trains bit for bit as the original does without those flags."""
    from tools.copy_recipe import common_modules, strip_features

    copy = tmp_path / "my_sft.py"
    copy.write_text(strip_features(open(os.path.join(SCRIPTS, "finetune_causal_lm.py")).read()))
    assert not any(".features" in name for name in common_modules(copy.read_text()))
    original = finetune(sft, str(tmp_path / "original"), "--gradient_accumulation_steps", "2")
    run_script(str(copy), "--model_name_or_path", sft["model"], "--train_file", sft["train"],
               "--validation_file", sft["validation"], "--output_dir", str(tmp_path / "copy"), "--max_steps", "3",
               "--learning_rate", LR, "--logging_steps", "1", "--seed", "0", "--gradient_accumulation_steps", "2",
               env={"PYTHONPATH": os.path.dirname(SCRIPTS)})
    assert train_losses(str(tmp_path / "copy")) == train_losses(original)
    assert max_difference(weights(str(tmp_path / "copy")), weights(original)) == 0


@pytest.mark.parametrize("rows,problem", [
    ({"train": [{"prompt": "Q: alpha\nA:", "completion": " beta"}] * 5 + [{"prompt": "Q: gamma\nA:"}]},
     "--train_file {train}: row 6 has no 'completion' text"),
    ({"train": [{"messages": [{"role": "user", "content": "alpha"}, {"role": "assistant", "content": "beta"}]},
                {"messages": [{"role": "human", "content": "alpha"}, {"role": "assistant", "content": "beta"}]}]},
     "--train_file {train}: row 2 has role 'human' in turn 1 of 'messages' (the roles are system, user, assistant, tool)"),
    ({"validation": [{"messages": [{"role": "user", "content": "alpha"}, {"role": "assistant", "content": "beta"}]},
                     {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "alpha"}]}]},
     "--validation_file {validation}: row 2 has no assistant turn: nothing in it to learn"),
], ids=["missing-completion", "unknown-role", "no-assistant-turn"])
def test_rows_that_cannot_be_trained_on_are_one_line_naming_the_row(sft, tmp_path, capsys, rows, problem):
    """In-process, as the script loads its data, before any tokenizing. A JSON row without `completion` among good
    rows stopped the tokenizing with a TypeError; a chat turn of an unknown role was trained on, and a conversation
    without an assistant turn was dropped as if "their prompt fills --max_seq_length"."""
    from accelerate import Accelerator

    from common.inputs.modeling import load_finetuning_config

    ft = load_script("finetune_causal_lm")
    chat = "messages" in next(iter(rows.values()))[0]
    good = [{"messages": [{"role": "user", "content": "alpha"}, {"role": "assistant", "content": "beta"}]}] * 4 \
        if chat else [{"prompt": "Q: alpha\nA:", "completion": " beta"}] * 4
    files = {}
    for split in ("train", "validation"):
        files[split] = tmp_path / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(row) + "\n" for row in rows.get(split, good)))
    (tmp_path / "chat.jinja").write_text(CHAT_TEMPLATE)
    args = ft.parse_args(["--model_name_or_path", sft["model"], "--train_file", str(files["train"]),
                          "--validation_file", str(files["validation"]), "--chat_template",
                          str(tmp_path / "chat.jinja"), "--output_dir", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exc:
        ft.load_sft_data(args, Accelerator(cpu=True), load_finetuning_config(args), None)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if line.startswith("error:")] == [f"error: {problem.format(**files)}"], err
    assert not any("Tokenizing" in line for line in err)


NOT_THE_RUNS = ("Warning", "LOAD REPORT", "\x1b[", "use_cache", "deprecated")


def test_a_run_prints_nothing_that_is_not_its_own(sft, tmp_path):
    """SFT with LoRA, checkpointing and length grouping, and the classifier on a pretrained encoder with a new head:
    no upstream FutureWarning (peft's is_gradient_checkpointing, pyarrow's null_placement), no LOAD REPORT table
    with terminal escape codes, no use_cache notice; the classifier names its new head in one line instead."""
    proc = run_script("finetune_causal_lm.py", "--model_name_or_path", sft["model"], "--train_file", sft["train"],
                      "--validation_file", sft["validation"], "--output_dir", str(tmp_path / "sft"), "--max_steps",
                      "2", "--use_peft", "--gradient_checkpointing", "--group_by_length")
    noise = [line for line in proc.stderr.splitlines() if any(word in line for word in NOT_THE_RUNS)]
    assert not noise, noise
    finals = [frame.split(" [")[0] for frame in re.split(r"[\r\n]", proc.stderr)
              if " 100%|" in frame and not frame.startswith("train")]  # data and loading bars' last frames
    assert finals and len(finals) == len(set(finals)), finals  # each bar's last frame once
    from transformers import BertConfig, BertForMaskedLM, PreTrainedTokenizerFast

    encoder = tmp_path / "encoder"
    BertForMaskedLM(BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               vocab_size=len(PreTrainedTokenizerFast.from_pretrained(sft["model"])))
                    ).save_pretrained(encoder)
    PreTrainedTokenizerFast.from_pretrained(sft["model"]).save_pretrained(encoder)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"text": "row {i}", "label": "{"ab"[i % 2]}"}}\n' for i in range(16)))
    proc = run_script("finetune_classifier.py", "--model_name_or_path", str(encoder), "--train_file", str(rows),
                      "--validation_file", str(rows), "--output_dir", str(tmp_path / "cls"), "--max_steps", "2",
                      "--gradient_checkpointing")
    noise = [line for line in proc.stderr.splitlines() if any(word in line for word in NOT_THE_RUNS)]
    assert not noise, noise
    # a masked LM has no pooler and a prediction head the classifier does not use
    assert (f"4 weights not in {encoder} (new, initialised here): bert.pooler.dense.bias, bert.pooler.dense.weight, "
            "classifier.bias, classifier.weight") in proc.stderr
    assert f"5 weights not in {encoder} (unused): cls.predictions.bias, " in proc.stderr
