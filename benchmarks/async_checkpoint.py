#!/usr/bin/env python
"""How long the training loop is blocked per checkpoint: blocking saves against --async_checkpointing.

    python benchmarks/async_checkpoint.py --model_preset 350m --saves 3 --output_dir /tmp/async-bench
    python benchmarks/async_checkpoint.py --model_preset 1b --saves 3 --output_dir /scratch/async-bench   # a GPU

One process (the GPU if there is one, else the CPU), a Llama preset in fp32 with AdamW, saved by the recipes' own
checkpoint code with the recipes' extras (checksums in the marker, the full-disk line). Before each save an optimizer
step on random gradients changes every weight and moment. Blocking: the time `save_checkpoint` takes is the time the
loop is blocked. Asynchronous: the blocked time is the staging copy (`save_checkpoint` returns once it is made); one
more optimizer step then runs beside the background write, and `wait_for_checkpoint` returns once it is published.
The host memory the staging buffers keep is the growth of this process's resident set over the asynchronous saves.
Prints one Markdown table and writes it, with the settings, to <output_dir>/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from common.checkpoint import CheckpointExtras, save_checkpoint  # noqa: E402
from common.features.async_checkpoint import BackgroundCheckpoints, wait_for_checkpoint  # noqa: E402
from common.features.checksums import record_files, verify_checkpoint  # noqa: E402
from common.features.disk import stop_if_disk_full  # noqa: E402
from common.inputs.modeling import LLAMA_PRESETS  # noqa: E402
from common.steps import track_progress  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model_preset", default="350m", choices=tuple(LLAMA_PRESETS), help="Llama shape to save.")
    parser.add_argument("--vocab_size", type=int, default=32000, help="Vocabulary of the model.")
    parser.add_argument("--saves", type=int, default=3, help="Checkpoints per mode (the median is reported).")
    parser.add_argument("--output_dir", required=True,
                        help="Where the checkpoints go (removed at the end) and results.json.")
    return parser.parse_args(argv)


def resident_bytes() -> int:
    """This process's resident set now (Linux), pinned host buffers included."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def optimizer_step(model, optimizer) -> float:
    """An update of every weight and moment (random gradients: the forward pass is not what is measured)."""
    start = time.perf_counter()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_mode(accelerator, model, optimizer, output_dir: str, saves: int, background: bool) -> dict:
    extras = CheckpointExtras(record_files=record_files, verify=verify_checkpoint,
                              explain_failed_save=stop_if_disk_full)
    extras.save = BackgroundCheckpoints(accelerator) if background else None
    before, blocked, published, beside = resident_bytes(), [], [], []
    for step in range(1, saves + 1):
        optimizer_step(model, optimizer)
        start = time.perf_counter()
        save_checkpoint(accelerator, output_dir, step, 1, extras)
        blocked.append(time.perf_counter() - start)
        if background:
            beside.append(optimizer_step(model, optimizer))  # the loop goes on while the write runs
            wait_for_checkpoint(extras)
            published.append(time.perf_counter() - start)
    row = {"mode": "async" if background else "blocking", "blocked_s": statistics.median(blocked),
           "blocked_s_each": [round(t, 3) for t in blocked]}
    if background:
        row.update(published_s=statistics.median(published), step_beside_write_s=statistics.median(beside),
                   extra_host_bytes=resident_bytes() - before)
    return row


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_PRESETS[args.model_preset], vocab_size=args.vocab_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    track_progress(accelerator)  # the recipes' registered step counter travels with every checkpoint
    optimizer_step(model, optimizer)  # the moments exist from here on
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # weights + two moments
    plain = optimizer_step(model, optimizer)
    rows = []
    for mode in ("blocking", "async"):  # each mode's checkpoints removed before the next: half the disk at most
        rows.append(run_mode(accelerator, model, optimizer, os.path.join(args.output_dir, mode), args.saves,
                             background=mode == "async"))
        shutil.rmtree(os.path.join(args.output_dir, mode), ignore_errors=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    result = {"preset": args.model_preset, "state_bytes": state_bytes, "device": device, "torch": torch.__version__,
              "python": platform.python_version(), "optimizer_step_s": plain, "rows": rows}
    print(f"{args.model_preset}, fp32 AdamW, {state_bytes / 2**30:.2f} GiB of weights and moments, {device}; "
          f"an optimizer step alone: {plain:.2f} s")
    print("| saves | loop blocked per checkpoint (median) | each | published after | step beside the write | "
          "extra host memory |\n|---|---|---|---|---|---|")
    for row in rows:
        extra = (f"{row['published_s']:.2f} s | {row['step_beside_write_s']:.2f} s | "
                 f"{row['extra_host_bytes'] / 2**30:.2f} GiB") if "published_s" in row else "- | - | -"
        print(f"| {row['mode']} | {row['blocked_s']:.2f} s | {row['blocked_s_each']} | {extra} |")
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
