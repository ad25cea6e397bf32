#!/usr/bin/env python
"""What is alive at a recipe's memory peak: torch.profiler's memory timeline over its first optimizer steps.

    python benchmarks/profile_memory.py --steps 2 -- scripts/finetune_causal_lm.py --model_name_or_path base \\
        --train_file train.jsonl --use_peft --bf16 --gradient_checkpointing --max_steps 2 --output_dir outputs/p

The recipe runs as usual, in this process; the profiler (profile_memory, record_shapes, with_stack: what its memory
timeline needs to sort tensors into categories) records from the end of `accelerator.prepare` (the model, its
optimizer and the first batches are built; any probe forward after it is recorded) to the end of optimizer step
`--steps`. Works on a CPU (CPU allocations) as on a GPU (`--device cuda:0`). Prints the peak, the bytes alive there
by the profiler's category (parameter, optimizer state, gradient, activation, autograd detail, temporary, input, and
unknown), the operator running at the peak, and the largest live tensors; `--output_json` writes the same.
Tensors allocated before the profiler starts count once an operator touches them (the frozen weights, say); what no
operator touches in the recorded steps is not counted.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.profiler import _memory_profiler  # noqa: E402  (the timeline behind export_memory_timeline)

from common.flags import ArgumentParser  # noqa: E402


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        print("error: give the recipe and its flags after --", file=sys.stderr)
        raise SystemExit(2)
    ours, recipe = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="Optimizer steps recorded (the 2nd has Adam's states).")
    parser.add_argument("--device", default="cpu", help="The device whose allocations count: cpu or cuda:0.")
    parser.add_argument("--top", type=int, default=12, help="Largest live tensors listed.")
    parser.add_argument("--output_json", help="Also write the figures here.")
    args = parser.parse_args(ours)
    if args.steps < 1 or not recipe or not os.path.isfile(recipe[0]):
        parser.error("--steps must be >= 1 and the recipe after -- must be a file")
    return args, recipe


def alive_at_peak(profile, device: str) -> dict:
    """The peak of the bytes alive on `device`, what they are by category, and what ran then."""
    timeline = _memory_profiler.MemoryProfileTimeline(profile._memory_profile())
    target = torch.device(device)
    live: dict = {}
    total = peak = peak_time = 0
    peak_live: dict = {}
    events = [e for e in timeline.timeline if e[2][0].device == target]
    for index, (t, action, (key, version), size) in enumerate(events):
        if action in (_memory_profiler.Action.PREEXISTING, _memory_profiler.Action.CREATE):
            total += size - live.get(key, (0, 0))[1]  # a key created again replaces what it held
            live[key] = (version, size)
        elif action == _memory_profiler.Action.INCREMENT_VERSION:
            live[key] = (version + 1, size)
        elif action == _memory_profiler.Action.DESTROY:
            total -= live.pop(key, (0, 0))[1]
        last_at_this_time = index + 1 == len(events) or events[index + 1][0] != t
        if total > peak and last_at_this_time:
            peak, peak_time, peak_live = total, t, dict(live)
    by_category: dict = collections.Counter()
    tensors = []
    for key, (version, size) in peak_live.items():
        category = timeline.categories.get(key, version)
        name = category.name.lower() if category else "unknown"
        by_category[name] += size
        tensors.append((size, name))
    return {"peak_bytes": peak, "by_category": dict(by_category.most_common()),
            "largest_tensors": sorted(tensors, reverse=True), "running_at_peak": running_at(profile, peak_time)}


def running_at(profile, t_ns: int) -> list[str]:
    """The calls (Python frames and operators) open at time `t_ns`, outermost first, the recipe's own frames kept."""
    chain, nodes = [], profile.profiler.kineto_results.experimental_event_tree()
    while nodes:
        inside = [n for n in nodes if n.start_time_ns <= t_ns <= (n.end_time_ns if n.end_time_ns > 0 else t_ns)]
        if not inside:
            break
        node = inside[-1]
        chain.append(node.name.replace(ROOT + os.sep, ""))
        nodes = node.children
    return [c for c in chain if ".py(" not in c or "site-packages" not in c or c == chain[-1]][-12:]


def print_report(figures: dict, top: int) -> None:
    peak = figures["peak_bytes"]
    print(f"Peak {peak / 2**20:,.2f} MiB alive; by category:")
    for name, size in figures["by_category"].items():
        print(f"  {name:16s} {size / 2**20:10,.2f} MiB  {100 * size / max(peak, 1):5.1f} %")
    print("Running at the peak: " + " > ".join(figures["running_at_peak"]))
    print(f"Largest live tensors: " + ", ".join(f"{size / 2**20:,.2f} MiB {name}"
                                                for size, name in figures["largest_tensors"][:top]))


def main() -> None:
    args, recipe = parse_args(sys.argv[1:])
    import accelerate

    import common.metrics

    profiler = torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True)
    prepare, log_step = accelerate.Accelerator.prepare, common.metrics.StepLog.step

    def prepare_then_record(self, *objects, **kwargs):
        prepared = prepare(self, *objects, **kwargs)
        if profiler.profiler is None:
            profiler.start()
        return prepared

    def step(self, number: int, *rest, **kwargs):
        log_step(self, number, *rest, **kwargs)
        if number == args.steps:
            profiler.stop()
            figures = alive_at_peak(profiler, args.device)
            print_report(figures, args.top)
            if args.output_json:
                with open(args.output_json, "w", encoding="utf-8") as f:
                    json.dump(figures, f, indent=1)

    accelerate.Accelerator.prepare, common.metrics.StepLog.step = prepare_then_record, step
    sys.argv = recipe
    runpy.run_path(recipe[0], run_name="__main__")


if __name__ == "__main__":
    main()
