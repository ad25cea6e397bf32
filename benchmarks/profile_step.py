#!/usr/bin/env python
"""Profile one optimizer step of a recipe with torch.profiler and print its top entries.

    taskset -c 0 python benchmarks/profile_step.py --step 20 -- scripts/pretrain_llama.py --max_steps 21
    python benchmarks/profile_step.py --step 10 -- scripts/pretrain_llama.py --bf16 ...  # on a GPU: + CUDA time

The recipe runs as usual; the profiler records from the end of optimizer step `--step` - 1 to the end of step
`--step` (the loop's logging call marks each step's end, so the step includes its own logging and checkpoint work).
Prints the `--top` operators by self CPU time, then the Python calls by total time (what the loop's own helpers cost
beside the model's forward and backward and the optimizer); on a GPU also the operators by CUDA time and the GPU's
busy share: the device is drained at both ends of the step, so its wall time holds all its kernels and nothing else,
and the busy time is the union of its kernels' (and copies') intervals. With --output_trace the step is also written
as a Chrome trace (open in chrome://tracing or Perfetto); with --output_json its figures, for callers such as the GPU
suite; with --exit_after_step the process ends once the step is reported (no waiting for evaluation and export).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import runpy
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from common.flags import ArgumentParser  # noqa: E402


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        print("error: give the recipe and its flags after --", file=sys.stderr)
        raise SystemExit(2)
    ours, recipe = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--step", type=int, default=10, help="The optimizer step to profile (>= 2: warm first).")
    parser.add_argument("--top", type=int, default=15, help="Rows of each table.")
    parser.add_argument("--output_trace", help="Also write the step's Chrome trace to this file.")
    parser.add_argument("--output_json", help="Also write the step's figures (wall and GPU busy seconds, busy share, "
                        "top operators) to this file.")
    parser.add_argument("--exit_after_step", action="store_true", help="End the process once the step is reported.")
    args = parser.parse_args(ours)
    if args.step < 2 or not recipe or not os.path.isfile(recipe[0]):
        parser.error("--step must be >= 2 and the recipe after -- must be a file")
    return args, recipe


def is_python(event) -> bool:
    """with_stack also records Python calls as events ("file.py(line): name"): they are not operators."""
    return ".py(" in event.name or event.name.startswith("<built-in")


def device_busy_seconds(profile) -> float:
    """Seconds in which at least one kernel or copy ran on the GPU: the union of their intervals (streams overlap)."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end) for e in profile.events() if e.device_type == DeviceType.CUDA)
    busy, reached = 0.0, -float("inf")
    for start, end in spans:
        if end > reached:
            busy += end - max(start, reached)
            reached = end
    return busy / 1e6


def report(profile, args, wall_s: float) -> None:
    events = [e for e in profile.events() if not is_python(e)]
    averages = collections.defaultdict(lambda: [0.0, 0])
    for event in events:
        averages[event.name][0] += event.self_cpu_time_total
        averages[event.name][1] += 1
    total_self = sum(v[0] for v in averages.values()) or 1
    print(f"Operators by self CPU time ({total_self / 1e3:.1f} ms in all):")
    for name, (micros, calls) in sorted(averages.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{micros / 1e3:10.2f} ms {100 * micros / total_self:5.1f} % {calls:6d} calls  {name}")
    calls = collections.defaultdict(lambda: [0.0, 0])
    training_threads = {e.thread for e in events}  # not, e.g., the progress bar's monitor thread
    for event in profile.events():
        if is_python(event) and event.thread in training_threads:
            calls[event.name][0] += event.cpu_time_total
            calls[event.name][1] += 1
    print("Python calls by total time, including what they call (the step's wall time is the largest):")
    for name, (micros, count) in sorted(calls.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{micros / 1e3:10.2f} ms {count:6d} calls  {name.replace(ROOT + os.sep, '')}")
    figures = {"step": args.step, "wall_s": wall_s, "gpu_busy_s": None, "gpu_busy_share": None,
               "top_cpu_operators": [{"name": name, "self_cpu_s": micros / 1e6} for name, (micros, _) in
                                     sorted(averages.items(), key=lambda kv: -kv[1][0])[:args.top]]}
    if torch.cuda.is_available():
        print(profile.key_averages().table(sort_by="cuda_time_total", row_limit=args.top))
        figures["gpu_busy_s"] = device_busy_seconds(profile)
        figures["gpu_busy_share"] = figures["gpu_busy_s"] / wall_s
        print(f"GPU busy {1e3 * figures['gpu_busy_s']:.1f} ms of the step's {1e3 * wall_s:.1f} ms "
              f"({figures['gpu_busy_share']:.1%}); the rest it waits for the host")
    else:
        print(f"The step's wall time: {1e3 * wall_s:.1f} ms")
    if args.output_trace:
        profile.export_chrome_trace(args.output_trace)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=2)


def main() -> None:
    args, recipe = parse_args(sys.argv[1:])
    import common.metrics

    log_step = common.metrics.StepLog.step
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = torch.profiler.profile(activities=activities, with_stack=True)
    began = [0.0]

    def drain() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def step(self, number: int, *rest, **kwargs):
        log_step(self, number, *rest, **kwargs)
        if number == args.step - 1:
            drain()  # the step starts on an idle device: every kernel in the window is its own
            profiler.start()
            began[0] = time.perf_counter()
        elif number == args.step:
            drain()
            wall_s = time.perf_counter() - began[0]
            profiler.stop()
            report(profiler, args, wall_s)
            if args.exit_after_step:
                sys.stdout.flush()
                os._exit(0)  # the run's evaluation and export are not needed

    common.metrics.StepLog.step = step
    sys.argv = recipe
    runpy.run_path(recipe[0], run_name="__main__")


if __name__ == "__main__":
    main()
