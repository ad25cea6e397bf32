"""Preference training (scripts/finetune_dpo.py): the tokenization, each loss and its gradient against a plain-torch
computation written here, the exact loss under accumulation and processes, the three references equal where they
must be, and learning on held-out pairs of the built-in task.

Tolerances: float32 throughout; a loss and its gradient computed two ways agree to 1e-6 (summation order); weights
after 3 AdamW steps to WEIGHT_TOL = 1e-5 (as tests/test_finetune_causal_lm.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import SCRIPTS, launcher, read_metrics, run_script, train_losses
from safetensors.torch import load_file
from test_finetune_causal_lm import load_script, max_difference

from common.inputs.pairs import PairCollator, tokenize_pairs
from common.inputs.responses import tokenize_prompt_and_responses

WEIGHT_TOL = 1e-5
LR = "1e-3"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def dpo(tmp_path_factory) -> dict[str, str]:
    """A tiny Llama with its own byte-level BPE tokenizer (dropout in its attention, which the recipe turns off), and
    prompt/chosen/rejected rows of very uneven lengths."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.inputs.data import train_bpe_tokenizer

    d = tmp_path_factory.mktemp("dpo")
    rng = random.Random(0)

    def text(*lengths) -> str:
        return " " + " ".join(rng.choice(WORDS) for _ in range(rng.choice(lengths)))

    rows = [{"prompt": "Q:" + text(*range(1, 40)) + "\nA:", "chosen": text(1, 2, 3, 20, 40),
             "rejected": text(1, 2, 5, 30)} for _ in range(48)]
    paths = {"dir": str(d)}
    for split, part in (("train", rows[:40]), ("validation", rows[40:])):
        paths[split] = str(d / f"{split}.jsonl")
        with open(paths[split], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    tokenizer = train_bpe_tokenizer([r["prompt"] + r["chosen"] + r["rejected"] for r in rows], 300)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         attention_dropout=0.1, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    paths["model"] = str(d / "base")
    LlamaForCausalLM(config).save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    return paths


def rows_of(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def train_dpo(dpo: dict, out: str, *args: str, launcher: list[str] | None = None, steps: int = 3) -> str:
    run_script("finetune_dpo.py", "--model_name_or_path", dpo["model"], "--train_file", dpo["train"],
               "--validation_file", dpo["validation"], "--output_dir", out, "--max_steps", str(steps),
               "--learning_rate", LR, "--logging_steps", "1", "--seed", "0", *args, launcher=launcher)
    return out


def weights(folder: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "model.safetensors"))


def plain_sequence_logps(model, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """One unpadded sequence through the model alone: the summed log-probability of its response tokens."""
    ids = torch.tensor([prompt_ids + response_ids])
    log_probs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    predicted = log_probs[torch.arange(ids.shape[1] - 1), ids[0, 1:]]
    return predicted[len(prompt_ids) - 1:].sum()


def plain_dpo_loss(policy, reference, tokenizer, rows: list[dict], beta: float, loss_type: str) -> torch.Tensor:
    """The mean over the pairs of TRL's losses, one sequence at a time (prompt tokens alone, response tokens
    appended, EOS after each response)."""
    losses = []
    for row in rows:
        prompt = tokenizer(row["prompt"])["input_ids"]
        ratios = []
        for key in ("chosen", "rejected"):
            response = tokenizer(row[key], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            with torch.no_grad():
                ref = plain_sequence_logps(reference, prompt, response)
            ratio = plain_sequence_logps(policy, prompt, response) - ref
            ratios.append(ratio / len(response) if loss_type == "ipo" else ratio)
        delta = ratios[0] - ratios[1]
        losses.append({"sigmoid": lambda: -F.logsigmoid(beta * delta), "hinge": lambda: torch.relu(1 - beta * delta),
                       "ipo": lambda: (delta - 1 / (2 * beta)) ** 2}[loss_type]())
    return torch.stack(losses).mean()


def test_prompt_tokens_are_the_prompts_alone_and_padding_is_right(dpo):
    """Prompt ids = the prompt tokenized alone; each response's ids follow, then EOS; labels -100 on the prompt and
    the padding; chosen rows first; right padding; chat turns: the prompt's rendering, then what each turn adds."""
    dpo_script = load_script("finetune_dpo")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(dpo["model"])
    rows = rows_of(dpo["train"])[:3]
    columns = {key: [r[key] for r in rows] for key in ("prompt", "chosen", "rejected")}
    pairs = tokenize_pairs(columns, [0, 1, 2], tokenizer, 512, ("prompt", "chosen", "rejected"))
    collate = PairCollator(tokenizer.pad_token_id, 8)
    batch = collate([{k: v[i] for k, v in pairs.items()} for i in range(3)])
    assert batch["input_ids"].shape[0] == 6 and batch["input_ids"].shape[1] % 8 == 0
    for i, (row, key) in enumerate([(r, k) for k in ("chosen", "rejected") for r in rows]):
        prompt = tokenizer(row["prompt"])["input_ids"]
        response = tokenizer(row[key], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        n = len(prompt) + len(response)
        assert batch["input_ids"][i, :n].tolist() == prompt + response
        assert batch["labels"][i].tolist() == [-100] * len(prompt) + response + [-100] * (batch["labels"].shape[1] - n)
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (batch["labels"].shape[1] - n)
    tokenizer.chat_template = CHAT_TEMPLATE
    prompt_turns = [{"role": "user", "content": "alpha?"}]
    prompt_ids, (chosen, rejected) = tokenize_prompt_and_responses(
        tokenizer, prompt_turns, [[{"role": "assistant", "content": "beta"}], [{"role": "assistant", "content": "mu"}]])
    assert tokenizer.decode(prompt_ids) == "<|user|>alpha?<|endoftext|><|assistant|>"
    assert tokenizer.decode(chosen) == "beta<|endoftext|>" and tokenizer.decode(rejected) == "mu<|endoftext|>"


def tokenizer_policy_and_reference(dpo: dict):
    """The tokenizer, a policy a little away from the reference (one noisy copy: log-ratios not all zero), and the
    reference, both float32 in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(dpo["model"])
    policy = AutoModelForCausalLM.from_pretrained(dpo["model"], dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(dpo["model"], dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return tokenizer, policy, reference


def pair_examples(dpo_script, tokenizer, rows: list[dict]) -> list[dict]:
    """The recipe's tokenized pairs of `rows`, one example each (what its collator takes)."""
    columns = {key: [r[key] for r in rows] for key in ("prompt", "chosen", "rejected")}
    pairs = tokenize_pairs(columns, list(range(len(rows))), tokenizer, 512, ("prompt", "chosen", "rejected"))
    return [{k: v[i] for k, v in pairs.items()} for i in range(len(rows))]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_loss_and_gradient_equal_a_plain_torch_computation(dpo, loss_type):
    """The recipe's padded 2B-row forward and loss (`dpo_forward`, with the window's pair count), against the plain
    computation above: the same loss and the same gradient of every weight, to 1e-6 (relative where they exceed
    1)."""
    dpo_script = load_script("finetune_dpo")
    tokenizer, policy, reference = tokenizer_policy_and_reference(dpo)
    rows = rows_of(dpo["train"])[:6]
    examples = pair_examples(dpo_script, tokenizer, rows)
    collate = PairCollator(tokenizer.pad_token_id, 8)
    args = type("Args", (), {"beta": 0.1, "loss_type": loss_type})
    num_items = torch.tensor(6)
    forward = lambda batch: dpo_script.sequence_logps(reference, batch)[0]  # noqa: E731
    loss = sum(dpo_script.dpo_forward(policy, forward, collate(examples[i:i + 3]), args, num_items).loss
               for i in (0, 3))  # two micro-batches of 3 pairs: each divided by the window's 6
    loss.backward()
    grads = {name: p.grad.clone() for name, p in policy.named_parameters()}
    policy.zero_grad()
    expected = plain_dpo_loss(policy, reference, tokenizer, rows, 0.1, loss_type)
    expected.backward()
    scale = max(g.abs().max().item() for g in grads.values())
    assert scale > 1e-3 and expected.item() != pytest.approx(0.6931, abs=1e-3)  # real log-ratios and gradients
    assert abs(loss.item() - expected.item()) <= 1e-6 * max(1.0, abs(expected.item()))  # relative above 1
    assert max((grads[n] - p.grad).abs().max().item() for n, p in policy.named_parameters()) <= 1e-6 * max(1.0, scale)


def test_chunked_head_gives_the_same_loss_and_gradient(dpo):
    """--chunked_cross_entropy: the sequence log-probabilities come from torch's chunked F.linear_cross_entropy
    (per-token losses, summed per row in fp32) through the head module's own forward, never the full logits. The
    loss and every weight's gradient equal the unchunked ones to 1e-6, for the policy and for a frozen reference."""
    import copy

    dpo_script = load_script("finetune_dpo")
    from common.features.chunked_loss import use_chunked_loss

    tokenizer, policy, reference = tokenizer_policy_and_reference(dpo)
    chunked_policy, chunked_reference = copy.deepcopy(policy), copy.deepcopy(reference)
    use_chunked_loss(chunked_policy)
    use_chunked_loss(chunked_reference)
    examples = pair_examples(dpo_script, tokenizer, rows_of(dpo["train"])[:6])
    batch = PairCollator(tokenizer.pad_token_id, 8)(examples)
    results = []
    for model, ref, chunked in ((policy, reference, False), (chunked_policy, chunked_reference, True)):
        args = argparse.Namespace(beta=0.1, loss_type="sigmoid", chunked_cross_entropy=chunked)
        forward = lambda b: dpo_script.sequence_logps(ref, b, chunked)[0]  # noqa: E731
        outputs = dpo_script.dpo_forward(model, forward, batch, args, torch.tensor(6))
        outputs.loss.backward()
        results.append((outputs.loss.item(), outputs.figures, {n: p.grad for n, p in model.named_parameters()}))
    (loss, figures, grads), (chunked_loss, chunked_figures, chunked_grads) = results
    scale = max(g.abs().max().item() for g in grads.values())
    assert scale > 1e-3 and loss != pytest.approx(0.6931, abs=1e-3)  # real log-ratios and gradients
    assert abs(chunked_loss - loss) <= 1e-6
    assert (chunked_figures - figures).abs().max().item() <= 1e-4  # log-probabilities: sums of ~100 tokens, ~50
    assert max((chunked_grads[n] - g).abs().max().item() for n, g in grads.items()) <= 1e-6 * max(1.0, scale)


def test_first_step_loss_and_gradient_equal_a_plain_torch_computation(dpo, tmp_path):
    """The recipe's step 1 on the whole training set in one batch: its logged loss and its gradient equal the plain
    computation's. The gradient is read from the exported weights: AdamW's first update is lr * g / (|g| + eps), so
    with eps = lr = 1e6 (no weight decay, no clipping, a constant rate) it is g itself to ~1e-7 relative."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = train_dpo(dpo, str(tmp_path / "step1"), "--per_device_train_batch_size", "40", "--learning_rate", "1e6",
                    "--adam_epsilon", "1e6", "--max_grad_norm", "0", "--lr_scheduler_type", "constant",
                    "--warmup_steps", "0", steps=1)
    tokenizer = AutoTokenizer.from_pretrained(dpo["model"])
    policy = AutoModelForCausalLM.from_pretrained(dpo["model"], dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(dpo["model"], dtype=torch.float32).eval()
    expected = plain_dpo_loss(policy, reference, tokenizer, rows_of(dpo["train"]), 0.1, "sigmoid")
    expected.backward()
    [row] = [r for r in read_metrics(out) if "loss" in r]
    assert row["loss"] == pytest.approx(expected.item(), abs=1e-6)
    before, after = policy.state_dict(), weights(out)
    gradient = {name: p.grad for name, p in policy.named_parameters()}
    assert max((before[n] - after[n] - g).abs().max().item() for n, g in gradient.items()) < 1e-6
    norm = torch.cat([g.flatten() for g in gradient.values()]).norm().item()
    assert row["grad_norm"] == pytest.approx(norm, rel=1e-5) and norm > 1e-2


@pytest.fixture(scope="module")
def one_process(dpo) -> str:
    """3 steps of 8 pairs, one process, the live reference: what the other process counts and engines must equal."""
    return train_dpo(dpo, os.path.join(dpo["dir"], "b8"), "--per_device_train_batch_size", "8")


def assert_same_training(runs: dict[str, str], reference: str) -> None:
    """The same losses, metrics and exported weights as the reference run."""
    reference_losses = train_losses(reference)
    assert len(reference_losses) == 3 and reference_losses[1] == pytest.approx(0.6931, abs=1e-4)  # policy = reference
    reference_rows = [r for r in read_metrics(reference) if "loss" in r]
    for name, out in runs.items():
        assert max_difference(weights(out), weights(reference)) < WEIGHT_TOL, name
        assert train_losses(out) == pytest.approx(reference_losses, abs=1e-5), name
        rows = [r for r in read_metrics(out) if "loss" in r]
        for key in ("rewards/chosen", "rewards/margins", "rewards/accuracies", "logps/rejected"):
            assert [r[key] for r in rows] == pytest.approx([r[key] for r in reference_rows], abs=1e-4), (name, key)
        with open(os.path.join(out, "all_results.json")) as f:
            assert json.load(f)["num_processes"] == (1 if name.startswith("1") else 2), name


def test_accumulation_and_processes_give_the_same_weights(dpo, one_process):
    """8 x 1, 2 x 4 and 2 processes x 2 x 2 train on the same pairs per step: the same losses and weights. The
    pairs' lengths differ by up to 40 x: a mean of micro-batch means would not agree."""
    d = dpo["dir"]
    assert_same_training({
        "1 process, 2x4": train_dpo(dpo, f"{d}/b2ga4", "--per_device_train_batch_size", "2",
                                    "--gradient_accumulation_steps", "4"),
        "2 processes x 2 x 2": train_dpo(dpo, f"{d}/ddp", "--per_device_train_batch_size", "2",
                                         "--gradient_accumulation_steps", "2", launcher=launcher("cpu_2proc.yaml")),
    }, one_process)


def test_zero3_and_fsdp2_equal_one_process(dpo, one_process):
    """2 processes x 2 x 2 under DeepSpeed ZeRO-3 (policy and reference partitioned, the reference by DeepSpeed for
    inference) with the live reference, and under FSDP2 (both sharded on the device) with the reference's values
    precomputed after `prepare` (the pass that crashed TRL under FSDP2): the one-process run's losses and weights."""
    from test_fsdp import fsdp_launcher

    d = dpo["dir"]
    common = ("--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2")
    assert_same_training({
        "ZeRO-3": train_dpo(dpo, f"{d}/zero3", *common, launcher=launcher("deepspeed_zero3.yaml")),
        "FSDP2, precomputed": train_dpo(dpo, f"{d}/fsdp2", *common, "--precompute_ref_log_probs", "--cache_dir",
                                        f"{d}/fsdp2-cache", launcher=fsdp_launcher(2)),
    }, one_process)


def test_zero2_and_gradient_checkpointing_equal_one_process(dpo, one_process):
    """DeepSpeed ZeRO-2 on 2 processes x 2 x 2 (the live reference a whole copy per process, prepared by DeepSpeed for
    inference), and --gradient_checkpointing on one process (the policy's layers recomputed in the backward; the
    reference, which has no backward, is built without it): the one-process run's losses and weights."""
    d = dpo["dir"]
    assert_same_training({
        "ZeRO-2": train_dpo(dpo, f"{d}/zero2", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps",
                            "2", launcher=launcher("deepspeed_zero2.yaml")),
        "1 process, checkpointing": train_dpo(dpo, f"{d}/checkpointing", "--per_device_train_batch_size", "8",
                                              "--gradient_checkpointing"),
    }, one_process)


def test_chunked_cross_entropy_trains_as_the_full_logits(dpo):
    """--chunked_cross_entropy on one process and under ZeRO-3 on 2 processes (the head's weight gathered inside the
    head's own forward, for the policy and for the partitioned reference): the full-logits run's losses and weights.
    AdamW epsilon 1e-6, not 1e-8: an element whose gradient is below epsilon turns fp32 summation noise (ZeRO-3's
    reduction order against one process's) into a visible step (1.4e-5 here at 1e-8), as in the tensor-parallel
    tests (docs/scaling.md)."""
    d, epsilon = dpo["dir"], ("--adam_epsilon", "1e-6")
    assert_same_training({
        "1 process, chunked": train_dpo(dpo, f"{d}/chunked", "--per_device_train_batch_size", "8",
                                        "--chunked_cross_entropy", *epsilon),
        "ZeRO-3, chunked": train_dpo(dpo, f"{d}/zero3-chunked", "--per_device_train_batch_size", "2",
                                     "--gradient_accumulation_steps", "2", "--chunked_cross_entropy", *epsilon,
                                     launcher=launcher("deepspeed_zero3.yaml")),
    }, train_dpo(dpo, f"{d}/b8-epsilon", "--per_device_train_batch_size", "8", *epsilon))


@pytest.fixture(scope="module")
def docstring_model(tmp_path_factory) -> dict[str, str]:
    """The built-in task in a cache folder, and a tiny Llama with a tokenizer trained on its first 400 rows."""
    import itertools

    from transformers import LlamaConfig, LlamaForCausalLM

    from common.inputs.data import train_bpe_tokenizer
    from common.inputs.responses import build_preference_task

    d = tmp_path_factory.mktemp("docstring")
    train, _ = build_preference_task(str(d / "cache"))
    with open(train) as f:
        rows = [json.loads(line) for line in itertools.islice(f, 400)]
    tokenizer = train_bpe_tokenizer([r["prompt"] + r["chosen"] for r in rows], 1000)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(d / "model")
    tokenizer.save_pretrained(d / "model")
    return {"dir": str(d), "cache": str(d / "cache"), "model": str(d / "model")}


def test_the_built_in_task_is_learned_on_held_out_pairs(docstring_model):
    """No data flags: the built-in preference task (chosen = a function's body, rejected = the body cut short).
    After 6 steps of 4 pairs, the held-out pairs' chosen rewards beat the rejected ones on most pairs (at step 0 on
    none: every reward is 0), with a positive margin and a loss under log 2."""
    out = os.path.join(docstring_model["dir"], "learned")
    run_script("finetune_dpo.py", "--model_name_or_path", docstring_model["model"], "--cache_dir",
               docstring_model["cache"], "--output_dir", out, "--max_steps", "6", "--logging_steps", "6",
               "--per_device_train_batch_size", "4", "--learning_rate", LR, "--max_seq_length", "192",
               "--max_eval_samples", "32")
    [evaluation] = [r for r in read_metrics(out) if "eval_loss" in r]
    assert evaluation["eval_pairs"] >= 25  # the held-out rows, less those whose prompt fills 192 tokens
    assert evaluation["eval_rewards/accuracies"] >= 0.8, evaluation
    assert evaluation["eval_rewards/margins"] > 0.1 and evaluation["eval_loss"] < 0.6


def test_precomputed_reference_equals_the_live_one(dpo, one_process):
    """--precompute_ref_log_probs (one pass of the reference before training, then freed) trains as the live
    reference does: the same losses, rewards, evaluation and weights; its values are cached under --cache_dir by
    model and data, and a second run reads them from there."""
    d = dpo["dir"]
    cache = os.path.join(d, "reference-cache")
    precomputed = train_dpo(dpo, f"{d}/precomputed", "--per_device_train_batch_size", "8",
                            "--precompute_ref_log_probs", "--cache_dir", cache)
    assert_same_training({"1 process, precomputed": precomputed}, one_process)
    final = [{k: v for k, v in r.items() if k != "time"} for out in (precomputed, one_process)
             for r in read_metrics(out) if "eval_loss" in r]
    assert final[0] == pytest.approx(final[1], abs=1e-5)
    cached = sorted(os.listdir(cache))
    assert len(cached) == 2 and all(n.startswith("dpo-reference-") and ".tmp" not in n for n in cached), cached
    values = [os.path.join(cache, n, "reference_logps.pt") for n in cached]  # train and validation, no leftover
    stamps = [os.path.getmtime(v) for v in values]
    again = train_dpo(dpo, f"{d}/precomputed-again", "--per_device_train_batch_size", "8",
                      "--precompute_ref_log_probs", "--cache_dir", cache, steps=1)
    assert [os.path.getmtime(v) for v in values] == stamps  # read, not recomputed
    [first] = [r for r in read_metrics(again) if "loss" in r]  # wrong values would move step 1 off the reference
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6) and first["rewards/margins"] == pytest.approx(0, abs=1e-6)


def test_precomputed_values_follow_their_pairs_when_pairs_are_dropped(dpo, tmp_path):
    """With --max_seq_length 24 the pairs whose prompt fills it are dropped: the precomputed values are looked up by
    each pair's own row (they were once looked up by position, past the end or on another pair's values), and the
    run trains as the live reference does."""
    short = ("--max_seq_length", "24", "--per_device_train_batch_size", "4")
    live = train_dpo(dpo, str(tmp_path / "live"), *short)
    precomputed = train_dpo(dpo, str(tmp_path / "precomputed"), *short, "--precompute_ref_log_probs", "--cache_dir",
                            str(tmp_path / "cache"))
    with open(os.path.join(live, "all_results.json")) as f:
        assert json.load(f)["train_pairs"] < len(rows_of(dpo["train"]))  # some pairs were dropped
    assert train_losses(precomputed) == pytest.approx(train_losses(live), abs=1e-5)
    assert max_difference(weights(precomputed), weights(live)) < WEIGHT_TOL


def test_the_disabled_adapter_is_the_base_model(dpo):
    """With --use_peft the reference is the policy with its adapter disabled, no second model: its log-probabilities
    equal those of the base loaded separately, once the adapter has moved the policy away from it."""
    dpo_script = load_script("finetune_dpo")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = dpo_script.parse_args(["--model_name_or_path", dpo["model"], "--use_peft", "--lora_r", "4",
                                  "--output_dir", os.path.join(dpo["dir"], "peft")])
    accelerator = Accelerator(cpu=True)
    tokenizer = AutoTokenizer.from_pretrained(dpo["model"])
    model = accelerator.prepare(dpo_script.build_model(args, dpo_script.load_finetuning_config(args), accelerator,
                                                       len(tokenizer)))
    torch.manual_seed(0)
    with torch.no_grad():  # a trained adapter: its B matrices start at zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    rows = rows_of(dpo["train"])[:4]
    columns = {key: [r[key] for r in rows] for key in ("prompt", "chosen", "rejected")}
    pairs = tokenize_pairs(columns, list(range(4)), tokenizer, 512, ("prompt", "chosen", "rejected"))
    batch = PairCollator(tokenizer.pad_token_id, 8)([{k: v[i] for k, v in pairs.items()} for i in range(4)])
    summed = lambda module, b: dpo_script.sequence_logps(module, b)[0]  # noqa: E731
    reference = dpo_script.reference_forward(accelerator, model, None, summed)(batch)
    base = AutoModelForCausalLM.from_pretrained(dpo["model"], dtype=torch.float32).eval()
    with torch.no_grad():
        expected = dpo_script.sequence_logps(base, batch)[0]
        policy = dpo_script.sequence_logps(model, batch)[0]
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    assert (reference - expected).abs().max().item() < 1e-5
    assert (policy - expected).abs().max().item() > 1e-2  # the adapter does change the policy
    assert model.training  # the reference's pass left the policy in training mode


def test_a_killed_run_resumes_exactly(dpo):
    """SIGKILL after the first checkpoint, then the same command with --resume_from_checkpoint auto: the same
    losses, rewards and final weights as the uninterrupted run. --keep_dropout keeps the model's attention dropout
    on (the recipe's default turns it off, as TRL does), so the resumed run must also draw the uninterrupted run's
    dropout masks."""
    from test_crash_safety import newest_complete_step, sigkill, start, wait_for

    d = dpo["dir"]
    flags = ["--per_device_train_batch_size", "4", "--checkpointing_steps", "2", "--keep_dropout",
             "--resume_from_checkpoint", "auto"]
    uninterrupted = train_dpo(dpo, f"{d}/uninterrupted", *flags, steps=6)
    out = f"{d}/killed"
    cmd = [sys.executable, os.path.join(SCRIPTS, "finetune_dpo.py"), "--model_name_or_path", dpo["model"], "--train_file",
           dpo["train"], "--validation_file", dpo["validation"], "--output_dir", out, "--max_steps", "6",
           "--learning_rate", LR, "--logging_steps", "1", "--seed", "0", *flags]
    proc = start(cmd, f"{d}/killed.log")
    assert wait_for(proc, lambda: newest_complete_step(out) >= 2), open(f"{d}/killed.log").read()[-3000:]
    sigkill(proc)
    assert newest_complete_step(out) < 6
    train_dpo(dpo, out, *flags, steps=6)
    assert max_difference(weights(out), weights(uninterrupted)) == 0.0
    rows = {r["step"]: r for r in read_metrics(out) if "loss" in r}
    expected = {r["step"]: r for r in read_metrics(uninterrupted) if "loss" in r}
    assert sorted(rows) == list(range(1, 7))
    for key in ("loss", "rewards/chosen", "rewards/margins", "logps/chosen"):
        assert [rows[s][key] for s in rows] == pytest.approx([expected[s][key] for s in rows], abs=1e-6), key
    assert train_losses(uninterrupted)[2] != pytest.approx(train_losses(train_dpo(
        dpo, f"{d}/no-dropout", "--per_device_train_batch_size", "4", steps=2))[2], abs=1e-6)  # dropout was on


def test_a_copy_without_its_features_trains_exactly_as_the_original(dpo, one_process, tmp_path):
    """tools/copy_recipe.py removes every `# feature:` line (LoRA, checksums, the divergence guard, ...): the copy
    imports no feature and trains bit for bit as the original does without those flags."""
    from tools.copy_recipe import common_modules, strip_features

    copy = tmp_path / "my_dpo.py"
    copy.write_text(strip_features(open(os.path.join(SCRIPTS, "finetune_dpo.py")).read()))
    assert not any(".features" in name for name in common_modules(copy.read_text()))
    run_script(str(copy), "--model_name_or_path", dpo["model"], "--train_file", dpo["train"], "--validation_file",
               dpo["validation"], "--output_dir", str(tmp_path / "copy"), "--max_steps", "3", "--learning_rate", LR,
               "--logging_steps", "1", "--seed", "0", "--per_device_train_batch_size", "8",
               env={"PYTHONPATH": os.path.dirname(SCRIPTS)})
    assert train_losses(str(tmp_path / "copy")) == train_losses(one_process)
    assert max_difference(weights(str(tmp_path / "copy")), weights(one_process)) == 0


def test_qlora_trains_against_its_disabled_adapter_and_exports_merged(dpo, tmp_path):
    """QLoRA (4-bit base) with --merge_adapter: the reference is the 4-bit base with the adapter disabled, so step 1
    is exactly log 2 (the adapter starts at zero); the loss then moves; the adapter is exported, and the merged model
    (a full-precision base + the adapter) loads with the model class alone and scores the pairs like the base moved by
    the adapter: its log-probabilities differ from the base's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dpo_script = load_script("finetune_dpo")
    out = train_dpo(dpo, str(tmp_path / "qlora"), "--per_device_train_batch_size", "4", "--use_peft",
                    "--load_in_4bit", "--lora_r", "4", "--merge_adapter", "--learning_rate", "1e-2")
    losses = train_losses(out)
    assert losses[1] == pytest.approx(math.log(2), abs=1e-6) and losses[3] != pytest.approx(losses[1], abs=1e-3)
    assert os.path.isfile(os.path.join(out, "adapter_model.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(dpo["model"])
    rows = rows_of(dpo["validation"])[:4]
    columns = {key: [r[key] for r in rows] for key in ("prompt", "chosen", "rejected")}
    pairs = tokenize_pairs(columns, list(range(4)), tokenizer, 512, ("prompt", "chosen", "rejected"))
    batch = PairCollator(tokenizer.pad_token_id, 8)([{k: v[i] for k, v in pairs.items()} for i in range(4)])
    with torch.no_grad():
        merged, base = (dpo_script.sequence_logps(AutoModelForCausalLM.from_pretrained(path).eval(), batch)[0]
                        for path in (os.path.join(out, "merged"), dpo["model"]))
    assert torch.isfinite(merged).all() and (merged - base).abs().max().item() > 1e-3


# ---- the precomputed reference's cache entry: never used damaged or stale, nothing left by a kill --------------------
PRECOMPUTED = ("--per_device_train_batch_size", "8", "--precompute_ref_log_probs")


def reference_entries(cache: str) -> list[str]:
    return sorted(os.path.join(cache, n, "reference_logps.pt") for n in os.listdir(cache)
                  if n.startswith("dpo-reference-") and ".tmp" not in n and ".damaged" not in n)


def assert_same_run(out: str, clean: str) -> None:
    """Losses, gradient norms, rewards, evaluation and weights exactly those of the run with a clean cache."""
    def figures(folder: str) -> list[dict]:
        return [{k: v for k, v in r.items() if k in ("step", "loss", "grad_norm") or k.startswith(("rewards/", "logps/",
                                                                                                 "eval_"))}
                for r in read_metrics(folder)]
    assert figures(out) == figures(clean) and any("eval_loss" in r for r in figures(out))
    assert max_difference(weights(out), weights(clean)) == 0.0


@pytest.fixture(scope="module")
def precomputed_clean(dpo) -> dict[str, str]:
    """2 steps with the reference's values precomputed into an empty cache: what a run reading any cache must equal."""
    cache = os.path.join(dpo["dir"], "clean-cache")
    out = train_dpo(dpo, os.path.join(dpo["dir"], "clean-precomputed"), *PRECOMPUTED, "--cache_dir", cache, steps=2)
    return {"out": out, "cache": cache}


def flip_two_value_bytes(path: str) -> None:
    """Two bytes flipped inside the stored floats (not the zip's directory): torch.load still reads the file, with
    other values (what a run without checksums would silently train against)."""
    values = torch.load(path, weights_only=True)
    blob = bytearray(open(path, "rb").read())
    at = blob.find(values.numpy().tobytes())
    assert at > 0
    blob[at + 2] ^= 0xFF
    blob[at + 7] ^= 0xFF
    open(path, "wb").write(bytes(blob))
    assert not torch.equal(torch.load(path, weights_only=True), values)


def test_an_entry_of_another_base_or_split_under_this_key_is_never_read(tmp_path, caplog):
    """The reference's values as `precompute_reference` keeps them (in-process: a stand-in forward per base, one
    process). An entry's manifest held sizes and checksums, not its key: another base's entry under this run's folder
    name was read silently (step 1's loss 0.691340 instead of log 2), and the validation entry there crashed the
    collator (IndexError). Now each is rebuilt with one log line, and the values are this base's, for every row."""
    import shutil
    import types

    from datasets import Dataset
    from transformers import LlamaConfig

    from common.features.reference import precompute_reference

    rng = random.Random(0)
    data = {split: Dataset.from_dict({"prompt_ids": [[rng.randrange(1, 50) for _ in range(3)] for _ in range(n)],
                                      "chosen_ids": [[rng.randrange(1, 50)] for _ in range(n)],
                                      "rejected_ids": [[rng.randrange(1, 50)] for _ in range(n)],
                                      "index": list(range(n)), "length": [4] * n})
            for split, n in (("train", 6), ("validation", 2))}
    accelerator = types.SimpleNamespace(is_main_process=True, is_local_main_process=False, num_processes=1,
                                        process_index=0, mixed_precision="no", device=torch.device("cpu"),
                                        gather=lambda t: t, wait_for_everyone=lambda: None)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1)

    def precompute(base: str, cache: str) -> dict[str, torch.Tensor]:
        collators = {split: PairCollator(0, 8) for split in data}
        scale = {"org/base-a": 1.0, "org/base-b": 2.0}[base]  # each base its own values
        precompute_reference(argparse.Namespace(model_name_or_path=base, cache_dir=cache, per_device_eval_batch_size=4),
                             accelerator, config, lambda batch: batch["input_ids"].sum(1).double() * scale, data,
                             collators)
        return {split: collator.reference_logps for split, collator in collators.items()}

    def entry(cache: str, rows: int) -> str:  # the entry holding the values of a split of `rows` rows
        return next(os.path.dirname(p) for p in reference_entries(cache) if len(torch.load(p, weights_only=True)) == rows)

    precompute("org/base-a", str(tmp_path / "a"))
    expected = precompute("org/base-b", str(tmp_path / "b"))
    assert not torch.equal(expected["train"], precompute("org/base-a", str(tmp_path / "a"))["train"])
    for case, source in (("another base's", str(tmp_path / "a")), ("the validation split's", str(tmp_path / "b"))):
        cache = str(tmp_path / case.split()[1])
        shutil.copytree(str(tmp_path / "b"), cache)
        train = entry(cache, 6)
        shutil.rmtree(train)
        shutil.copytree(entry(source, 6 if case == "another base's" else 2), train)  # whole, under this key's name
        caplog.clear()
        values = precompute("org/base-b", cache)
        assert all(torch.equal(values[split], expected[split]) for split in data), case
        said = [r.getMessage() for r in caplog.records if "rebuilding" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith(f"cache entry {train} is damaged (its cache.json records "), said


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_reference_entry_is_rebuilt_with_one_line(dpo, precomputed_clean, tmp_path, damage):
    """The cached values cut in half (a kill or a full disk mid-write) or with two bytes flipped: the run never reads
    them, says so in one line per entry, rebuilds them, and trains exactly as the run with a clean cache."""
    import shutil

    cache = str(tmp_path / "cache")
    shutil.copytree(precomputed_clean["cache"], cache)
    entries = reference_entries(cache)
    assert len(entries) == 2  # train and validation
    for path in entries:
        if damage == "truncated":
            os.truncate(path, os.path.getsize(path) // 2)
        else:
            flip_two_value_bytes(path)
    out = str(tmp_path / "out")
    proc = run_script("finetune_dpo.py", "--model_name_or_path", dpo["model"], "--train_file", dpo["train"],
                      "--validation_file", dpo["validation"], "--output_dir", out, "--max_steps", "2",
                      "--learning_rate", LR, "--logging_steps", "1", "--seed", "0", *PRECOMPUTED, "--cache_dir", cache)
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "is damaged" in line]
    assert len(said) == 2 and all(os.path.dirname(p) in " ".join(said) for p in entries), said
    assert_same_run(out, precomputed_clean["out"])
    assert reference_entries(cache) == entries and not [n for n in os.listdir(cache) if "dpo-reference" in n and
                                                        (".tmp" in n or ".damaged" in n)]


def test_a_base_rewritten_in_place_never_reads_the_old_values(dpo, tmp_path):
    """The base model re-saved with other weights of the same size and its mtime kept (as `cp -p` or `rsync -a`
    leave it): the cache key is the weights' content, so the old values are not read; the policy starts as the new
    reference: step 1's loss is log 2 and its margins 0, as a run with an empty cache."""
    import shutil

    from transformers import AutoModelForCausalLM

    base, cache = str(tmp_path / "base"), str(tmp_path / "cache")
    shutil.copytree(dpo["model"], base)
    model_file = os.path.join(base, "model.safetensors")
    moved = {**dpo, "model": base}
    train_dpo(moved, str(tmp_path / "before"), *PRECOMPUTED, "--cache_dir", cache, steps=1)
    stamps = {name: os.stat(os.path.join(base, name)).st_mtime_ns for name in os.listdir(base)}
    size = os.path.getsize(model_file)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(base)
    for name, stamp in stamps.items():
        os.utime(os.path.join(base, name), ns=(stamp, stamp))
    assert sorted(os.listdir(base)) == sorted(stamps) and os.path.getsize(model_file) == size
    after = train_dpo(moved, str(tmp_path / "after"), *PRECOMPUTED, "--cache_dir", cache, steps=1)
    fresh = train_dpo(moved, str(tmp_path / "fresh"), *PRECOMPUTED, "--cache_dir", str(tmp_path / "empty"), steps=1)
    [first] = [r for r in read_metrics(after) if "loss" in r]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6) and first["rewards/margins"] == pytest.approx(0, abs=1e-6)
    assert train_losses(after) == train_losses(fresh) and max_difference(weights(after), weights(fresh)) == 0.0
    assert len(reference_entries(cache)) == 4  # the old base's two entries and the new one's


KILL_WHILE_WRITING = """
import os, runpy, signal, sys
import common.features.reference as reference
write = reference.write_values
def write_half_then_die(values, folder):  # SIGKILL halfway through writing the first entry
    write(values, folder)
    path = os.path.join(folder, reference.VALUES)
    os.truncate(path, os.path.getsize(path) // 2)
    os.kill(os.getpid(), signal.SIGKILL)
reference.write_values = write_half_then_die
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_run_killed_while_writing_the_values_leaves_no_temporary_file(dpo, precomputed_clean, tmp_path):
    """SIGKILL halfway through writing the values: what it leaves is never read, the next run with that --cache_dir
    removes it and trains exactly as the run with a clean cache; no `*.tmp*` is left."""
    cache, wrapper = str(tmp_path / "cache"), tmp_path / "kill_while_writing.py"
    wrapper.write_text(KILL_WHILE_WRITING)
    args = ["--model_name_or_path", dpo["model"], "--train_file", dpo["train"], "--validation_file",
            dpo["validation"], "--max_steps", "2", "--learning_rate", LR, "--logging_steps", "1", "--seed", "0",
            *PRECOMPUTED, "--cache_dir", cache]
    import subprocess

    killed = subprocess.run([sys.executable, str(wrapper), os.path.join(SCRIPTS, "finetune_dpo.py"), *args,
                             "--output_dir", str(tmp_path / "killed")], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": os.path.dirname(SCRIPTS)}, timeout=600)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert [n for n in os.listdir(cache) if ".tmp" in n] and not reference_entries(cache)  # killed mid-build
    out = str(tmp_path / "out")
    run_script("finetune_dpo.py", *args, "--output_dir", out)
    assert not [n for n in os.listdir(cache) if ".tmp" in n] and len(reference_entries(cache)) == 2
    assert_same_run(out, precomputed_clean["out"])


def test_two_processes_precompute_with_fewer_validation_pairs_than_processes(dpo, one_process, tmp_path):
    """2 processes and 1 validation pair: the process without a pair of its own repeats one in the pass, left out of
    the values. The values equal the base model's log-probabilities computed here one sequence at a time (1e-5), and
    the run trains as the one-process live-reference run (losses 1e-5, weights 1e-5)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    validation = tmp_path / "one.jsonl"
    row = rows_of(dpo["validation"])[0]
    validation.write_text(json.dumps(row) + "\n")
    cache = str(tmp_path / "cache")
    out = train_dpo({**dpo, "validation": str(validation)}, str(tmp_path / "ddp"), "--per_device_train_batch_size",
                    "2", "--gradient_accumulation_steps", "2", "--precompute_ref_log_probs", "--cache_dir", cache,
                    launcher=launcher("cpu_2proc.yaml"))
    assert max_difference(weights(out), weights(one_process)) < WEIGHT_TOL
    assert train_losses(out) == pytest.approx(train_losses(one_process), abs=1e-5)
    [evaluation] = [r for r in read_metrics(out) if "eval_loss" in r]
    assert evaluation["eval_pairs"] == 1
    tokenizer = AutoTokenizer.from_pretrained(dpo["model"])
    base = AutoModelForCausalLM.from_pretrained(dpo["model"], dtype=torch.float32).eval()
    prompt = tokenizer(row["prompt"])["input_ids"]
    with torch.no_grad():
        expected = torch.stack([plain_sequence_logps(base, prompt, tokenizer(row[key], add_special_tokens=False)
                                                     ["input_ids"] + [tokenizer.eos_token_id])
                                for key in ("chosen", "rejected")])
    [one_pair] = [v for v in map(lambda p: torch.load(p, weights_only=True), reference_entries(cache)) if len(v) == 1]
    assert (one_pair[0] - expected).abs().max().item() < 1e-5


# ---- bad inputs: one line, exit status 2, no traceback, before the work they would spoil -----------------------------
@pytest.mark.parametrize("case", ["mixed-rows", "mixed-rows-with-template", "template-syntax", "beta-inf",
                                  "beta-nan", "beta-zero"])
def test_bad_inputs_are_one_line_before_the_work(dpo, tmp_path, capsys, case):
    """Text rows and a chat row in one file: refused before the tokenizer loads, with --chat_template too (which once
    trained silently). A template that does not compile: refused before any data is read (the data here is bad
    too). --beta inf / nan / 0: refused (inf once trained NaN steps and blamed the learning rate). Each: one line,
    exit status 2, no traceback, from the script as run."""
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "Q", "chosen": "a", "rejected": "b"}, {"prompt": "Q", "chosen": "c", "rejected": "d"},
        {"prompt": [{"role": "user", "content": "Q"}], "chosen": [{"role": "assistant", "content": "a"}],
         "rejected": [{"role": "assistant", "content": "b"}]}]))
    template, broken = tmp_path / "chat.jinja", tmp_path / "broken.jinja"
    template.write_text(CHAT_TEMPLATE)
    broken.write_text("{% for m in messages %}{{ m['content'] }}{% endfor")
    mixed_line = (f"--train_file {mixed}: row 3 holds chat turns where row 1 of the train split holds plain text: "
                  "give every row the same kind")
    flags, line = {
        "mixed-rows": ([], mixed_line),
        "mixed-rows-with-template": (["--chat_template", str(template)], mixed_line),
        "template-syntax": (["--chat_template", str(broken)],
                            f"--chat_template {broken}: not a Jinja template (line 1: unexpected end of template"),
        "beta-inf": (["--beta", "inf"], "--beta must be a finite number > 0 (got inf)"),
        "beta-nan": (["--beta", "nan"], "--beta must be a finite number > 0 (got nan)"),
        "beta-zero": (["--beta", "0"], "--beta must be a finite number > 0 (got 0.0)"),
    }[case]
    data = ["--train_file", str(mixed), "--validation_file", dpo["validation"]] if "beta" not in case else \
        ["--train_file", dpo["train"], "--validation_file", dpo["validation"]]
    common = [*data, "--output_dir", str(tmp_path / "out"), "--cache_dir", str(tmp_path / "cache"), *flags]
    proc = run_script("finetune_dpo.py", "--model_name_or_path", dpo["model"], *common, check=False)
    output = proc.stdout + proc.stderr
    errors = [text for text in output.splitlines() if text.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in output, output[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"error: {line}"), output[-3000:]
    if case.startswith("mixed"):  # no tokenizer to load: a check after the tokenizer would fail on that first
        dpo_script = load_script("finetune_dpo")
        capsys.readouterr()
        with pytest.raises(SystemExit):
            dpo_script.load_preference_data(dpo_script.parse_args(["--model_name_or_path", "unused", *common]),
                                            None, None, None)
        assert [text for text in capsys.readouterr().err.splitlines() if text.startswith("error:")] == errors
