"""Which rows run here and in what order: the prechecks (SKIP / FAIL without running), then the runs on threads."""

from __future__ import annotations

import concurrent.futures
import fnmatch
import importlib.util
import threading
import time
from typing import Callable

import torch

from gpu_suite.data import prepare_data
from gpu_suite.headline import CAPS_S
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
    if suite.cuda and torch.cuda.device_count() < row.gpus:
        return Outcome(SKIP, f"needs {row.gpus} GPUs, this machine has {torch.cuda.device_count()}")
    missing = missing_modules(row.needs)
    if missing and suite.cuda:  # on a GPU a missing package is a gap in the proof
        return Outcome(FAIL, f"{', '.join(missing)} not importable: install it (requirements.txt; torchao for FP8)")
    if missing:
        return Outcome(SKIP, f"{', '.join(missing)} not installed")
    return None


def run_row(suite: Suite, row: Row, cap_s: float | None = None) -> Outcome:
    """The row's check; `cap_s`: stop its runs after that many seconds (the part's budget still applies)."""
    if suite.seconds_left() < 5:
        return Outcome(SKIP, f"not started: the part's time budget ({suite.args.budget_s:.0f} s) is spent")
    suite.row_deadline = None if cap_s is None else time.monotonic() + cap_s
    try:
        return row.check(suite)
    except Exception as e:  # noqa: BLE001 - a broken check is a failed row, not a crashed suite
        return Outcome(FAIL, f"the check raised {type(e).__name__}: {str(e)[:200]}")
    finally:
        suite.row_deadline = None


NOT_REACHED = Outcome(SKIP, "not reached: the suite stopped before this row ended (results are written as rows end)")


def run_rows(suite: Suite, rows: list[Row], on_result: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Prechecks first (they decide the data and the benchmark's methods), then the runnable rows: the headline part's
    one at a time in its order, each under its cap (on a GPU); otherwise on `--jobs` threads: part 1's short runs
    overlap on a GPU, the reference run goes first, part 2 runs alone. `on_result(results so far)` after each row
    ends (rows still to come: NOT_REACHED)."""
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
    lock = threading.Lock()

    def results() -> list[dict]:
        return [{"name": row.name, "part": row.part, "what": row.what,
                 "status": outcomes.get(row.name, NOT_REACHED).status,
                 "figure": outcomes.get(row.name, NOT_REACHED).figure, "cuda_only": row.cuda_only is not None,
                 "seconds": round(timings.get(row.name, 0.0), 1),
                 "detail": outcomes.get(row.name, NOT_REACHED).detail} for row in rows]

    def timed(row: Row) -> Outcome:
        began = time.monotonic()
        print(f"[gpu-suite] {row.name} ...", flush=True)
        cap = CAPS_S[row.name] if suite.args.part == "headline" and suite.cuda else None
        outcome = run_row(suite, row, cap)
        with lock:
            timings[row.name], outcomes[row.name] = time.monotonic() - began, outcome
            print(f"[gpu-suite] {row.name}: {outcome.status} ({timings[row.name]:.0f} s) {outcome.figure}", flush=True)
            if on_result:
                on_result(results())
        return outcome

    if suite.args.part == "headline":
        for row in runnable:
            timed(row)
        return results()
    first = [row for row in runnable if row.name == "bf16"]
    for row in first:  # trains and caches the tokenizer and the tokenized corpus the other runs reuse
        timed(row)
    parallel = sorted((row for row in runnable if row.part == 1 and row not in first), key=lambda row: not row.slow)
    with concurrent.futures.ThreadPoolExecutor(max_workers=suite.args.jobs) as pool:
        list(pool.map(timed, parallel))
    for row in runnable:
        if row.part == 2:
            timed(row)
    return results()
