"""Which rows run here and in what order: the prechecks (SKIP / FAIL without running), then the runs on threads."""

from __future__ import annotations

import concurrent.futures
import fnmatch
import importlib.util
import time

import torch

from gpu_suite.data import prepare_data
from gpu_suite.suite import FAIL, SKIP, Outcome, Row, Suite


def selected(name: str, only: list[str], skip: list[str]) -> bool:
    return (not only or any(fnmatch.fnmatch(name, p) for p in only)) and not any(fnmatch.fnmatch(name, p) for p in skip)


def missing_modules(needs: tuple[str, ...]) -> list[str]:
    return [m for m in needs if importlib.util.find_spec(m) is None]


def precheck(suite: Suite, row: Row) -> Outcome | None:
    """Why a row does not run here (an Outcome), or None when it runs. CUDA-only rows are SKIP without CUDA."""
    args = suite.args
    if not selected(row.name, args.only, args.skip):
        return Outcome(SKIP, "not selected (--only / --skip)")
    if row.cuda_only and not suite.cuda:
        return Outcome(SKIP, f"CUDA only: {row.cuda_only}")
    if row.name in ("fp8", "perf_fp8_compile") and torch.cuda.get_device_capability() < (8, 9):
        return Outcome(SKIP, f"CUDA only: {row.cuda_only} (this one is {torch.cuda.get_device_name()})")
    missing = missing_modules(row.needs)
    if missing and suite.cuda:  # on a GPU a missing package is a gap in the proof
        return Outcome(FAIL, f"{', '.join(missing)} not importable: install it (requirements.txt; torchao for FP8)")
    if missing:
        return Outcome(SKIP, f"{', '.join(missing)} not installed")
    return None


def run_row(suite: Suite, row: Row) -> Outcome:
    if suite.seconds_left() < 5:
        return Outcome(SKIP, f"not started: the part's time budget ({suite.args.budget_s:.0f} s) is spent")
    try:
        return row.check(suite)
    except Exception as e:  # noqa: BLE001 - a broken check is a failed row, not a crashed suite
        return Outcome(FAIL, f"the check raised {type(e).__name__}: {str(e)[:200]}")


def run_rows(suite: Suite, rows: list[Row]) -> list[dict]:
    """Prechecks first (they decide the data and the benchmark's methods), then the runnable rows on `--jobs`
    threads: part 1's short runs overlap on a GPU; the reference run goes first, part 2 runs alone."""
    outcomes: dict[str, Outcome] = {}
    for row in rows:
        reason = precheck(suite, row)
        if reason:
            outcomes[row.name] = reason
        else:
            suite.planned.add(row.name)
    prepare_data(suite)
    runnable = [row for row in rows if row.name in suite.planned]
    timings: dict[str, float] = {}

    def timed(row: Row) -> Outcome:
        began = time.monotonic()
        print(f"[gpu-suite] {row.name} ...", flush=True)
        outcome = run_row(suite, row)
        timings[row.name] = time.monotonic() - began
        print(f"[gpu-suite] {row.name}: {outcome.status} ({timings[row.name]:.0f} s) {outcome.figure}", flush=True)
        return outcome

    first = [row for row in runnable if row.name == "bf16"]
    for row in first:  # trains and caches the tokenizer and the tokenized corpus the other runs reuse
        outcomes[row.name] = timed(row)
    parallel = sorted((row for row in runnable if row.part == 1 and row not in first), key=lambda row: not row.slow)
    with concurrent.futures.ThreadPoolExecutor(max_workers=suite.args.jobs) as pool:
        for row, outcome in zip(parallel, pool.map(timed, parallel)):
            outcomes[row.name] = outcome
    for row in runnable:
        if row.part == 2:
            outcomes[row.name] = timed(row)
    return [{"name": row.name, "part": row.part, "what": row.what, "status": outcomes[row.name].status,
             "figure": outcomes[row.name].figure, "cuda_only": row.cuda_only is not None,
             "seconds": round(timings.get(row.name, 0.0), 1), "detail": outcomes[row.name].detail}
            for row in rows]
