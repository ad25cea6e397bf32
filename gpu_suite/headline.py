"""The headline part (`--part headline`): the figures that matter most, in one device call on one H100 (78 GiB).

Its rows run one at a time in this order, and the results files are written again as each row ends, so a call cut
short keeps every finished row. On a GPU each row has a cap (below): its runs are stopped there, or at the part's
--budget_s if that comes first, and the row is reported FAIL with the reason (or, stopped after its timed steps, with
its figures and a note), and the next row starts. A benchmark run is stopped as soon as its timed steps are logged
(benchmark.py --stop_after_timed_steps): its evaluation and export, seconds to minutes for the 1b and 8B models,
are not waited for. Every row fits 78 GiB (the fp32 baseline, 89.7 GiB at 4 x 2,048 on an H200, is left to part 2).
"""

from __future__ import annotations

from gpu_suite.suite import Row

# row -> cap in seconds on a GPU (none on a CPU: the dry run's tiny rows keep --row_timeout_s). Each includes the
# run's start (imports, data, building the model). Measured on an H200 (docs/results/gpu-2026-11-26-headline.md):
# every row within half of its cap; not measured on an H100 yet.
CAPS_S = {                       # H200 row time, 2026-11-26
    "perf_bf16_compile": 180.0,  # 46 s; 1b, 4 x 2,048, bf16 + --torch_compile + fused AdamW, cold compile included
    "perf_mfu_goal": 10.0,       # 0 s; reads the row above
    "perf_plain_loop": 150.0,    # 40 s; benchmarks/plain_loop.py with the same flags
    "perf_lora_8b": 120.0,       # 51 s; includes building and saving the 8B-shaped base
    "perf_qlora_8b": 90.0,       # 33 s
    "perf_long_none": 90.0,      # 44 s; 16,384 tokens, full logits where torch has no F.linear_cross_entropy
    "perf_long_every2": 90.0,    # 38 s
    "perf_long_op": 90.0,        # 35 s
    "perf_long_full": 90.0,      # 39 s
    "perf_long_offload": 90.0,   # 39 s
    "fp8": 120.0,                # 23 s; part 1's fp8.yaml row (tiny preset, 20 steps, the export loads)
}


def headline_rows(rows: list[Row]) -> list[Row]:
    """The headline rows out of every row of the suite, in the headline's order."""
    by_name = {row.name: row for row in rows}
    return [by_name[name] for name in CAPS_S]
