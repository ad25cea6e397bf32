#!/usr/bin/env python
"""Tokens to a target held-out loss: AdamW + cosine against Muon + warmup-stable-decay, each with a learning-rate sweep.

    python benchmarks/muon_vs_adamw.py --output_dir outputs/muon_vs_adamw                    # tiny preset, CPU
    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/muon_vs_adamw.py --model_preset small --max_steps 64 ...

Every run trains the pretraining recipe on the embedded corpus from the same seed for the same number of optimizer
steps (the same token budget), evaluating the held-out loss every --eval_every steps. The target is AdamW's best final
held-out loss; for each run the tokens at which its held-out loss first reaches the target (linear between two
evaluations) are reported as a share of the AdamW run's tokens, with final losses and seconds per step (the median
over the intervals between evaluations of their training time, evaluations left out: Newton-Schulz's cost shows
there; on a shared machine time it apart, in pairs). Outputs: results.json, results.md, results.png.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.flags import ArgumentParser  # noqa: E402

SIDES = {"adamw": ("--optim", "adamw_torch_fused", "--lr_scheduler_type", "cosine"),
         "muon": ("--optim", "muon", "--lr_scheduler_type", "warmup_stable_decay")}


def parse_args():
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", required=True, help="Where the runs and the results go.")
    parser.add_argument("--model_preset", default="tiny", help="The recipe's --model_preset.")
    parser.add_argument("--max_steps", type=int, default=200, help="Optimizer steps of every run (the budget).")
    parser.add_argument("--eval_every", type=int, default=25, help="Held-out loss every N steps.")
    parser.add_argument("--adamw_learning_rates", default="1e-3,2e-3,4e-3,8e-3", help="AdamW's sweep.")
    parser.add_argument("--muon_learning_rates", default="2e-3,4e-3,8e-3,1.6e-2",
                        help="Muon's sweep (--learning_rate: with match_rms_adamw one rate serves both halves).")
    parser.add_argument("--block_size", type=int, default=128, help="Tokens per sequence.")
    parser.add_argument("--batch_size", type=int, default=8, help="Sequences per step.")
    parser.add_argument("--max_eval_samples", type=int, default=16, help="Held-out documents evaluated.")
    args = parser.parse_args()
    if len(args.adamw_learning_rates.split(",")) != len(args.muon_learning_rates.split(",")):
        parser.error("give both sweeps the same number of learning rates (they run in pairs)")
    return args


def run(args, side: str, lr: str) -> dict:
    out = os.path.join(args.output_dir, f"{side}-{lr}")
    if not os.path.isfile(os.path.join(out, "all_results.json")):
        cmd = [sys.executable, os.path.join(ROOT, "scripts", "pretrain_llama.py"), "--output_dir", out,
               "--overwrite_output_dir", "--model_preset", args.model_preset, "--max_steps", str(args.max_steps),
               "--eval_steps", str(args.eval_every), "--logging_steps", str(args.eval_every), "--learning_rate", lr,
               "--block_size", str(args.block_size), "--per_device_train_batch_size", str(args.batch_size),
               "--max_eval_samples", str(args.max_eval_samples), "--sample_max_new_tokens", "0",
               "--mixed_precision", "no", "--warmup_steps", str(args.max_steps // 20), *SIDES[side]]
        began = time.time()
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(out + ".log", "w"))
        print(f"{side} lr {lr}: {time.time() - began:.0f} s", flush=True)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(out, "all_results.json")) as f:
        results = json.load(f)
    tokens_per_step = args.block_size * args.batch_size
    curve = [(r["step"] * tokens_per_step, r["eval_loss"]) for r in rows if "eval_loss" in r]
    return {"side": side, "lr": float(lr), "curve": curve, "final": curve[-1][1], "s_per_step": training_seconds(rows),
            "train_runtime": results["train_runtime"]}


def training_seconds(rows: list[dict]) -> float:
    """Median seconds per step over the intervals between two logged steps, each from the end of the first one's
    evaluation to the second one's training log (so no evaluation is counted)."""
    ends = {r["step"]: r["time"] for r in rows if "eval_loss" in r}
    logged = [r for r in rows if "loss" in r]
    per_step = [(b["time"] - ends.get(a["step"], a["time"])) / (b["step"] - a["step"])
                for a, b in zip(logged, logged[1:])]
    return sorted(per_step)[len(per_step) // 2]


def tokens_to(curve: list[tuple[int, float]], target: float) -> float | None:
    """The tokens at which the held-out loss first reaches `target` (linear between evaluations); None: never."""
    for (t0, l0), (t1, l1) in zip([(0, float("inf"))] + curve, curve):
        if l1 <= target:
            return t1 if l0 == float("inf") else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def main() -> None:
    args = parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    pairs = zip(args.adamw_learning_rates.split(","), args.muon_learning_rates.split(","))  # pairs first
    runs = [run(args, side, lr) for pair in pairs for side, lr in zip(SIDES, pair)]
    adamw_best = min((r for r in runs if r["side"] == "adamw"), key=lambda r: r["final"])
    target, budget = adamw_best["final"], adamw_best["curve"][-1][0]
    for r in runs:
        reached = tokens_to(r["curve"], target)
        r["tokens_to_target"], r["share_of_adamw_tokens"] = reached, reached / budget if reached else None
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump({"target": target, "budget_tokens": budget, "runs": runs, "flags": vars(args)}, f, indent=1)
    lines = [f"Target: AdamW's best final held-out loss {target:.4f} (lr {adamw_best['lr']:g}); budget {budget:,} "
             "tokens per run.", "", "| optimizer + schedule | lr | final held-out loss | tokens to target | share of "
             "AdamW's tokens | s/step |", "|---|---|---|---|---|---|"]
    for r in runs:
        name = "AdamW + cosine" if r["side"] == "adamw" else "Muon + WSD"
        share = f"{r['share_of_adamw_tokens']:.2f}" if r["share_of_adamw_tokens"] else "not reached"
        reached = f"{r['tokens_to_target']:,.0f}" if r["tokens_to_target"] else "-"
        lines.append(f"| {name} | {r['lr']:g} | {r['final']:.4f} | {reached} | {share} | {r['s_per_step']:.3f} |")
    with open(os.path.join(args.output_dir, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(runs, target, os.path.join(args.output_dir, "results.png"), args.model_preset)


def plot(runs: list[dict], target: float, path: str, preset: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for side, colors, name in (("adamw", plt.cm.Blues, "AdamW + cosine"), ("muon", plt.cm.Oranges, "Muon + WSD")):
        rates = sorted(r["lr"] for r in runs if r["side"] == side)
        for r in sorted((r for r in runs if r["side"] == side), key=lambda r: r["lr"]):
            tokens, losses = zip(*r["curve"])  # one hue per side, darker for a larger rate
            ax.plot(tokens, losses, "-" if side == "muon" else "--", marker=".", label=f"{name}, lr {r['lr']:g}",
                    color=colors(0.35 + 0.6 * rates.index(r["lr"]) / max(1, len(rates) - 1)))
    ax.axhline(target, color="gray", linewidth=0.8, label="target (AdamW's best final)")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out loss")
    ax.set_title(f"Held-out loss against tokens, {preset} preset, embedded corpus")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
