"""What a row runs: the suite's settings, a recipe run into its own folder, and what the rows share."""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from gpu_suite.runner import Runner

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN, SFT, CLASSIFIER, DPO = (os.path.join(ROOT, "scripts", f"{name}.py") for name in
                                  ("pretrain_llama", "finetune_causal_lm", "finetune_classifier", "finetune_dpo"))
CONFIGS = os.path.join(ROOT, "accelerate_configs")


@dataclass
class Settings:
    """Sizes of the runs: a few seconds each on a GPU, fewer steps and shorter blocks for the CPU dry run."""
    steps: int
    block_size: int
    batch: int
    corpus_rows: int
    perf_preset: str
    perf_seq: int
    perf_batch: int
    perf_vocab: int
    warm_steps: int
    timed_steps: int
    long_seq: int  # the long-context rows: one sequence of this many tokens per step


def settings_for(cuda: bool) -> Settings:
    if cuda:
        return Settings(steps=20, block_size=256, batch=8, corpus_rows=2000, perf_preset="1b", perf_seq=2048,
                        perf_batch=4, perf_vocab=8192, warm_steps=3, timed_steps=12, long_seq=16384)
    return Settings(steps=3, block_size=64, batch=8, corpus_rows=400, perf_preset="tiny", perf_seq=64, perf_batch=8,
                    perf_vocab=512, warm_steps=1, timed_steps=2, long_seq=128)


@dataclass
class Outcome:
    status: str
    figure: str
    detail: dict = field(default_factory=dict)


@dataclass
class Row:
    name: str
    part: int
    what: str
    check: Callable[["Suite"], Outcome]
    cuda_only: str | None = None   # why it needs a CUDA GPU; None: it runs on a CPU too
    needs: tuple[str, ...] = ()    # modules it imports that the GPU machine may lack
    slow: bool = False             # a build first (compile, CPU Adam): started before the quick rows
    gpus: int = 1                  # GPUs its runs need (more than this machine has: SKIP)
    flags: tuple[str, ...] = ()    # a pretraining row's flags beside the suite's (its run's command, for the tests)


@dataclass
class Run:
    """One finished script run: its output folder, log, logged training rows, and what went wrong (None: nothing)."""
    out: str
    log: str
    seconds: float
    metrics: list[dict]
    error: str | None

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.metrics if "loss" in r and "eval_loss" not in r]


class Suite:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cuda = torch.cuda.is_available()
        self.settings = settings_for(self.cuda)
        self.work = os.path.abspath(args.work_dir)
        self.deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
        self.row_deadline: float | None = None  # the running row's cap (the headline part runs one row at a time)
        # auto: on CPUs, where the suite's own runs (suite.train) are many; the headline part's are benchmark runs
        prefork = args.prefork == "yes" or (args.prefork == "auto" and not self.cuda and args.part != "headline")
        self.runner = Runner(prefork=prefork, cwd=ROOT)
        # On a CPU each run gets a core of its own (one row per core at a time); a GPU machine's runs are not pinned.
        self.cores: queue.Queue[int | None] = queue.Queue()
        for core in ([None] * args.jobs if self.cuda else sorted(os.sched_getaffinity(0))[:args.jobs]):
            self.cores.put(core)
        self.data: dict[str, str] = {}
        self.planned: set[str] = set()  # rows that will run
        self._memo: dict[str, object] = {}
        self._memo_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def memo(self, key: str, make: Callable[[], object]):
        """`make()` once per key, shared by the rows that need it (a reference run, the benchmark)."""
        with self._lock:
            lock = self._memo_locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._memo:
                self._memo[key] = make()
            return self._memo[key]

    def memoized(self, key: str, default=None):
        """What `memo(key, ...)` made, or `default` when no row asked for it."""
        return self._memo.get(key, default)

    def seconds_left(self) -> float:
        """Until the part's budget or the running row's cap, whichever comes first."""
        deadlines = [d for d in (self.deadline, self.row_deadline) if d is not None]
        return min(deadlines) - time.monotonic() if deadlines else math.inf

    def train(self, name: str, script: str, argv: list[str], config: str | None = None, processes: int = 1) -> Run:
        """Run a script (under `accelerate launch --config_file <config> --num_processes <processes>` when a config is
        given) into work/runs/<name>."""
        out, log = os.path.join(self.work, "runs", name), os.path.join(self.work, "logs", f"{name}.log")
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(os.path.dirname(log), exist_ok=True)
        launcher = [sys.executable] if config is None else [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", os.path.join(CONFIGS, config),
            "--num_processes", str(processes), "--main_process_port", "0"]  # port 0: parallel rows never collide
        timeout = min(self.args.row_timeout_s, self.seconds_left())
        began = time.monotonic()
        core = self.cores.get()
        try:
            code = self.runner.run(launcher + [script, *argv, "--output_dir", out], log, timeout, core)
        finally:
            self.cores.put(core)
        seconds = time.monotonic() - began
        metrics = []
        if os.path.isfile(os.path.join(out, "metrics.jsonl")):
            with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
                metrics = [json.loads(line) for line in f if line.strip()]
        error = None
        if code is None:
            error = f"stopped after {timeout:.0f} s (row timeout, the row's cap or the part's time budget)"
        elif code != 0:
            error = f"exit status {code}: {last_log_line(log)}"
        return Run(out, log, seconds, metrics, error)

    def pretrain_args(self, steps: int | None = None) -> list[str]:
        s = self.settings
        return ["--train_file", self.data["train"], "--validation_file", self.data["validation"],
                "--tokenizer_vocab_size", "512", "--block_size", str(s.block_size), "--cache_dir",
                os.path.join(self.work, "cache"), "--max_steps", str(steps or s.steps), "--logging_steps", "1",
                "--per_device_train_batch_size", str(s.batch), "--learning_rate", "3e-3", "--seed", "0",
                "--sample_max_new_tokens", "0", "--max_eval_samples", "16"]

    def reference_run(self) -> Run:
        """bf16, SDPA, 8 x 1: the `bf16` row's run, and what the eager and accumulation rows compare with."""
        return self.memo("bf16", lambda: self.train("bf16", PRETRAIN, self.pretrain_args() + ["--bf16"]))


def last_log_line(log: str) -> str:
    """The line that says what went wrong: the last `error:` / exception line, else the last line."""
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f.read().replace("\r", "\n").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    for line in reversed(lines):
        if line.startswith("error:") or "Error" in line.split(":")[0] or "error:" in line:
            return line[:240]
    return lines[-1][:240] if lines else "(empty log)"
