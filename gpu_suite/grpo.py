"""The GRPO row (`perf_grpo`, part 2 and the headline part's last row): one GRPO step of scripts/finetune_grpo.py
beside TRL's `GRPOTrainer` through benchmarks/grpo_vs_trl.py, on a model of the 125m preset's shape built here from a
config (random weights, a BPE tokenizer trained on the default task's rows: nothing comes from the hub), the default
task's prompts and `compiles` reward, G 8, 16 completions of at most 64 tokens a step, DAPO, β 0, μ 1, bf16 on both
sides, 4 steps each (the first is warm-up). TRL must be importable on a GPU (tools/lent_gpu.sh --wheels carries it);
a CPU dry run without it runs ours alone and says so (the tiny preset, G 4, 8 completions of 16 tokens, 3 steps)."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import torch

from benchmarks import grpo_vs_trl
from gpu_suite.data import save_preset_llama
from gpu_suite.suite import FAIL, PASS, Outcome, Row, Suite

NO_TRL_ON_CUDA = "trl is not importable: carry it (tools/lent_gpu.sh --wheels pins trl==1.16.0)"


def shape(suite: Suite) -> dict:
    """The model and the run's size: the 125m preset on a GPU, the tiny one for the CPU dry run."""
    if suite.cuda:
        return {"preset": "125m", "vocab": 8192, "tokenizer_rows": 2000, "steps": 4, "G": 8, "batch": 16,
                "length": 64}
    return {"preset": "tiny", "vocab": 512, "tokenizer_rows": 300, "steps": 3, "G": 4, "batch": 8, "length": 16}


def prepare(suite: Suite) -> dict:
    """The policy's folder (fp32 random weights of the preset's shape, seed 0, and a BPE tokenizer trained on the
    default task's first rows) and its parameter count."""
    from common.inputs.data import train_bpe_tokenizer

    size = shape(suite)
    path = os.path.join(suite.work, "data", f"grpo-{size['preset']}")
    with open(grpo_vs_trl.default_task(task_cache(suite)), encoding="utf-8") as f:
        rows = [json.loads(line) for _, line in zip(range(size["tokenizer_rows"]), f)]
    tokenizer = train_bpe_tokenizer([r["prompt"] + r["completion"] for r in rows], size["vocab"])
    # fp32 weights, built on the CPU: both trainers load them and autocast
    return {"path": path, "parameters": save_preset_llama(path, tokenizer, size["preset"], len(tokenizer),
                                                          torch.float32)}


def task_cache(suite: Suite) -> str | None:
    """Where the default task is built: on a GPU the suite's cache (where the perf rows build the default corpus); on
    a CPU the recipes' own (None; built once per machine, where a dry run's work folder is new each time)."""
    return os.path.join(suite.work, "cache") if suite.cuda else None


def benchmark_argv(suite: Suite, model: str, trl: bool) -> list[str]:
    size = shape(suite)
    argv = ["--model_name_or_path", model, "--steps", str(size["steps"]), "--num_generations", str(size["G"]),
            "--per_device_train_batch_size", str(size["batch"]), "--max_completion_length", str(size["length"]),
            "--num_prompts", "64"]
    if task_cache(suite):
        argv += ["--cache_dir", task_cache(suite)]
    if suite.seconds_left() < math.inf:  # the part's budget, or the headline row's cap
        argv += ["--time_budget_s", f"{max(suite.seconds_left(), 1):.0f}"]
    return argv + ([] if trl else ["--ours_only"])


def check_grpo(suite: Suite) -> Outcome:
    """Ours, then TRL's GRPOTrainer, one after the other: step times (median after the first), generation shares,
    and ours' speed over TRL's (TRL's median step over ours')."""
    trl = importlib.util.find_spec("trl") is not None
    if suite.cuda and not trl:
        return Outcome(FAIL, NO_TRL_ON_CUDA)
    model = suite.memo("grpo_model", lambda: prepare(suite))
    size = shape(suite)
    try:
        args = grpo_vs_trl.parse_args(benchmark_argv(suite, model["path"], trl))
    except SystemExit as e:
        return Outcome(FAIL, f"benchmarks/grpo_vs_trl.py refused its arguments (exit {e.code})")
    usable = os.sched_getaffinity(0)
    if not suite.cuda:  # on a CPU its runs inherit one core, as the benchmark rows' do
        os.sched_setaffinity(0, {min(usable)})
    try:
        figures = grpo_vs_trl.measure(args)
    except SystemExit as e:
        return Outcome(FAIL, str(e.code).removeprefix("error: ").splitlines()[0][:240])
    finally:
        os.sched_setaffinity(0, usable)
    detail = {**figures, "preset": size["preset"], "parameters": model["parameters"], "steps": size["steps"],
              "num_generations": size["G"], "per_device_train_batch_size": size["batch"],
              "max_completion_length": size["length"]}
    ours = figures["ours"]
    figure = f"ours {1e3 * ours['step_seconds']:,.0f} ms a step ({ours['generation_share']:.0%} generating)"
    if figures["trl"] is None:
        figure += "; TRL not run: trl is not importable here (a CPU dry run: ours alone)"
    else:
        theirs = figures["trl"]
        figure += (f", TRL {theirs['version']} {1e3 * theirs['step_seconds']:,.0f} ms "
                   f"({theirs['generation_share']:.0%} generating): ours {figures['speed_vs_trl']:.2f}x TRL's speed; "
                   f"completions of {ours['mean_completion_length']:.1f} / {theirs['mean_completion_length']:.1f} "
                   "tokens on average")
    figure += (f"; {size['preset']} ({model['parameters'] / 1e6:,.1f}M), {size['batch']} completions (G "
               f"{size['G']}) of <= {size['length']} tokens, {'bf16' if figures['bf16'] else 'fp32'}")
    if not all(math.isfinite(row["step_seconds"]) and row["step_seconds"] > 0
               for row in (ours, figures["trl"]) if row is not None):
        return Outcome(FAIL, f"no step time: {figure}", detail)
    return Outcome(PASS, figure, detail)


def grpo_rows() -> list[Row]:
    return [Row("perf_grpo", 2, "GRPO: one step of scripts/finetune_grpo.py beside TRL's GRPOTrainer "
                "(benchmarks/grpo_vs_trl.py; a 125m-shaped Llama built from a config, bf16): step time, generation "
                "share, ours over TRL", check_grpo)]
