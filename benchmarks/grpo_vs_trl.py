#!/usr/bin/env python
"""One GRPO step of scripts/finetune_grpo.py beside TRL's `GRPOTrainer` on the same model, prompts, G, lengths and
flags: the median step time after the first, and the share of it spent generating (and scoring) completions.

    python benchmarks/grpo_vs_trl.py --model_name_or_path outputs/docstring-to-body \\
        --trl_python /path/to/trl-venv/bin/python --steps 6

TRL is not a dependency: it runs in this interpreter when `trl` is importable here (the GPU suite's `perf_grpo` row:
the lent machine gets trl as a carried wheel), or in its own virtual environment (`--trl_python`), which may borrow
this one's packages through PYTHONPATH (`pip install --no-deps trl` there); `--ours_only` runs ours alone. Both use
the default task's prompts and its `compiles` reward, transformers' `generate` (TRL without vLLM), the DAPO loss,
beta 0, μ 1, no gradient checkpointing (TRL's default is on; ours is off), fp32 weights, one process; with CUDA, bf16
mixed precision on both sides (ours `--bf16`, TRL `bf16=True`) and fp32 without it. The model may be any folder
(the suite's: a preset built from a config; nothing from the hub). Ours: the step time from metrics.jsonl's rows,
generation from its `generation_seconds`. TRL: a callback times each step, `_generate_and_score_completions` is timed
by a wrapper (generation, scoring and the advantages).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TRL_RUN = r'''
import json, sys, time
import torch, trl
from datasets import load_dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
sys.path.insert(0, {root!r})
from common.inputs.rewards import compiles

settings = json.loads({settings!r})
times = {{"steps": [], "generation": [], "version": trl.__version__}}


def now():
    if torch.cuda.is_available():  # the step's kernels are done when its time is read
        torch.cuda.synchronize()
    return time.perf_counter()


class StepTimes(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        self.began = now()

    def on_step_end(self, args, state, control, **kwargs):
        times["steps"].append(now() - self.began)


config = GRPOConfig(output_dir=settings["output_dir"], use_cpu=settings["cpu"], report_to="none",
                    max_steps=settings["steps"], per_device_train_batch_size=settings["batch"],
                    num_generations=settings["G"], max_completion_length=settings["length"],
                    learning_rate=settings["lr"], logging_steps=1, save_strategy="no", bf16=settings["bf16"], seed=0,
                    beta=0.0, num_iterations=1, loss_type="dapo", temperature=1.0, gradient_checkpointing=False)
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
    parser.add_argument("--model_name_or_path", required=True, help="The policy both trainers start from (a folder).")
    parser.add_argument("--trl_python", default=None, help="The python of a virtual environment with TRL (default: "
                        "this one, when trl is importable here).")
    parser.add_argument("--trl_pythonpath", default=None, help="PYTHONPATH for it (e.g. this venv's site-packages).")
    parser.add_argument("--ours_only", action="store_true", help="Run ours alone (no TRL): no speed_vs_trl.")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                        help="bf16 mixed precision on both sides (default: when CUDA is present; fp32 otherwise).")
    parser.add_argument("--steps", type=int, default=6, help="Optimizer steps of each run (the first is warm-up).")
    parser.add_argument("--num_generations", type=int, default=8, help="G, completions per prompt.")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8, help="Completions per step.")
    parser.add_argument("--max_completion_length", type=int, default=64, help="Most tokens per completion.")
    parser.add_argument("--num_prompts", type=int, default=64, help="Prompts taken from the default task.")
    parser.add_argument("--cache_dir", default=None, help="Where the default task is built (default: the recipes').")
    parser.add_argument("--time_budget_s", type=float, default=None, help="Stop a run still going after this many "
                        "seconds from the start (an error).")
    parser.add_argument("--output", default=None, help="Write the figures here as JSON too.")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is warm-up")
    if not args.ours_only and args.trl_python is None:
        if importlib.util.find_spec("trl") is None:
            parser.error("trl is not importable here: pip install trl==1.16.0, give --trl_python (a venv with TRL) "
                         "or --ours_only")
        args.trl_python = sys.executable
    return args


def default_task(cache_dir: str | None = None) -> str:
    """The default task's train file (prompt and completion rows), built under `cache_dir` (None: the recipes')."""
    from common.flags import add_data_args
    from common.inputs.responses import build_docstring_task

    parser = argparse.ArgumentParser()
    add_data_args(parser)
    return build_docstring_task(cache_dir or parser.parse_args([]).cache_dir)[0]


def default_prompts(folder: str, count: int, cache_dir: str | None = None) -> str:
    """The default task's first prompts (short ones: every run keeps them), as a jsonl file with a prompt column."""
    path = os.path.join(folder, "prompts.jsonl")
    with open(default_task(cache_dir), encoding="utf-8") as f, open(path, "w", encoding="utf-8") as out:
        rows = [json.loads(line)["prompt"] for line in f]
        prompts = [p.rstrip("\n") for p in rows if len(p) < 400][:count]  # as the recipe's default task has them
        out.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
    return path


