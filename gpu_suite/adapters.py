"""Part 2's LoRA and QLoRA rows: fine-tuning an 8B-shaped Llama (Llama-3.1-8B's shape, built from a config with
random bf16 weights: nothing comes from the hub) at batch 2 x 2,048 tokens with bf16, activation checkpointing and
the chunked loss (as torchtune's published figures: on a torch without F.linear_cross_entropy, checkpointed chunks),
timed by benchmarks/benchmark.py; peak memory against tools/estimate_memory.py and the published reference figures.
The dry run does the same with the tiny preset on a CPU (the plumbing, no figure to compare)."""

from __future__ import annotations

import math
import os
import random

import torch

from benchmarks import benchmark
from common.inputs.modeling import LLAMA_PRESETS
from gpu_suite.data import WORDS, write_jsonl
from gpu_suite.performance import headline_run_flags, preset_shape, tail_note
from gpu_suite.suite import FAIL, PASS, SFT, Outcome, Row, Suite
from tools import estimate_memory

LLAMA_31_VOCAB = 128256
BATCH = 2


def shape(suite: Suite) -> dict:
    """The model and run size: Llama-3.1-8B's shape at 2 x 2,048 on a GPU, the tiny preset at 2 x 64 otherwise."""
    if suite.cuda:
        return {"preset": "8b", "vocab": LLAMA_31_VOCAB, "seq": 2048}
    return {"preset": "tiny", "vocab": 512, "seq": suite.settings.perf_seq}


def prepare(suite: Suite) -> dict[str, str]:
    """A base model folder (random bf16 weights, a BPE tokenizer trained here) and prompt/completion rows whose
    completions are cut at the sequence length, so every example holds exactly `seq` tokens (no padding)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from common.inputs.data import train_bpe_tokenizer

    size, d = shape(suite), os.path.join(suite.work, "data", "adapters")
    os.makedirs(d, exist_ok=True)
    rng = random.Random(0)
    words = max(size["seq"], 64)  # each word is at least one token
    rows = [{"prompt": "Summarise: ", "completion": " ".join(rng.choice(WORDS) for _ in range(words))}
            for _ in range(48)]
    paths = {"train": write_jsonl(os.path.join(d, "train.jsonl"), rows[:40]),
             "validation": write_jsonl(os.path.join(d, "validation.jsonl"), rows[40:]),
             "model": os.path.join(d, f"base-{size['preset']}")}
    if not os.path.isfile(os.path.join(paths["model"], "config.json")):
        tokenizer = train_bpe_tokenizer([r["completion"] for r in rows], 512)
        config = LlamaConfig(**LLAMA_PRESETS[size["preset"]], vocab_size=size["vocab"],
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        with torch.device("cuda" if suite.cuda else "cpu"):  # random initialisation of 8B weights: fast on a GPU
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(paths["model"])
        tokenizer.save_pretrained(paths["model"])
        del model
        if suite.cuda:
            torch.cuda.empty_cache()
    return paths


def run(suite: Suite, method: str) -> dict:
    """One benchmark.py run of `method` (lora or qlora) on the prepared model; its figures or {"error": ...}."""
    paths, size, s = suite.memo("adapter_data", lambda: prepare(suite)), shape(suite), suite.settings
    argv = ["--script", SFT, "--methods", method, "--seq_flag=--max_seq_length", "--seq_len", str(size["seq"]),
            "--per_device_train_batch_size", str(BATCH), "--warm_steps", str(s.warm_steps), "--timed_steps",
            str(s.timed_steps), "--output_dir", os.path.join(suite.work, "benchmark-adapters"), "--",
            "--model_name_or_path", paths["model"], "--train_file", paths["train"], "--validation_file",
            paths["validation"], "--bf16", "--gradient_checkpointing", "--chunked_cross_entropy", "--learning_rate",
            "2e-4", "--max_eval_samples", "2", "--cache_dir", os.path.join(suite.work, "cache")]
    argv[:0] = headline_run_flags(suite)
    if suite.seconds_left() < math.inf:  # the part's budget, or the headline row's cap
        argv[:0] = ["--time_budget_s", f"{max(suite.seconds_left(), 1):.0f}"]
    try:
        args = benchmark.parse_args(argv)
    except SystemExit as e:
        return {"error": f"benchmark.py refused its arguments (exit {e.code})"}
    os.makedirs(args.output_dir, exist_ok=True)
    return benchmark.run_once(args, method, 0)


def estimate(suite: Suite, method: str) -> float:
    """estimate_memory.peak_memory's total for the row's run (the tool's --use_peft --chunked_cross_entropy table
    prints the same in its checkpointed column)."""
    size = shape(suite)
    run = estimate_memory.Run({"lora": "LoRA", "qlora": "QLoRA"}[method], size["seq"], BATCH, "full", chunked=True)
    return estimate_memory.peak_memory(preset_shape(size["preset"], size["vocab"]), run)["total"]


def adapter_row(method: str) -> Row:
    label = {"lora": "LoRA", "qlora": "QLoRA"}[method]

    def check(suite: Suite) -> Outcome:
        result = run(suite, method)
        if "error" in result:
            return Outcome(FAIL, result["error"].splitlines()[0][:240])
        detail = {k: result[k] for k in ("tokens_per_second", "peak_memory_bytes", "peak_memory_reserved_bytes",
                                         "final_loss")}
        if not all(math.isfinite(result[k]) for k in ("tokens_per_second", "final_loss")):
            return Outcome(FAIL, f"non-finite figures {detail}", detail)
        figure = f"{result['tokens_per_second']:,.0f} tok/s" + tail_note(result)
        detail["estimate_bytes"] = estimate(suite, method)
        if not suite.cuda:
            return Outcome(PASS, figure + f", peak RSS {result['peak_memory_bytes'] / 2**20:,.0f} MiB (tiny preset on "
                           "a CPU: no figure to compare)", detail)
        figure += (f", peak {result['peak_memory_bytes'] / 2**30:.1f}/"
                   f"{(result['peak_memory_reserved_bytes'] or 0) / 2**30:.1f} GiB alloc/reserved vs estimate "
                   f"{detail['estimate_bytes'] / 2**30:.1f} GiB; published (torchtune, RTX 4090): "
                   f"{estimate_memory.PUBLISHED_8B[label]}")
        return Outcome(PASS, figure, detail)

    return Row(f"perf_{method}_8b", 2, f"{label} fine-tuning of an 8B-shaped Llama (built from a config), 2 x 2,048 "
               "tokens, bf16 + checkpointing + chunked loss: tokens/s and peak memory", check,
               needs=("peft", "bitsandbytes"))


def adapter_rows() -> list[Row]:
    return [adapter_row("lora"), adapter_row("qlora")]
