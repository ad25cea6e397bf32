"""The suite's output: the summary table printed last, and the results files (.md for people, .json for tools)."""

from __future__ import annotations

import json
import os
import tarfile

from gpu_suite.performance import peer_markdown, peer_table
from gpu_suite.suite import FAIL, PASS, SKIP, Suite


def summary_table(results: list[dict], title: str, footer: str) -> list[str]:
    lines = [title, "", "| row | status | figure |", "|---|---|---|"]
    lines += [f"| {r['name']} | {r['status']} | {r['figure'].replace('|', '/')} |" for r in results]
    counts = {s: sum(r["status"] == s for r in results) for s in (PASS, FAIL, SKIP)}
    lines.append(f"| total | {counts[PASS]} PASS, {counts[FAIL]} FAIL, {counts[SKIP]} SKIP | {footer} |")
    return lines


def part_label(part: str) -> str:
    return "headline part" if part == "headline" else f"part {part}"


def write_results(suite: Suite, results: list[dict], env: dict, seconds: float) -> list[str]:
    """<results_dir>/gpu-suite[-dry-run]-<date>-part<N>.{json,md} (`-headline` for that part), and in `--copy_to`
    with a tarball of the runs' logs. Each file is written under a temporary name and renamed: it is whole or old."""
    args = suite.args
    part = "headline" if args.part == "headline" else f"part{args.part}"
    stem = f"gpu-suite{'-dry-run' if args.dry_run else ''}-{env['date'][:10]}-{part}"
    benchmark_result, long_result = suite.memoized("benchmark") or {}, suite.memoized("long") or {}
    record = {"suite": "gpu_suite", "dry_run": args.dry_run, "part": args.part,
              "device": "CPU (dry run: CUDA-only rows are SKIP)" if args.dry_run else env["machine"]["gpu"],
              "seconds": round(seconds, 1), "settings": vars(suite.settings), "environment": env, "rows": results,
              "performance": list(benchmark_result.get("rows", {}).values()),
              "long_context": list(long_result.get("rows", {}).values())}
    title = (f"# GPU suite, {part_label(args.part)}" + (" — DRY RUN on a CPU (tiny preset, CUDA-only rows SKIP; not "
                                                        "a GPU result)" if args.dry_run else
                                                        f" — {env['machine']['gpu']}"))
    m = env["machine"]
    md = [title, "", f"- Date: {env['date']}; commit {env['git_commit']}; {seconds:.0f} s",
          f"- Machine: {m['cpu']}, {m['cpu_cores']} cores, {m['memory_gib']} GiB RAM, "
          + (f"GPU {m['gpu']} (CUDA {m['cuda']})" if m["gpu"] else "no GPU"),
          "- Versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()),
          f"- Command: `{env['command']}`", f"- Settings: {json.dumps(vars(suite.settings))}", ""]
    md += summary_table(results, "## Summary", "")[2:]
    md += ["", "## Rows", ""] + [f"- **{r['name']}** ({r['status']}, {r['seconds']} s): {r['what']}. {r['figure']}"
                                 for r in results]
    peers = peer_table(benchmark_result.get("rows", {}))
    if peers:
        s = suite.settings
        md += ["", "## Peer table", "", "Each loop with ours' flags (bf16, compile, fused AdamW), the same model and "
               f"tokens per step; medians over {s.timed_steps} timed steps whose timer waits for the device. Ours "
               "over it: its step time over ours'.", ""] + peer_markdown(peers, suite.cuda, s.perf_batch, s.perf_seq)
    for heading, result in (("Performance", benchmark_result), ("Long context", long_result)):
        if result.get("markdown"):
            md += ["", f"## {heading} (benchmarks/benchmark.py)", "", result["markdown"]]
    paths = []
    folders = [args.results_dir] + ([args.copy_to] if args.copy_to else [])
    for folder in dict.fromkeys(os.path.abspath(f) for f in folders):
        os.makedirs(folder, exist_ok=True)
        for ext, text in (("json", json.dumps(record, indent=2, default=str)), ("md", "\n".join(md) + "\n")):
            paths.append(os.path.join(folder, f"{stem}.{ext}"))
            with open(paths[-1] + ".tmp", "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(paths[-1] + ".tmp", paths[-1])
    if args.copy_to:
        tarball = os.path.join(args.copy_to, f"{stem}-logs.tar.gz")
        with tarfile.open(tarball + ".tmp", "w:gz") as tar:
            for folder in ("logs", "benchmark/runs", "long/runs", "benchmark-adapters/runs"):
                if os.path.isdir(os.path.join(suite.work, folder)):
                    tar.add(os.path.join(suite.work, folder), arcname=folder)
        os.replace(tarball + ".tmp", tarball)
    return paths