def run(cmd: list[str], deadline: float | None, what: str, **kwargs) -> subprocess.CompletedProcess:
    """`cmd` to its end, or a one-line SystemExit when it fails or passes `deadline` (time.monotonic())."""
    timeout = None if deadline is None else max(deadline - time.monotonic(), 1.0)
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kwargs)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"error: {what} was stopped at the time budget ({timeout:.0f} s left when it started)")


def failure(proc: subprocess.CompletedProcess) -> str:
    """The line of a failed run's output that says what went wrong (the last error line, else the last line)."""
    lines = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()] or ["(no output)"]
    return next((line for line in reversed(lines) if "error" in line.lower()), lines[-1])[:300]


def ours(args: argparse.Namespace, prompts: str, folder: str, deadline: float | None = None) -> dict:
    out = os.path.join(folder, "ours")
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "finetune_grpo.py"), "--model_name_or_path",
           args.model_name_or_path, "--train_file", prompts, "--validation_split_percentage", "5",
           "--reward_funcs", "common.inputs.rewards:compiles", "--output_dir", out, "--max_steps",
           str(args.steps), "--num_generations", str(args.num_generations), "--per_device_train_batch_size",
           str(args.per_device_train_batch_size), "--max_completion_length", str(args.max_completion_length),
           "--loss_type", "dapo", "--beta", "0", "--num_iterations", "1", "--logging_steps", "1", "--seed", "0",
           "--max_eval_samples", "1", *(["--bf16"] if args.bf16 else [])]
    path = os.pathsep.join([ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    proc = run(cmd, deadline, "our GRPO run", env={**os.environ, "PYTHONPATH": path})  # keeps the caller's packages
    if proc.returncode != 0:
        raise SystemExit(f"error: our GRPO run failed (exit {proc.returncode}): {failure(proc)}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "loss" in r]
    steps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
    return {"step_seconds": statistics.median(steps),
            "generation_seconds": statistics.median(r["generation_seconds"] for r in rows[1:]),
            "mean_completion_length": statistics.mean(r["completions/mean_length"] for r in rows)}


def trl(args: argparse.Namespace, prompts: str, folder: str, deadline: float | None = None) -> dict:
    settings = {"output_dir": os.path.join(folder, "trl"), "steps": args.steps, "G": args.num_generations,
                "batch": args.per_device_train_batch_size, "length": args.max_completion_length, "lr": 1e-6,
                "model": args.model_name_or_path, "prompts": prompts, "bf16": bool(args.bf16),
                "cpu": not cuda_present()}
    env = {**os.environ, **({"PYTHONPATH": args.trl_pythonpath} if args.trl_pythonpath else {})}
    proc = run([args.trl_python, "-c", TRL_RUN.format(root=ROOT, settings=json.dumps(settings))], deadline,
               "the TRL run", env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("TIMES ")), None)
    if line is None:
        raise SystemExit(f"error: the TRL run failed (exit {proc.returncode}): {failure(proc)}")
    times = json.loads(line[6:])
    return {"step_seconds": statistics.median(times["steps"][1:]),
            "generation_seconds": statistics.median(times["generation"][1:]),
            "mean_completion_length": statistics.mean(times["lengths"]), "version": times["version"]}


def cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


def measure(args: argparse.Namespace) -> dict:
    """Ours, then TRL (unless --ours_only), one after the other: {"ours": figures, "trl": figures or None,
    "speed_vs_trl": TRL's median step time over ours' or None, "bf16": ...}. Figures: step_seconds,
    generation_seconds, generation_share, mean_completion_length. A failed or stopped run: SystemExit, one line."""
    if args.bf16 is None:
        args.bf16 = cuda_present()
    deadline = None if args.time_budget_s is None else time.monotonic() + args.time_budget_s
    with tempfile.TemporaryDirectory() as folder:
        prompts = default_prompts(folder, args.num_prompts, args.cache_dir)
        figures = {"ours": ours(args, prompts, folder, deadline),
                   "trl": None if args.ours_only else trl(args, prompts, folder, deadline)}
    for row in (figures["ours"], figures["trl"]):
        if row is not None:
            row["generation_share"] = row["generation_seconds"] / row["step_seconds"]
    figures["speed_vs_trl"] = None if args.ours_only else \
        figures["trl"]["step_seconds"] / figures["ours"]["step_seconds"]
    figures["bf16"] = args.bf16
    return figures


def main() -> None:
    args = parse_args()
    figures = measure(args)
    for name in ("ours", "trl"):
        row = figures[name]
        if row is not None:
            print(f"{name}: step {row['step_seconds']:.3f} s, generation and scoring {row['generation_seconds']:.3f} s "
                  f"({row['generation_share']:.0%}), completions of {row['mean_completion_length']:.1f} tokens")
    if figures["speed_vs_trl"] is not None:
        print(f"ours vs TRL: {figures['speed_vs_trl']:.2f}x (> 1: ours is faster)")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
