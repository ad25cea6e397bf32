"""The suite's command line: its flags, then the selected part's rows, then the results and the table."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

import torch

import gpu_suite
from benchmarks import benchmark
from common.errors import fail
from common.flags import ArgumentParser
from gpu_suite.adapters import adapter_rows
from gpu_suite.checkpoints import checkpoint_rows
from gpu_suite.correctness import part1_rows
from gpu_suite.grpo import grpo_rows
from gpu_suite.headline import CAPS_S, headline_rows
from gpu_suite.performance import part2_rows
from gpu_suite.report import part_label, summary_table, write_results
from gpu_suite.schedule import run_rows
from gpu_suite.vlm import vlm_rows
from gpu_suite.suite import FAIL, ROOT, Suite

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m gpu_suite", description=gpu_suite.__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("1", "2", "headline", "all"), default=None,
                        help="1: correctness rows, 2: performance rows, headline: the figures that matter most, in "
                        "one call (gpu_suite/headline.py), all: parts 1 and 2 (default: all with --dry-run).")
    parser.add_argument("--dry-run", dest="dry_run", action="store_true",
                        help="On a CPU: the same rows and plumbing, tiny preset, 3 steps; CUDA-only rows are SKIP.")
    parser.add_argument("--only", default="", help="Comma-separated row-name patterns to run (fnmatch); others SKIP.")
    parser.add_argument("--skip", default="", help="Comma-separated row-name patterns not to run (reported SKIP).")
    parser.add_argument("--jobs", type=int, help="Part-1 rows at a time (default: 4 on a GPU, 1 on a CPU).")
    parser.add_argument("--budget_s", type=float, help="Start no row after this many seconds and stop runs then "
                        "(default: no limit).")
    parser.add_argument("--row_timeout_s", type=float, help="Per run (default 300 on a GPU, 900 on a CPU).")
    parser.add_argument("--prefork", choices=("auto", "yes", "no"), default="auto",
                        help="Fork runs from a server that imported the training stack once (auto: on CPUs, "
                        "except for the headline part, whose runs are benchmark runs).")
    parser.add_argument("--work_dir", default=os.path.join(ROOT, "outputs", "gpu-suite-work"),
                        help="Scratch folder for the rows' runs, logs and data (each run's folder replaced).")
    parser.add_argument("--results_dir", help="Default: docs/results on a GPU, outputs/gpu-suite-dry-run in a dry run.")
    parser.add_argument("--copy_to", help="Also write the results here, with a tarball of the runs' logs (for a "
                        "machine whose output comes back from one folder).")
    parser.add_argument("--list", action="store_true", help="Print the rows and exit.")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run and not args.list:
        fail("no CUDA GPU here: run `python -m gpu_suite --dry-run` for the CPU plumbing check")
    args.part = args.part or ("all" if args.dry_run else None)
    if args.part is None and not args.list:
        fail("give --part 1 (correctness), --part 2 (performance), --part headline or --part all")
    args.only = [p for p in args.only.split(",") if p]
    args.skip = [p for p in args.skip.split(",") if p]
    args.jobs = args.jobs or (4 if cuda else len(os.sched_getaffinity(0)))
    args.row_timeout_s = args.row_timeout_s or (300.0 if cuda else 900.0)
    args.results_dir = args.results_dir or os.path.join(
        ROOT, *(("outputs", "gpu-suite-dry-run") if args.dry_run else ("docs", "results")))
    return args


def main() -> None:
    began = time.monotonic()
    args = parse_args()
    rows = part1_rows() + part2_rows() + adapter_rows() + checkpoint_rows() + grpo_rows() + vlm_rows()
    rows = headline_rows(rows) if args.part == "headline" else \
        [r for r in rows if args.part in (None, "all", str(r.part))]
    if args.list:
        for row in rows:
            cap = f"(cap {CAPS_S[row.name]:.0f} s on a GPU) " if args.part == "headline" else ""
            print(f"part {row.part}  {row.name:32s} {'(CUDA only) ' if row.cuda_only else ''}{cap}{row.what}")
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
    env["command"] = "python -m gpu_suite " + shlex.join(sys.argv[1:])
    try:  # the results files are written again as each row ends: a call cut short keeps what finished
        results = run_rows(suite, rows, lambda so_far: write_results(suite, so_far, env, time.monotonic() - began))
    finally:
        suite.runner.close()
    seconds = time.monotonic() - began
    paths = write_results(suite, results, env, seconds)
    where = env["machine"]["gpu"] if not args.dry_run else \
        "a CPU, dry run: CUDA-only rows SKIP, nothing here is a GPU result"
    print("\n[gpu-suite] results: " + ", ".join(paths), flush=True)
    print("\n".join(summary_table(results, f"\nGPU suite {part_label(args.part)} on {where}", f"{seconds:.0f} s")),
          flush=True)
    if any(r["status"] == FAIL for r in results):
        raise SystemExit(1)
