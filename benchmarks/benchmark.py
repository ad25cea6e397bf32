#!/usr/bin/env python
"""Benchmark a training script under each speed/memory technique, against a plain PyTorch loop.

    python benchmarks/benchmark.py --quick                               # a few minutes on a 2-core CPU
    python benchmarks/benchmark.py --repeats 3                           # CPU: small preset; GPU: 1b preset, seq 2048
    python benchmarks/benchmark.py --methods baseline,bf16,plain_pytorch -- --train_file my.jsonl
    python benchmarks/benchmark.py --script scripts/finetune_classifier.py --methods baseline,bf16 \\
        -- --model_name_or_path my-bert --train_file train.jsonl --validation_file dev.jsonl
    python benchmarks/benchmark.py --script scripts/finetune_causal_lm.py --methods baseline,lora,qlora \\
        --seq_flag=--max_seq_length -- --model_name_or_path outputs/pretrain   # full fine-tuning vs LoRA vs QLoRA

Each method runs in a fresh process for `--warm_steps` + `--timed_steps` optimizer steps, writing a row every
`--logging_steps` (default 1: a time per step; 10 leaves nine steps in ten free of the row's read to the host); the
timed rows are read back from the run's metrics.jsonl (`time` stamps, tokens/s, peak memory, MFU, loss).
Arguments after `--` go to every run of the script. `plain_pytorch` runs benchmarks/plain_loop.py (the same job without
accelerate) with the flags of `--plain_reference`, and the table reports our tokens/s over it.
Outputs in --output_dir: results.json (a list of rows, each with its `environment`), results.md, results.png.
"""

from __future__ import annotations

import datetime
import glob
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch

from common.flags import ArgumentParser
from common.errors import fail

PRETRAIN, PLAIN = os.path.join("scripts", "pretrain_llama.py"), os.path.join("benchmarks", "plain_loop.py")
TRAINER = os.path.join("benchmarks", "trainer_loop.py")  # the job through transformers' Trainer (plain_loop's flags)
RUN_FLAGS = ("--output_dir", "--max_steps", "--logging_steps", "--eval_steps", "--checkpointing_steps",
             "--resume_from_checkpoint")  # set by the benchmark (the timed window must hold training steps only)
ADAMW_COSINE = ["--optim", "adamw_torch_fused", "--lr_scheduler_type", "cosine", "--learning_rate", "5e-4"]
VERSIONS = ("torch", "accelerate", "transformers", "datasets", "deepspeed", "bitsandbytes")


