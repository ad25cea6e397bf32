"""The GPU suite: proves the recipes on a GPU (a headline part, correctness, performance), and its plumbing on a CPU.

    python -m gpu_suite --part headline  # peer table, profiled step, 8B adapters, GRPO: one 8-minute H100 call
    python -m gpu_suite --part 1     # correctness on CUDA: precisions, optimizers, memory techniques, launchers
    python -m gpu_suite --part 2     # performance: the 1b preset at 2048 tokens, through benchmarks/benchmark.py
    python -m gpu_suite --dry-run    # any CPU: tiny preset, 3 steps; CUDA-only rows are SKIP, never PASS
    python -m gpu_suite --list       # the rows

Run from the repository root, on any machine that has the packages of requirements.txt. A row is a short run of a
recipe plus a check of what it must get right: the loss is finite and falls, the export loads with every weight and
gives finite logits, and the row's own property (fp16: an overflowed step leaves the schedule alone; 8x1 = 2x4
accumulation within bf16 tolerance; ...). Part 2 times its methods with benchmarks/benchmark.py and sets the peaks
against tools/estimate_memory.py. The last lines printed are the summary table (PASS / FAIL / SKIP per row, with its
figure); results go to `<results_dir>/gpu-suite-<date>-part<N>.md/.json` (`-headline`; docs/results/ on a GPU; a dry
run writes `gpu-suite-dry-run-*` files elsewhere), written again as each row ends. Exit status 1 when a row failed.
tools/lent_gpu.sh runs it on a lent GPU machine reached through a file-carrying command.

Modules: suite (the runs and their settings), data (the runs' local data), checks (what every row checks), correctness
(part 1's rows), performance (part 2's rows, the peer table and the profiled step), adapters (part 2's LoRA and QLoRA
rows on an 8B-shaped model), checkpoints (part 2's asynchronous-checkpoint row), grpo (GRPO beside TRL), headline (the
headline part's rows, their order and caps), schedule (which rows run, in what order), report (the table and the results
files), runner (how a run is started), cli (the flags and main).
"""
