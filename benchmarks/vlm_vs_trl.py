#!/usr/bin/env python
"""Training steps of scripts/finetune_vlm.py beside TRL's `SFTTrainer` on the same tiny VLM, rows, batch, learning
rate and precision: the median step time after the first, and the images/s it gives.

    PYTHONPATH=/path/to/trl python benchmarks/vlm_vs_trl.py --steps 12     # the embedded default's model and rows

TRL is not a dependency: it must be importable by this interpreter (`pip install --no-deps --target DIR trl==1.16.0`
and DIR on PYTHONPATH), or `--ours_only`. Both: one process, fp32 (`--bf16`: bf16 autocast on both sides, the default
with CUDA), no gradient checkpointing, images decoded in the collator of the main process (no workers), batches padded
to their longest row. Tokens/s: the rows' mean length through the processor (their image tokens included, the first
64 rows) x the batch over the median step, the same count for both sides. The GPU suite's `perf_vlm` row runs this.
TRL 1.16's VLM collator (`DataCollatorForVisionLanguageModeling`) puts the loss on every token but the padding for
`messages` rows (ours: the answers only), which changes nothing of a step's work. Ours: step times from metrics.jsonl (`--logging_steps 1`);
TRL: a callback times each step.
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
import json, os, sys, time
import torch
from datasets import Image, List, load_dataset
from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
from trl import SFTConfig, SFTTrainer
model_dir, train_file, steps, batch, lr, out = sys.argv[1:7]
folder = os.path.dirname(os.path.abspath(train_file))
data = load_dataset("json", data_files=train_file, split="train")
data = data.map(lambda row: {"images": [os.path.join(folder, p) for p in row["images"]]})
data = data.cast_column("images", List(Image()))
times = []
class Timer(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()
    def on_step_end(self, args, state, control, **kwargs):
        times.append(time.perf_counter() - self.start)
torch.manual_seed(0)
model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
bf16 = sys.argv[7] == "bf16"
config = SFTConfig(output_dir=out, per_device_train_batch_size=int(batch), learning_rate=float(lr), max_steps=int(steps),
                   logging_steps=1, report_to="none", save_strategy="no", max_length=None,
                   use_cpu=not torch.cuda.is_available(), bf16=bf16,
                   gradient_checkpointing=False, dataloader_num_workers=0, seed=0, lr_scheduler_type="cosine")
trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=AutoProcessor.from_pretrained(model_dir),
                     callbacks=[Timer()])
trainer.train()
print("STEP_TIMES " + json.dumps(times))
'''


def median_after_first(times: list[float]) -> float:
    return statistics.median(times[1:])


def ours_argv(args: argparse.Namespace, model: str, train_file: str, out: str) -> list[str]:
    """scripts/finetune_vlm.py's flags for the run (the GPU suite's tests check them against the recipe)."""
    return ["--model_name_or_path", model, "--train_file", train_file, "--validation_file", train_file,
            "--max_eval_samples", "16", "--max_steps", str(args.steps), "--per_device_train_batch_size",
            str(args.batch), "--learning_rate", args.learning_rate, "--logging_steps", "1", "--mixed_precision",
            "bf16" if args.bf16 else "no", "--output_dir", out]


def ours(args: argparse.Namespace, model: str, train_file: str, scratch: str) -> list[float]:
    out = os.path.join(scratch, "ours")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "finetune_vlm.py"),
                           *ours_argv(args, model, train_file, out)], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"error: our run failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        stamps = [row["time"] for row in map(json.loads, f) if "loss" in row]
    return [b - a for a, b in zip(stamps, stamps[1:])]  # steps 2..N; the first step's start is not logged


def trl(args: argparse.Namespace, model: str, train_file: str, scratch: str) -> list[float]:
    proc = subprocess.run([sys.executable, "-c", TRL_RUN, model, train_file, str(args.steps), str(args.batch),
                           args.learning_rate, os.path.join(scratch, "trl"), "bf16" if args.bf16 else "fp32"],
                          capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("STEP_TIMES ")]
    if proc.returncode or not lines:
        sys.exit(f"error: the TRL run failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def tokens_per_row(model: str, rows: list[dict], folder: str) -> float:
    """The rows' mean length through the model's processor, their image tokens included (the first 64 rows)."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    lengths = []
    for row in rows[:64]:
        images = [Image.open(os.path.join(folder, path)).convert("RGB") for path in row.get("images") or []]
        text = processor.apply_chat_template(row["messages"], tokenize=False)
        lengths.append(len(processor(text=[text], images=[images] if images else None)["input_ids"][0]))
    return statistics.mean(lengths)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model_name_or_path", help="A VLM folder (None: the embedded default's tiny model).")
    parser.add_argument("--train_file", help="messages + images rows (None: the embedded default's).")
    parser.add_argument("--steps", type=int, default=12, help="Optimizer steps of each run.")
    parser.add_argument("--batch", type=int, default=16, help="Rows per step.")
    parser.add_argument("--learning_rate", default="2e-3", help="Both runs' learning rate.")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                        help="bf16 autocast on both sides (default: when CUDA is present; fp32 otherwise).")
    parser.add_argument("--cache_dir", default=os.path.join(os.path.expanduser("~"), ".cache",
                                                           "accelerate-training-scripts"), help="The default's cache.")
    parser.add_argument("--ours_only", action="store_true", help="Skip TRL.")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first step is warm-up, and ours' first is not timed)")
    return args


def measure(args: argparse.Namespace) -> dict:
    """Ours, then TRL (unless --ours_only): {"ours": figures, "trl": figures or None, "speed_vs_trl", "bf16",
    "images_per_row", "tokens_per_row"}; figures: step_seconds (median after the first), images_per_second,
    tokens_per_second. A failed run: SystemExit, one line."""
    import torch

    from common.inputs.shapes import build_shapes_task, build_tiny_vlm

    if args.bf16 is None:
        args.bf16 = torch.cuda.is_available()
    train_file = args.train_file or build_shapes_task(args.cache_dir)[0]
    model = args.model_name_or_path or build_tiny_vlm(args.cache_dir, None)
    with open(train_file) as f:
        rows = [json.loads(line) for line in f]
    images = sum(len(row.get("images") or []) for row in rows) / len(rows)
    tokens = tokens_per_row(model, rows, os.path.dirname(os.path.abspath(train_file)))
    figures = {"bf16": args.bf16, "images_per_row": images, "tokens_per_row": tokens, "trl": None,
               "speed_vs_trl": None}
    with tempfile.TemporaryDirectory() as scratch:
        for name, run in (("ours", ours), ("trl", None if args.ours_only else trl)):
            if run is not None:
                step = median_after_first(run(args, model, train_file, scratch))
                figures[name] = {"step_seconds": step, "images_per_second": args.batch * images / step,
                                 "tokens_per_second": args.batch * tokens / step}
    if figures["trl"] is not None:
        figures["speed_vs_trl"] = figures["trl"]["step_seconds"] / figures["ours"]["step_seconds"]
    return figures


def main() -> None:
    figures = measure(parse_args())
    for name in ("ours", "trl"):
        if figures[name] is not None:
            row = figures[name]
            print(f"{name}: median step {row['step_seconds'] * 1000:.1f} ms, {row['images_per_second']:.1f} images/s, "
                  f"{row['tokens_per_second']:,.0f} tokens/s")


if __name__ == "__main__":
    main()
