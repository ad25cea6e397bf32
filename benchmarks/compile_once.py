#!/usr/bin/env python
"""What `--torch_compile` costs and saves: cold compile and steady step time, regional vs whole-model vs eager, and
the compilations of an SFT run on rows of many lengths.

    python benchmarks/compile_once.py                        # 125m preset + SFT, about 25 minutes on 2 CPU cores
    python benchmarks/compile_once.py --before ../old-checkout   # also the SFT run of another checkout

Every run is a fresh `accelerate launch --quiet` with inductor's caches off (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1:
each compile cold) and a metrics row per step. `to step 1` is the seconds from the process's start to its first step's
row (imports, data, model, and for compiled runs the compilation of the first step's graphs); `compile` is that minus
the eager run's; `step` is the median step time after the first three; `cpu_s` the CPU seconds of the whole run
(launcher, script and the compiler processes it waited for), which a busy machine changes far less than wall seconds,
and `compile_cpu_s` that minus the eager run's; compilations are dynamo's own count (`compiled_graphs` in
all_results.json) or, for a checkout without it, the `Recompiling function` lines of TORCH_LOGS=recompiles plus one
per compiled frame. Runs of one table alternate (A B C A B C ...) and the table holds medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PRETRAIN = ["--model_preset", "125m", "--block_size", "128", "--per_device_train_batch_size", "2", "--max_steps",
            "12", "--per_device_eval_batch_size", "2", "--sample_max_new_tokens", "0"]
VARIANTS = {"eager": [], "regional": ["--torch_compile"],
            "whole model": ["--torch_compile", "--torch_compile_whole_model"]}


def run(root: str, script: str, args: list[str], out: str) -> dict:
    """One run of `root`'s script; its step rows' timing and its compilation count."""
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "TORCH_LOGS": "recompiles"}
    start, cpu = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    launch = [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--quiet"]  # as users start it
    proc = subprocess.run([*launch, os.path.join(root, "scripts", script), *args, "--output_dir", out,
                           "--logging_steps", "1"], cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{script} failed:\n{proc.stderr[-3000:]}")
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime  # the launcher, the script, its compilers
    with open(os.path.join(out, "metrics.jsonl")) as f:
        times = [row["time"] for row in map(json.loads, f) if "loss" in row]
    with open(os.path.join(out, "all_results.json")) as f:
        results = json.load(f)
    frames = {m.group(1) for m in re.finditer(r"\[(\d+)/\d+\] \[__recompiles\]", proc.stderr)}
    recompiles = proc.stderr.count("Recompiling function")
    steps = [b - a for a, b in zip(times[3:], times[4:])]
    return {"cpu_s": cpu_s, "to_step_1": times[0] - start, "to_step_20": times[19] - start if len(times) >= 20 else None,
            "step": statistics.median(steps) if steps else None,
            "compilations": results.get("compiled_graphs", recompiles + len(frames) if recompiles else None)}


def medians(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) if all(r[key] is not None for r in runs) else None
            for key in runs[0]}


def alternate(jobs: dict, repeats: int) -> dict:
    """Each job `repeats` times, in turn; the medians per job."""
    done = {name: [] for name in jobs}
    for i in range(repeats):
        for name, job in jobs.items():
            with tempfile.TemporaryDirectory() as tmp:
                done[name].append(job(os.path.join(tmp, "out")))
            print(f"{name} #{i + 1}: {done[name][-1]}", flush=True)
    return {name: medians(runs) for name, runs in done.items()}


def text_corpus(folder: str) -> list[str]:
    """Random sentences: enough training blocks for the steps, a validation split of a few blocks (the final
    evaluation of a 125m model on the default corpus's held-out files took minutes here)."""
    import random

    rng = random.Random(0)
    words = "the model reads tokens and learns to predict the next one from gradients of a loss".split()
    for split, rows in (("train", 400), ("validation", 4)):
        with open(os.path.join(folder, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps({"text": " ".join(rng.choice(words) for _ in range(100))}) + "\n"
                         for _ in range(rows))
    return ["--train_file", os.path.join(folder, "train.jsonl"), "--validation_file",
            os.path.join(folder, "validation.jsonl"), "--cache_dir", os.path.join(folder, "cache")]


def sft_data(folder: str) -> list[str]:
    """A tiny Llama and prompt/completion rows of very uneven lengths (tests/test_finetune_causal_lm.py's fixture)."""
    import random

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.inputs.data import train_bpe_tokenizer

    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    rows = [{"prompt": "Q: " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 60))) + "\nA:",
             "completion": " " + " ".join(rng.choice(words) for _ in range(rng.choice([1, 2, 3, 40, 80])))}
            for _ in range(200)]
    for split, part in (("train", rows[:180]), ("validation", rows[180:])):
        with open(os.path.join(folder, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    tokenizer = train_bpe_tokenizer([r["prompt"] + r["completion"] for r in rows], 300)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)).save_pretrained(os.path.join(folder, "base"))
    tokenizer.save_pretrained(os.path.join(folder, "base"))
    return ["--model_name_or_path", os.path.join(folder, "base"), "--train_file", os.path.join(folder, "train.jsonl"),
            "--validation_file", os.path.join(folder, "validation.jsonl"), "--max_steps", "24",
            "--per_device_train_batch_size", "4", "--torch_compile"]


def table(rows: dict, columns: list[str]) -> str:
    def cell(value):
        return "" if value is None else f"{value:,.2f}" if isinstance(value, float) else f"{value:,}"
    lines = ["| run | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    lines += [f"| {name} | " + " | ".join(cell(row.get(c)) for c in columns) + " |" for name, row in rows.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--before", help="Another checkout (e.g. a worktree of an older commit) for the SFT table.")
    parser.add_argument("--skip_pretrain", action="store_true")
    args = parser.parse_args()
    if not args.skip_pretrain:
        data = tempfile.mkdtemp()
        corpus = text_corpus(data)
        rows = alternate({name: (lambda out, flags=flags: run(ROOT, "pretrain_llama.py", PRETRAIN + corpus + flags,
                                                               out)) for name, flags in VARIANTS.items()}, args.repeats)
        for row in rows.values():
            row["compile"] = row["to_step_1"] - rows["eager"]["to_step_1"]
            row["compile_cpu_s"] = row["cpu_s"] - rows["eager"]["cpu_s"]
        print("\n125m preset, 2 x 128 tokens, fp32, one process:\n"
              + table(rows, ["cpu_s", "compile_cpu_s", "to_step_1", "compile", "step", "compilations"]))
    with tempfile.TemporaryDirectory() as data:
        sft_args = sft_data(data)
        jobs = {"this checkout": lambda out: run(ROOT, "finetune_causal_lm.py", sft_args, out)}
        if args.before:
            jobs = {"before": lambda out: run(args.before, "finetune_causal_lm.py", sft_args, out), **jobs}
        rows = alternate(jobs, args.repeats)
        print("\nSFT, 4-layer Llama, batches of 4 rows of many lengths, --torch_compile (inductor):\n"
              + table(rows, ["cpu_s", "to_step_1", "to_step_20", "step", "compilations"]))


if __name__ == "__main__":
    main()
