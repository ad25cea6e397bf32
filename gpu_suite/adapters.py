"""Part 2's LoRA and QLoRA rows (also the headline part's): fine-tuning an 8B-shaped Llama (Llama-3.1-8B's shape,
built from a config with random bf16 weights: nothing comes from the hub) at batch 2 x 2,048 tokens with the README's
recommended flags (bf16, checkpointing with the layers' inputs offloaded, the chunked loss, no adapter dropout,
8-bit AdamW; QLoRA's scales quantized too: tools/estimate_memory.py RECOMMENDED_8B), timed by
benchmarks/benchmark.py; the measured peak beside tools/estimate_memory.py's answer for the same command and the
published reference figures. The dry run does the same with the tiny preset on a CPU (the plumbing, no figure to
compare)."""

from __future__ import annotations

import math
import os
import random

import torch

from benchmarks import benchmark
from gpu_suite.data import WORDS, save_preset_llama, write_jsonl
from gpu_suite.performance import headline_run_flags, tail_note
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
        save_preset_llama(paths["model"], tokenizer, size["preset"], size["vocab"], torch.bfloat16,
                          "cuda" if suite.cuda else "cpu")
    return paths


def run(suite: Suite, method: str) -> dict:
    """One benchmark.py run of `method` (lora or qlora) on the prepared model; its figures or {"error": ...}."""
    paths, size, s = suite.memo("adapter_data", lambda: prepare(suite)), shape(suite), suite.settings
    argv = ["--script", SFT, "--methods", method, "--seq_flag=--max_seq_length", "--seq_len", str(size["seq"]),
            "--per_device_train_batch_size", str(BATCH), "--warm_steps", str(s.warm_steps), "--timed_steps",
            str(s.timed_steps), "--output_dir", os.path.join(suite.work, "benchmark-adapters"), "--",
            "--model_name_or_path", paths["model"], "--train_file", paths["train"], "--validation_file",
            paths["validation"], *recipe_flags(method), "--learning_rate", "2e-4", "--max_eval_samples",
            "2", "--cache_dir", os.path.join(suite.work, "cache")]
    argv[:0] = headline_run_flags(suite)
    if suite.seconds_left() < math.inf:  # the part's budget, or the headline row's cap
        argv[:0] = ["--time_budget_s", f"{max(suite.seconds_left(), 1):.0f}"]
    try:
        args = benchmark.parse_args(argv)
    except SystemExit as e:
        return {"error": f"benchmark.py refused its arguments (exit {e.code})"}
    os.makedirs(args.output_dir, exist_ok=True)
    return benchmark.run_once(args, method, 0)


def recipe_flags(method: str) -> list[str]:
    """The row's memory flags: the README's recommended 8B command (benchmark.py adds --use_peft, --load_in_4bit,
    the sequence length and the batch)."""
    label = {"lora": "LoRA", "qlora": "QLoRA"}[method]
    added = {"--use_peft", "--load_in_4bit"}
    return ["--bf16", "--gradient_checkpointing", *(f for f in estimate_memory.RECOMMENDED_8B[label] if f not in added)]


def estimate(suite: Suite, method: str) -> float:
    """tools/estimate_memory.py's answer for the row's exact command (`-- scripts/finetune_causal_lm.py ...`)."""
    paths, size = suite.memo("adapter_data", lambda: prepare(suite)), shape(suite)
    command = [SFT, "--model_name_or_path", paths["model"], *recipe_flags(method), "--max_seq_length",
               str(size["seq"]), "--per_device_train_batch_size", str(BATCH), "--use_peft",
               *(["--load_in_4bit"] if method == "qlora" else [])]
    return estimate_memory.command_answer(command, 80)["peak_bytes"]


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
            return Outcome(PASS, figure + f", peak RSS {result['peak_memory_bytes'] / 2**20:,.0f} MiB, estimate "
                           f"{detail['estimate_bytes'] / 2**20:,.0f} MiB on a GPU (tiny preset on a CPU: the process's "
                           "resident memory, no figure to compare)", detail)
        off = result["peak_memory_bytes"] / detail["estimate_bytes"] - 1
        figure += (f", peak {result['peak_memory_bytes'] / 2**30:.2f}/"
                   f"{(result['peak_memory_reserved_bytes'] or 0) / 2**30:.2f} GiB alloc/reserved, estimate "
                   f"{detail['estimate_bytes'] / 2**30:.2f} GiB ({off:+.1%} measured vs estimate); published "
                   f"(torchtune, RTX 4090, batch 2, packed 2,048, compile on): {estimate_memory.PUBLISHED_8B[label]}")
        return Outcome(PASS, figure, detail)

    return Row(f"perf_{method}_8b", 2, f"{label} fine-tuning of an 8B-shaped Llama (built from a config), 2 x 2,048 "
               "tokens, the README's recommended flags: tokens/s, peak memory and its estimate", check,
               needs=("peft", "bitsandbytes"))


def adapter_rows() -> list[Row]:
    return [adapter_row("lora"), adapter_row("qlora")]