def parse_args(argv: list[str] | None = None, extra_methods: dict[str, dict] | None = None):
    """The benchmark's flags. `extra_methods` adds rows to the method table (same shape as `method_table`'s), for
    callers such as the GPU suite (gpu_suite/performance.py) that time their own combinations with this machinery."""
    argv = sys.argv[1:] if argv is None else argv
    script_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny preset, 128 tokens, few steps: minutes on a CPU")
    parser.add_argument("--script", help=f"Training script to benchmark (default: {PRETRAIN}).")
    parser.add_argument("--methods", help="Comma-separated methods (default: all). `baseline` is always run (see "
                        "--no_baseline).")
    parser.add_argument("--no_baseline", action="store_true", help="Run only the methods --methods names: no fp32 "
                        "baseline unless named, so no ratios against it (a GPU it does not fit; a caller that runs "
                        "methods one at a time).")
    parser.add_argument("--plain_reference", default="baseline", help="Method whose flags plain_pytorch mirrors.")
    parser.add_argument("--model_preset", help="Default: tiny (--quick), small (CPU), 1b (GPU); pretraining only.")
    parser.add_argument("--seq_len", type=int, help="Default: 128 (--quick), 256 (CPU), 2048 (GPU).")
    parser.add_argument("--seq_flag", help="The script's sequence-length flag (default: --block_size when pretraining"
                        "; '' passes none).")
    parser.add_argument("--per_device_train_batch_size", type=int, help="Default: 8 (CPU), 4 (GPU).")
    parser.add_argument("--warm_steps", type=int, help="Untimed optimizer steps first (compile, caches). Default 3/5.")
    parser.add_argument("--timed_steps", type=int, help="Timed optimizer steps. Default: 10 (--quick), 20.")
    parser.add_argument("--logging_steps", type=int, default=1, help="A metrics row (and a timing) every N steps; "
                        "--warm_steps and --timed_steps must be multiples of it.")
    parser.add_argument("--repeats", type=int, default=1, help="Runs per method; rows hold the medians.")
    parser.add_argument("--stop_after_timed_steps", action="store_true", help="Stop each run once its timed steps "
                        "are logged, without waiting for its evaluation and export (minutes for large models).")
    parser.add_argument("--time_budget_s", type=float, help="Start no run after this many seconds; a run still going "
                        "then is stopped. Both are reported as failed. Default: no limit.")
    parser.add_argument("--output_dir", default="outputs/benchmark",
                        help="results.json, results.md, results.png and each run's log and metrics (runs/).")
    args = parser.parse_args(argv)
    args.script_args = script_args

    cuda = torch.cuda.is_available()
    if args.script and not os.path.isfile(args.script):
        fail(f"--script {args.script}: no such file")
    args.script = os.path.relpath(os.path.abspath(args.script), ROOT) if args.script else PRETRAIN
    pretraining = args.script == PRETRAIN
    for flag in RUN_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in script_args):
            fail(f"{flag} is set by the benchmark; do not pass it after --")
    if args.model_preset is None and pretraining and not ({"--model_name_or_path", "--config_name"} & set(script_args)):
        args.model_preset = "tiny" if args.quick else "1b" if cuda else "small"
    args.seq_flag = ("--block_size" if pretraining else "") if args.seq_flag is None else args.seq_flag
    args.seq_len = args.seq_len or (128 if args.quick else 2048 if cuda else 256)
    args.per_device_train_batch_size = args.per_device_train_batch_size or (4 if cuda and not args.quick else 8)
    if args.warm_steps is None:
        args.warm_steps = 3 if args.quick else 5
    args.timed_steps = args.timed_steps or (10 if args.quick else 20)
    for name in ("seq_len", "per_device_train_batch_size", "warm_steps", "repeats", "logging_steps"):
        if getattr(args, name) < 1:
            fail(f"--{name} must be >= 1 (got {getattr(args, name)})")
    if args.timed_steps < 2 * args.logging_steps:
        fail(f"--timed_steps must be >= 2 x --logging_steps for a spread (got {args.timed_steps})")
    if args.warm_steps % args.logging_steps or args.timed_steps % args.logging_steps:
        fail(f"--warm_steps ({args.warm_steps}) and --timed_steps ({args.timed_steps}) must be multiples of "
             f"--logging_steps ({args.logging_steps})")
    args.table = {**method_table(args, cuda, pretraining), **(extra_methods or {})}
    wanted = args.methods.split(",") if args.methods else list(args.table)
    unknown = [m for m in wanted if m not in args.table]
    if unknown:
        fail(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(args.table)}")
    if "plain_pytorch" in wanted and (args.plain_reference not in args.table
                                      or "launcher" in args.table[args.plain_reference]):
        fail(f"--plain_reference {args.plain_reference} is not a single-process method")
    args.methods = ([] if args.no_baseline else ["baseline"]) + [m for m in dict.fromkeys(wanted)
                                                                 if m != "baseline" or args.no_baseline]
    args.output_dir = os.path.abspath(args.output_dir)
    args.deadline = None if args.time_budget_s is None else time.monotonic() + args.time_budget_s
    return args


