"""The headline part (`--part headline`): the figures that matter most, in one device call of 8 minutes on one H100.

Its rows run one at a time in this order, and the results files are written again as each row ends, so a call cut
short keeps every finished row. On a GPU each row has a cap (below): its runs are stopped there, or at the part's
--budget_s if that comes first, and the row is reported FAIL with the reason (or, stopped after its timed steps, with
its figures and a note), and the next row starts. A benchmark run is stopped as soon as its timed steps are logged
(benchmark.py --stop_after_timed_steps): its evaluation and export, seconds to minutes for the 1b and 8B models,
are not waited for. Every row fits 78 GiB (the fp32 baseline, 89.7 GiB at 4 x 2,048 on an H200, is left to part 2).

First the peer table at 4 x 2,048 (ours, the textbook loop, transformers' Trainer, ours + Liger kernels) and one
profiled step of ours, then --optim muon against the textbook loop with torch.optim.Muon, the 8B LoRA/QLoRA memory
rows, and last GRPO beside TRL's GRPOTrainer (gpu_suite/grpo.py). About 500 s of rows by the times below, past the
wrapper's budget of about 400 s (tools/lent_gpu.sh) since the Muon rows came: the GRPO row is last so that a call
running long cuts it alone (then `--part headline --only perf_grpo` in a call of its own). What does not fit moved
to part 2: the peers at 8 x 2,048 (`perf_*_8x`, about 240 s), the five 16k long-context rows (about 200 s) and part 1's
fp8 row.
"""

from __future__ import annotations

from gpu_suite.suite import Row

# row -> cap in seconds on a GPU (none on a CPU: the dry run's tiny rows keep --row_timeout_s). Each includes the
# run's start (imports, data, building the model, compiling). Expected times: measured where a date is given.
CAPS_S = {
    "perf_bf16_compile": 120.0,  # 50 s, H100 2026-11-27 (with the data's tokenizer and packing); 46 s H200 11-26
    "perf_mfu_goal": 10.0,       # 0 s; reads the row above
    "perf_plain_loop": 100.0,    # about 45 s: ours' start and compile, data cached (40 s on the H200, 11-26)
    "perf_trainer": 150.0,       # 80 s, H100 2026-11-27 (its whole-model compile)
    "perf_liger": 100.0,         # about 50 s: ours' run with Liger's kernels (not measured)
    "perf_peer_table": 10.0,     # 0 s; reads the rows above
    "perf_profile_step": 100.0,  # about 45 s: ours' start and compile, 8 steps, the profile (not measured)
    "perf_muon": 100.0,          # about 50 s: ours with --optim muon (not measured)
    "perf_plain_muon": 100.0,    # about 50 s: the textbook loop with torch.optim.Muon (not measured)
    "perf_lora_8b": 100.0,       # 51 s, H200 11-26; includes building and saving the 8B-shaped base
    "perf_qlora_8b": 70.0,       # 33 s, H200 11-26
    "perf_grpo": 90.0,           # about 40 s (not measured): building the 125m-shaped model, then ours' and TRL's
}                                # runs one after the other (each its start, 4 steps of 16 x 64 tokens)


def headline_rows(rows: list[Row]) -> list[Row]:
    """The headline rows out of every row of the suite, in the headline's order."""
    by_name = {row.name: row for row in rows}
    return [by_name[name] for name in CAPS_S]
