#!/usr/bin/env python
"""One GRPO step of scripts/finetune_grpo.py beside TRL's `GRPOTrainer` on the same model, prompts, G, lengths and
flags: the median step time after the first, and the share of it spent generating (and scoring) completions.

    python benchmarks/grpo_vs_trl.py --model_name_or_path outputs/docstring-to-body \\
        --trl_python /path/to/trl-venv/bin/python --steps 6

TRL is not a dependency: it runs in its own virtual environment (`--trl_python`), which may borrow this one's
packages through PYTHONPATH (`pip install --no-deps trl` there). Both use the default task's prompts and its
`compiles` reward, transformers' `generate` (TRL without vLLM), the DAPO loss, beta 0, μ 1, fp32, one process.
Ours: the step time from metrics.jsonl's rows, generation from its `generation_seconds`. TRL: a callback times each
step, `_generate_and_score_completions` is timed by a wrapper (generation, scoring and the advantages).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TRL_RUN = r'''
import json, sys, time
from datasets import load_dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
sys.path.insert(0, {root!r})
from common.inputs.prompts import compiles

settings = json.loads({settings!r})
times = {{"steps": [], "generation": []}}


class StepTimes(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        self.began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        times["steps"].append(time.perf_counter() - self.began)


config = GRPOConfig(output_dir=settings["output_dir"], use_cpu=True, report_to="none", max_steps=settings["steps"],
                    per_device_train_batch_size=settings["batch"], num_generations=settings["G"],
                    max_completion_length=settings["length"], learning_rate=settings["lr"], logging_steps=1,
                    save_strategy="no", bf16=False, seed=0, beta=0.0, loss_type="dapo", temperature=1.0)
trainer = GRPOTrainer(model=settings["model"], reward_funcs=[compiles], args=config,
                      train_dataset=load_dataset("json", data_files=settings["prompts"], split="train"),
                      callbacks=[StepTimes()])
generate = trainer._generate_and_score_completions


def timed(*args, **kwargs):
    began = time.perf_counter()
    out = generate(*args, **kwargs)
    times["generation"].append(time.perf_counter() - began)
    return out


trainer._generate_and_score_completions = timed
trainer.train()
times["lengths"] = [row["completions/mean_length"] for row in trainer.state.log_history
                    if "completions/mean_length" in row]
print("TIMES " + json.dumps(times))
'''


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model_name_or_path", required=True, help="The policy both trainers start from.")
    parser.add_argument("--trl_python", required=True, help="The python of a virtual environment with TRL.")
    parser.add_argument("--trl_pythonpath", default=None, help="PYTHONPATH for it (e.g. this venv's site-packages).")
    parser.add_argument("--steps", type=int, default=6, help="Optimizer steps of each run (the first is warm-up).")
    parser.add_argument("--num_generations", type=int, default=8, help="G, completions per prompt.")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8, help="Completions per step.")
    parser.add_argument("--max_completion_length", type=int, default=64, help="Most tokens per completion.")
    parser.add_argument("--num_prompts", type=int, default=64, help="Prompts taken from the default task.")
    parser.add_argument("--output", default=None, help="Write the figures here as JSON too.")
    return parser.parse_args(argv)


def default_prompts(folder: str, count: int) -> str:
    """The default task's first prompts (short ones: every run keeps them), as a jsonl file with a prompt column."""
    from common.flags import add_data_args
    from common.inputs.responses import build_docstring_task

    parser = argparse.ArgumentParser()
    add_data_args(parser)
    train, _ = build_docstring_task(parser.parse_args([]).cache_dir)
    path = os.path.join(folder, "prompts.jsonl")
    with open(train, encoding="utf-8") as f, open(path, "w", encoding="utf-8") as out:
        rows = [json.loads(line)["prompt"] for line in f]
        prompts = [p.rstrip("\n") for p in rows if len(p) < 400][:count]  # as the recipe's default task has them
        out.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
    return path


def ours(args: argparse.Namespace, prompts: str, folder: str) -> dict:
    out = os.path.join(folder, "ours")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "finetune_grpo.py"), "--model_name_or_path",
                    args.model_name_or_path, "--train_file", prompts, "--validation_split_percentage", "5",
                    "--reward_funcs", "common.inputs.prompts:compiles", "--output_dir", out, "--max_steps",
                    str(args.steps), "--num_generations", str(args.num_generations), "--per_device_train_batch_size",
                    str(args.per_device_train_batch_size), "--max_completion_length", str(args.max_completion_length),
                    "--logging_steps", "1", "--seed", "0", "--max_eval_samples", "1"],
                   check=True, cwd=ROOT, capture_output=True, env={**os.environ, "PYTHONPATH": ROOT})
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "loss" in r]
    steps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
    return {"step_seconds": statistics.median(steps),
            "generation_seconds": statistics.median(r["generation_seconds"] for r in rows[1:]),
            "mean_completion_length": statistics.mean(r["completions/mean_length"] for r in rows)}


def trl(args: argparse.Namespace, prompts: str, folder: str) -> dict:
    settings = {"output_dir": os.path.join(folder, "trl"), "steps": args.steps, "G": args.num_generations,
                "batch": args.per_device_train_batch_size, "length": args.max_completion_length, "lr": 1e-6,
                "model": args.model_name_or_path, "prompts": prompts}
    env = {**os.environ, **({"PYTHONPATH": args.trl_pythonpath} if args.trl_pythonpath else {})}
    proc = subprocess.run([args.trl_python, "-c", TRL_RUN.format(root=ROOT, settings=json.dumps(settings))],
                          capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("TIMES ")), None)
    if line is None:
        raise SystemExit(f"the TRL run failed:\n{proc.stderr[-3000:]}")
    times = json.loads(line[6:])
    return {"step_seconds": statistics.median(times["steps"][1:]),
            "generation_seconds": statistics.median(times["generation"][1:]),
            "mean_completion_length": statistics.mean(times["lengths"])}


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as folder:
        prompts = default_prompts(folder, args.num_prompts)
        figures = {"ours": ours(args, prompts, folder), "trl": trl(args, prompts, folder)}
    for name, row in figures.items():
        row["generation_share"] = row["generation_seconds"] / row["step_seconds"]
        print(f"{name}: step {row['step_seconds']:.3f} s, generation and scoring {row['generation_seconds']:.3f} s "
              f"({row['generation_share']:.0%}), completions of {row['mean_completion_length']:.1f} tokens")
    figures["speed_vs_trl"] = figures["trl"]["step_seconds"] / figures["ours"]["step_seconds"]
    print(f"ours vs TRL: {figures['speed_vs_trl']:.2f}x (> 1: ours is faster)")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