def method_table(args, cuda: bool, pretraining: bool) -> dict[str, dict]:
    """name -> {"flags": [...], "launcher": [...] (accelerate configs), "script": another script than --script (the
    peers of the pretraining script: PLAIN, TRAINER), "skip": reason or None}."""
    bf16_ok = not cuda or torch.cuda.is_bf16_supported()
    half = ["--bf16"] if bf16_ok else ["--fp16"]
    mb = max(1, args.per_device_train_batch_size // 4)  # accumulation keeps the samples per optimizer step
    accumulate = ["--per_device_train_batch_size", str(mb), "--gradient_accumulation_steps", "4"]
    table = {
        "baseline": {"flags": []},
        "no_clipping": {"flags": ["--max_grad_norm", "0"]},  # the plain loop's work: compare the two with it
        "accumulation": {"flags": accumulate},
        "gradient_checkpointing": {"flags": ["--gradient_checkpointing"]},
        "selective_ac_2": {"flags": ["--selective_ac_option", "2"]},  # every 2nd layer checkpointed
        "selective_ac_op": {"flags": ["--selective_ac_option", "op"]},  # matmul outputs kept, the rest recomputed
        "activation_offloading": {"flags": ["--gradient_checkpointing", "--activation_offloading"]},
        "fp16": {"flags": ["--fp16"], "skip": None if cuda else "fp16 loss scaling needs a CUDA GPU"},
        "bf16": {"flags": ["--bf16"], "skip": None if bf16_ok else "this GPU has no bf16"},
        "tf32": {"flags": ["--tf32"], "skip": None if cuda and torch.cuda.get_device_capability()[0] >= 8
                 else "needs an NVIDIA GPU, Ampere or newer"},
        "adamw_8bit": {"flags": ["--optim", "adamw_8bit"]},
        "adafactor": {"flags": ["--optim", "adafactor"]},
        "compile": {"flags": ["--torch_compile"]},
        "chunked_ce": {"flags": ["--chunked_cross_entropy"],
                       "skip": "a causal LM flag" if args.script.endswith("finetune_classifier.py") else None},
        # The speed combination, and the memory one (Hugging Face's single-GPU guide: bs/4 x 4 + checkpointing +
        # half precision + 8-bit Adam).
        "bf16_compile": {"flags": half + ["--torch_compile"] + (["--optim", "adamw_torch_fused"] if cuda else [])},
        "combined": {"flags": accumulate + ["--gradient_checkpointing"] + half + ["--optim", "adamw_8bit"]},
        "plain_pytorch": {"flags": [], "skip": None if pretraining else f"plain_loop.py mirrors {PRETRAIN} only"},
        # The corpus tokenized and packed on the fly while training (baseline: tokenized up front, cached).
        "streaming": {"flags": ["--streaming"], "skip": None if pretraining else f"--streaming is a {PRETRAIN} flag"},
        # A LoRA adapter on the frozen base (in bf16 with --bf16), and on a 4-bit base: fine-tuning scripts only.
        "lora": {"flags": ["--use_peft"], "skip": "--use_peft is a fine-tuning flag" if pretraining else None},
        "qlora": {"flags": ["--use_peft", "--load_in_4bit"],
                  "skip": "--use_peft is a fine-tuning flag" if pretraining else None},
        # DPO's reference: live (baseline), its values computed once before training, or the adapter disabled (lora)
        "precompute_ref": {"flags": ["--precompute_ref_log_probs"],
                           "skip": None if args.script.endswith("finetune_dpo.py") else "a finetune_dpo.py flag"},
    }
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or "accelerate"
    import yaml

    for path in sorted(glob.glob(os.path.join(ROOT, "accelerate_configs", "*.yaml"))):
        with open(path, encoding="utf-8") as f:
            kind = str((yaml.safe_load(f) or {}).get("distributed_type", "")).lower()
        if kind not in ("deepspeed", "fsdp"):
            continue
        name = os.path.splitext(os.path.basename(path))[0]
        name = name if name.startswith(kind[:4]) else f"{kind}_{name}"
        skip = None if cuda else "DeepSpeed/FSDP rows run on GPUs only"
        if "nvme" in name:
            skip = "needs the nvme_path in its DeepSpeed JSON set to a local NVMe drive"
        table[name] = {"flags": half, "skip": skip,  # one device, as every other row
                       "launcher": [accelerate, "launch", "--config_file", path, "--num_processes", "1"]}
    return table


def environment(argv: list[str]) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    versions = {"python": platform.python_version()}
    for name in VERSIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:  # a copied tree (a GPU machine's) may have no git or no .git
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        commit = subprocess.CompletedProcess([], 1, stdout="")
    cuda = torch.cuda.is_available()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cpu": cpu, "cpu_cores": os.cpu_count(),
                    "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                    "memory_gib": round(memory / 2**30, 1),
                    "gpu": torch.cuda.get_device_name() if cuda else None,
                    "gpu_count": torch.cuda.device_count() if cuda else 0, "cuda": torch.version.cuda,
                    "platform": platform.platform()},
        "versions": versions,
        "command": "".join(f"{k}={os.environ[k]} " for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
                           if k in os.environ)
                   + "python " + shlex.join([os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)] + argv),
        "git_commit": commit.stdout.strip() or None,
    }


