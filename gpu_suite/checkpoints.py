"""Part 2's asynchronous-checkpoint row: how long the loop is blocked per checkpoint, blocking saves against
--async_checkpointing, through benchmarks/async_checkpoint.py (the 1b preset in fp32 with AdamW on a GPU: 13 GB a
checkpoint, copied to pinned host memory; the tiny preset in the dry run, whose figures prove only the plumbing)."""

from __future__ import annotations

import json
import os

from gpu_suite.suite import FAIL, PASS, ROOT, Outcome, Row, Suite

BENCHMARK = os.path.join(ROOT, "benchmarks", "async_checkpoint.py")


def check_async_checkpoint(suite: Suite) -> Outcome:
    """On a GPU the loop must be blocked for less time with async saves than with blocking ones."""
    preset, vocab = ("1b", "32000") if suite.cuda else ("tiny", "512")
    run = suite.train("async_checkpoint", BENCHMARK, ["--model_preset", preset, "--vocab_size", vocab, "--saves", "2"])
    path = os.path.join(run.out, "results.json")
    if run.error or not os.path.isfile(path):
        return Outcome(FAIL, run.error or "benchmarks/async_checkpoint.py wrote no results.json")
    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    blocking, background = (next(r for r in result["rows"] if r["mode"] == mode) for mode in ("blocking", "async"))
    figure = (f"{preset}, {result['state_bytes'] / 2**30:.1f} GiB of weights and moments: loop blocked "
              f"{blocking['blocked_s']:.2f} s per blocking save, {background['blocked_s']:.2f} s per async save "
              f"(published after {background['published_s']:.2f} s), +{background['extra_host_bytes'] / 2**30:.2f} "
              "GiB host memory")
    detail = {"blocking_s": blocking["blocked_s"], "async_s": background["blocked_s"],
              "published_s": background["published_s"], "extra_host_bytes": background["extra_host_bytes"]}
    if suite.cuda and not background["blocked_s"] < blocking["blocked_s"]:
        return Outcome(FAIL, "async saves blocked the loop no less than blocking ones: " + figure, detail)
    return Outcome(PASS, figure if suite.cuda else figure + " (tiny preset on a CPU: plumbing only)", detail)


def checkpoint_rows() -> list[Row]:
    return [Row("perf_async_checkpoint", 2, "--async_checkpointing: seconds the loop is blocked per checkpoint of the "
                "1b preset (fp32 AdamW), against blocking saves", check_async_checkpoint)]