def run_once(args, method: str, repeat: int) -> dict:
    """One fresh process of `method`; the timed steps' figures, or {"error": ...}."""
    plain = method == "plain_pytorch"
    spec = args.table[args.plain_reference if plain else method]
    script = PLAIN if plain else spec.get("script", args.script)
    run_dir = os.path.join(args.output_dir, "runs", f"{method}-{repeat}")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    total = args.warm_steps + args.timed_steps
    launcher = [sys.executable] if plain else spec.get("launcher", [sys.executable])
    cmd = launcher + [os.path.join(ROOT, script), "--max_steps", str(total),
                      "--logging_steps", str(args.logging_steps),
                      "--per_device_train_batch_size", str(args.per_device_train_batch_size)]
    if args.seq_flag:
        cmd += [args.seq_flag, str(args.seq_len)]
    if args.model_preset:
        cmd += ["--model_preset", args.model_preset]
    if script in (PRETRAIN, PLAIN, TRAINER):  # keep the untimed tail (final evaluation, sample) short
        cmd += ["--sample_max_new_tokens", "0", "--max_eval_samples", "2"] + \
            (["--max_train_samples", "200"] if args.quick else [])
    if script == PRETRAIN:  # its peers (plain loop, Trainer) run AdamW + cosine: so does it, not its Muon default
        cmd += ADAMW_COSINE
    cmd += spec["flags"] + args.script_args + ["--output_dir", run_dir]
    timeout = None if args.deadline is None else args.deadline - time.monotonic()
    if timeout is not None and timeout <= 0:
        return {"error": "not started: the --time_budget_s is spent"}
    print(f"[{method} #{repeat + 1}] {shlex.join(cmd)}", flush=True)
    with open(os.path.join(run_dir, "log.txt"), "w", encoding="utf-8") as log:
        done = (lambda: len(timed_rows(os.path.join(run_dir, "metrics.jsonl"))) == total // args.logging_steps) \
            if args.stop_after_timed_steps else None
        returncode = run_logged(cmd, log, timeout, done)
    rows = timed_rows(os.path.join(run_dir, "metrics.jsonl"))
    for name in os.listdir(run_dir):  # keep the figures and the log, not the exported model
        if name not in ("metrics.jsonl", "all_results.json", "log.txt"):
            path = os.path.join(run_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    every = args.logging_steps
    complete = len(rows) == total // every and "time" in rows[-1]
    # Stopped after its last timed step (at --time_budget_s, or as asked): only the evaluation and export were cut.
    tail_cut = returncode is None and complete and not args.stop_after_timed_steps
    if not complete or returncode not in (0, None):
        with open(os.path.join(run_dir, "log.txt"), encoding="utf-8") as f:
            tail = f.read()[-1500:]
        status = f"stopped after {timeout:.0f} s (--time_budget_s)" if returncode is None else \
            f"exit status {returncode}"
        return {"error": f"{status}, {len(rows)}/{total // every} logged rows with a `time` stamp; log: "
                         f"{os.path.join(run_dir, 'log.txt')}\n{tail}"}
    timed = rows[args.warm_steps // every:]
    step_times = [(b["time"] - a["time"]) / every for a, b in zip(rows[args.warm_steps // every - 1:], timed)]
    seconds = sum(step_times) * every

    def time_weighted(key: str) -> float | None:  # the rate over the whole timed window
        return sum(r[key] * t * every for r, t in zip(timed, step_times)) / seconds if key in timed[-1] else None

    samples_per_step = flag_value(cmd, "--per_device_train_batch_size") * \
        flag_value(cmd, "--gradient_accumulation_steps")
    return {"tokens_per_second": time_weighted("tokens_per_second"),
            "samples_per_second": samples_per_step * args.timed_steps / seconds, "step_times": step_times,
            "mfu": time_weighted("mfu"), "peak_memory_bytes": max(r["peak_memory_bytes"] for r in rows),
            "peak_memory_reserved_bytes": max((r.get("peak_memory_reserved_bytes") or 0) for r in rows) or None,
            "final_loss": rows[-1]["loss"], "tail_cut": tail_cut}


def timed_rows(path: str) -> list[dict]:
    """The metrics rows of a run that carry a throughput (one per --logging_steps steps), as written so far (a line
    still being written, or cut by a stop, is not one)."""
    rows = []
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
    return [r for r in rows if "tokens_per_second" in r]


def run_logged(cmd: list[str], log, timeout: float | None, done=None) -> int | None:
    """Run `cmd` with its output in `log`; its exit status, or None when it ran past `timeout`, or `done()` (asked
    twice a second) said it has done what was needed, and it was stopped.

    With a timeout or `done` it gets its own process group, so that a launcher's workers (accelerate launch -> the
    script) stop with it; otherwise it stays in ours (Ctrl-C reaches it).
    """
    group = timeout is not None or done is not None
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=group,
                            env={"TOKENIZERS_PARALLELISM": "false", **os.environ})
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            return proc.wait(timeout=None if done is None and left == math.inf else max(min(left, 0.5), 0))
        except subprocess.TimeoutExpired:
            if left <= 0 or (done is not None and done()):
                break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return None


def flag_value(cmd: list[str], flag: str, default: int = 1) -> int:
    """The value an argparse script sees for `flag` in `cmd` (the last one given wins)."""
    value = default
    for i, a in enumerate(cmd):
        if a == flag and i + 1 < len(cmd):
            value = int(cmd[i + 1])
        elif a.startswith(flag + "="):
            value = int(a.split("=", 1)[1])
    return value


def run_all(args, done: tuple[str, ...] = ()) -> tuple[dict[str, list[dict]], dict[str, str], dict[str, str]]:
    """Each method's runs; `done`: methods the caller already ran (the plain loop's reference is not run again)."""
    runs, skipped, failed = {}, {}, {}
    order = [m for m in args.methods if m != "plain_pytorch"]
    for m in args.methods:
        ref = args.plain_reference if m == "plain_pytorch" else m
        reason = args.table[m].get("skip") or args.table[ref].get("skip")
        if reason:
            skipped[m] = reason
    if "plain_pytorch" in args.methods and "plain_pytorch" not in skipped:
        if args.plain_reference not in order and args.plain_reference not in done:
            order.append(args.plain_reference)
        order.insert(order.index(args.plain_reference) + 1 if args.plain_reference in order else len(order),
                     "plain_pytorch")
    order = [m for m in order if m not in skipped]
    for repeat in range(args.repeats):
        this = list(order)
        if repeat % 2 and "plain_pytorch" in this:  # alternate which of the pair runs first: drift cancels
            i = this.index("plain_pytorch")
            this[i - 1], this[i] = this[i], this[i - 1]
        for m in this:
            if m in failed:
                continue
            result = run_once(args, m, repeat)
            if "error" in result:
                failed[m] = result["error"]
                print(f"[{m}] FAILED: {result['error']}", file=sys.stderr, flush=True)
            else:
                runs.setdefault(m, []).append(result)
    return {m: runs[m] for m in order if m in runs and m not in failed}, skipped, failed


def summarise(args, runs: dict[str, list[dict]], env: dict) -> list[dict]:
    rows = []
    for method, results in runs.items():
        med = lambda key: statistics.median(r[key] for r in results) if results[0][key] is not None else None  # noqa
        steps = sorted(t for r in results for t in r["step_times"])
        quartiles = statistics.quantiles(steps, n=4) if len(steps) > 1 else [steps[0]] * 3
        flags = args.table[args.plain_reference if method == "plain_pytorch" else method]["flags"]
        rows.append({
            "method": method, "flags": flags,
            "script": PLAIN if method == "plain_pytorch" else args.table[method].get("script", args.script),
            "tokens_per_second": med("tokens_per_second"), "samples_per_second": med("samples_per_second"),
            "tokens_per_second_runs": [r["tokens_per_second"] for r in results],
            "step_time_median_s": quartiles[1], "step_time_p25_s": quartiles[0], "step_time_p75_s": quartiles[2],
            "step_time_min_s": steps[0],
            "step_time_median_runs": [statistics.median(r["step_times"]) for r in results],
            "peak_memory_bytes": med("peak_memory_bytes"),
            "peak_memory_reserved_bytes": med("peak_memory_reserved_bytes"),
            "mfu": med("mfu"), "final_loss": med("final_loss"), "repeats": len(results),
            "tail_cut": any(r.get("tail_cut") for r in results),
            "setup": {"model_preset": args.model_preset, "seq_len": args.seq_len, "warm_steps": args.warm_steps,
                      "timed_steps": args.timed_steps, "per_device_train_batch_size": args.per_device_train_batch_size,
                      "script_args": args.script_args},
            "environment": env,
        })
    base = next((r for r in rows if r["method"] == "baseline"), None)  # None: run without it (--no_baseline)
    for r in rows:
        r["speed_vs_baseline"] = r["tokens_per_second"] / base["tokens_per_second"] if base else None
        r["memory_vs_baseline"] = r["peak_memory_bytes"] / base["peak_memory_bytes"] if base else None
    plain = next((r for r in rows if r["method"] == "plain_pytorch"), None)
    ours = next((r for r in rows if r["method"] == args.plain_reference), None)
    for r in rows if plain else []:  # each repeat's runs are one round: a ratio per round, their median
        if r is not plain and len(r["step_time_median_runs"]) == len(plain["step_time_median_runs"]):
            pairs = [p / o for p, o in zip(plain["step_time_median_runs"], r["step_time_median_runs"])]
            r.update(over_plain_median_of_rounds=statistics.median(pairs), over_plain_rounds=pairs)
    if plain and ours:
        # Same tokens per step, so tokens/s over tokens/s is step time over step time. Medians of steps: robust to
        # bursts of other work on a shared machine; per-run pairs (run back to back) show the spread; the fastest
        # steps are the least disturbed of all.
        plain.update(reference_method=args.plain_reference,
                     ours_over_plain=plain["step_time_median_s"] / ours["step_time_median_s"],
                     ours_over_plain_runs=[p / o for p, o in zip(plain["step_time_median_runs"],
                                                                 ours["step_time_median_runs"])],
                     ours_over_plain_fastest_step=plain["step_time_min_s"] / ours["step_time_min_s"])
    return rows


def write_markdown(path: str, rows: list[dict], env: dict, skipped: dict, failed: dict, args) -> None:
    m, v = env["machine"], env["versions"]
    gpu = f"{m['gpu_count']} x {m['gpu']} (CUDA {m['cuda']})" if m["gpu"] else "no GPU"
    lines = [f"# Benchmark: {args.script}", "",
             f"- Date: {env['date']}; commit {env['git_commit']}",
             f"- Machine: {m['cpu']}, {m['cpu_cores']} cores ({m['usable_cores']} usable), {m['memory_gib']} GiB RAM, "
             f"{gpu}",
             "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
             f"- Command: `{env['command']}`",
             f"- Setup: preset {args.model_preset or '(from the script args)'}, sequence "
             f"{args.seq_len if args.seq_flag else '(from the script args)'}, "
             f"{args.per_device_train_batch_size} sequences per optimizer step, {args.warm_steps} warm-up + "
             f"{args.timed_steps} timed optimizer steps, {args.repeats} run(s) per method, each in a fresh process; "
             "figures are medians over runs, step times pooled over all timed steps.", "",
             "| method | flags | tokens/s | samples/s | speed vs baseline | step ms: median [p25-p75] fastest | "
             "peak memory MiB | memory vs baseline | MFU | final loss |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        runs = r["tokens_per_second_runs"]
        spread = f" ({min(runs):,.0f}-{max(runs):,.0f})" if len(runs) > 1 else ""
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        speed, memory = (f"{x:.2f}x" if x is not None else "-" for x in (r["speed_vs_baseline"],
                                                                         r["memory_vs_baseline"]))
        lines.append(f"| {r['method']} | `{' '.join(r['flags'])}` | {r['tokens_per_second']:,.0f}{spread} | "
                     f"{r['samples_per_second']:.2f} | {speed} | "
                     f"{1e3 * r['step_time_median_s']:.0f} [{1e3 * r['step_time_p25_s']:.0f}-"
                     f"{1e3 * r['step_time_p75_s']:.0f}] {1e3 * r['step_time_min_s']:.0f} | "
                     f"{r['peak_memory_bytes'] / 2**20:,.0f} | "
                     f"{memory} | {mfu} | {r['final_loss']:.5f} |")
    lines += ["", "tokens/s in parentheses: lowest-highest over runs. Peak memory: GPU `max_memory_allocated` on a GPU "
              "(reserved in results.json), the process's peak resident set size on a CPU (it includes Python, "
              "libraries and data preparation, so CPU memory ratios understate the techniques' savings)."]
    plain = next((r for r in rows if r.get("ours_over_plain")), None)
    if plain:
        runs = plain["ours_over_plain_runs"]
        lines += ["", f"**Plain PyTorch loop:** our tokens/s over the plain loop's at the median step, both with the "
                  f"flags of `{plain['reference_method']}`: **{plain['ours_over_plain']:.3f}x**"
                  + (f" (runs paired back to back: {min(runs):.3f}-{max(runs):.3f})" if len(runs) > 1 else "")
                  + f"; fastest step against fastest step: {plain['ours_over_plain_fastest_step']:.3f}x."]
        rounds = [r for r in rows if "over_plain_rounds" in r]
        if len(plain["step_time_median_runs"]) > 1 and rounds:
            lines += ["", "Our tokens/s over the plain loop's, median over the rounds (one run of each method per "
                      "round, its median step): " + "; ".join(
                          f"`{r['method']}` **{r['over_plain_median_of_rounds']:.3f}x** "
                          f"({min(r['over_plain_rounds']):.3f}-{max(r['over_plain_rounds']):.3f})" for r in rounds)
                      + "."]
    cut = [r["method"] for r in rows if r.get("tail_cut")]
    if cut:
        lines += ["", "Stopped at --time_budget_s after their timed steps (the untimed evaluation and export cut): "
                  + ", ".join(cut) + "."]
    if skipped:
        reasons = {}
        for method, why in skipped.items():
            reasons.setdefault(why, []).append(method)
        lines += ["", "Not run here: " + "; ".join(f"{', '.join(ms)} ({why})" for why, ms in reasons.items()) + "."]
    if failed:
        lines += ["", "Failed:"] + [f"- {k}: {err.splitlines()[0]}" for k, err in failed.items()]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def write_chart(path: str, rows: list[dict], env: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["method"] for r in rows][::-1]
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.6 + 0.42 * len(rows)), sharey=True)
    base = rows[0]
    for ax, key, title in (
            (axes[0], "speed_vs_baseline",
             f"tokens/s vs baseline ({base['tokens_per_second']:,.0f} tok/s), higher is better"),
            (axes[1], "memory_vs_baseline",
             f"peak memory vs baseline ({base['peak_memory_bytes'] / 2**20:,.0f} MiB), lower is better")):
        values = [r[key] for r in rows][::-1]
        bars = ax.barh(names, values, color=["#4c72b0" if key.startswith("speed") else "#dd8452"] * len(values))
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.bar_label(bars, labels=[f"{x:.2f}x" for x in values], padding=3, fontsize=8)
        ax.set_xlim(0, max(values) * 1.2)
        ax.set_title(title, fontsize=10)
    m, v = env["machine"], env["versions"]
    seq = f", seq {args.seq_len}" if args.seq_flag else ""
    fig.suptitle(f"{args.script}: {args.model_preset or 'model from args'}{seq} on "
                 f"{m['gpu'] or m['cpu']} ({m['usable_cores']} cores), {env['date']}", fontsize=10)
    footer = ", ".join(f"{k} {val}" for k, val in v.items()) + f" | {env['command']}"
    fig.text(0.01, 0.01, "\n".join(textwrap.wrap(footer, 170)), fontsize=6, va="bottom")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    env = environment(sys.argv[1:])
    runs, skipped, failed = run_all(args)
    if "baseline" in args.methods and "baseline" not in runs:
        fail(f"the baseline run failed, nothing to compare with:\n{failed.get('baseline', '')}")
    if not runs:
        fail("no method ran: " + "; ".join(f"{m}: {why.splitlines()[0]}" for m, why in {**skipped, **failed}.items()))
    rows = summarise(args, runs, env)
    with open(os.path.join(args.output_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=2)
    write_markdown(os.path.join(args.output_dir, "results.md"), rows, env, skipped, failed, args)
    if "baseline" in runs:  # the chart's bars are ratios against it
        write_chart(os.path.join(args.output_dir, "results.png"), rows, env, args)
    with open(os.path.join(args.output_dir, "results.md"), encoding="utf-8") as f:
        print(f.read())
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
