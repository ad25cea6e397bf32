"""Part 2, performance: the benchmark's table (benchmarks/benchmark.py) as rows, peaks against the memory estimate; the
peer table (ours, the textbook loop, transformers' Trainer, ours + Liger kernels) and one profiled step."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys

import torch

from benchmarks import benchmark
from common.features import chunked_loss
from common.inputs.modeling import LLAMA_PRESETS
from gpu_suite.suite import CONFIGS, FAIL, PASS, PRETRAIN, ROOT, Outcome, Row, Suite
from tools import estimate_memory

MFU_GOAL = 0.5
# suite row -> benchmark method; plain_pytorch mirrors bf16_compile (--plain_reference), the MFU goal reads it.
PERF_METHODS = {"perf_baseline": "baseline", "perf_bf16_compile": "bf16_compile",
                "perf_bf16_compile_checkpointing": "bf16_compile_checkpointing", "perf_fp8_compile": "fp8_compile",
                "perf_bf16_compile_8bit": "bf16_compile_8bit", "perf_plain_loop": "plain_pytorch",
                "perf_bf16_compile_chunked": "bf16_compile_chunked",
                "perf_mfu_goal": "bf16_compile", "perf_trainer": "trainer", "perf_liger": "liger",
                "perf_bf16_compile_8x": "bf16_compile_8x", "perf_plain_loop_8x": "plain_8x",
                "perf_trainer_8x": "trainer_8x", "perf_liger_8x": "liger_8x", "perf_muon": "muon",
                "perf_plain_muon": "plain_muon"}
# The peer table: each peer's method -> (ours at its batch, the detail key of ours' speed over it: its median step time
# over ours'). Every peer runs ours' flags: bf16, compile, fused AdamW (Trainer: its whole-model torch_compile).
PEERS = {"plain_pytorch": ("bf16_compile", "ours_over_plain"), "trainer": ("bf16_compile", "ours_over_trainer"),
         "liger": ("bf16_compile", "ours_over_liger"), "plain_8x": ("bf16_compile_8x", "ours_over_plain"),
         "trainer_8x": ("bf16_compile_8x", "ours_over_trainer"), "liger_8x": ("bf16_compile_8x", "ours_over_liger"),
         "plain_muon": ("muon", "ours_over_plain")}
MUON = "on a CPU Newton-Schulz runs in fp32 in ours, in bf16 in torch.optim.Muon: not the same work"
LIGER = "Liger kernels are Triton kernels (--use_liger_kernel refuses a CPU)"
# Long-context rows: each activation-memory mode at `long_seq` tokens, bf16 with the chunked loss (the logits of a
# long sequence would dominate otherwise): peak memory and tokens/s per mode. Where torch has no
# F.linear_cross_entropy (before 2.13; the lent GPU machine's 2.11) the chunked loss runs as checkpointed chunks.
CHUNKS = "chunked loss" + ("" if chunked_loss.OPTIONS is not None else
                           f" (checkpointed chunks: torch {torch.__version__} has no F.linear_cross_entropy)")
LONG_METHODS = {"perf_long_none": "long_none", "perf_long_every2": "long_every2", "perf_long_op": "long_op",
                "perf_long_full": "long_full", "perf_long_offload": "long_offload"}
LONG_MODES = {"long_none": "none", "long_every2": "every", "long_op": "op", "long_full": "full",
              "long_offload": "offload"}  # estimate_memory.Run's activation-memory modes
# benchmark method -> (estimate_memory row flags, activation checkpointing, chunked logits); fp8 is estimated as bf16
ESTIMATED_AS = {"bf16_compile": ("", False, False), "plain_pytorch": ("", False, False),
                "fp8_compile": ("", False, False), "bf16_compile_checkpointing": ("", True, False),
                "bf16_compile_8bit": ("--optim adamw_8bit", False, False),
                "bf16_compile_chunked": ("", False, True)}
TECHNIQUES = {  # label -> (accelerate config, flags, activation checkpointing), as tools/estimate_memory.py rows
    "AdamW": ("single_gpu.yaml", "", False),
    "AdamW + checkpointing": ("single_gpu.yaml", "", True),
    "8-bit AdamW": ("single_gpu.yaml", "--optim adamw_8bit", False),
    "8-bit AdamW + checkpointing": ("single_gpu.yaml", "--optim adamw_8bit", True),
    "ZeRO-2 offload + checkpointing": ("deepspeed_zero2_offload.yaml", "", True),
    "ZeRO-3 offload + checkpointing": ("deepspeed_zero3_offload.yaml", "", True),
}


def perf_extra_methods(cuda: bool, batch: int) -> dict[str, dict]:
    """The suite's combinations, added to benchmark.py's method table (baseline is its own; bf16_compile too, here
    tracing only on a CPU); `batch`: the perf rows' sequences per step (the `_8x` peers run twice as many)."""
    half_compile = ["--bf16", "--torch_compile"]
    fused = ["--optim", "adamw_torch_fused"] if cuda else []
    # ours and its peers; the dry run's compile only traces (dynamo's graphs, no kernels: minutes saved on 2 cores)
    speed = half_compile + fused + ([] if cuda else ["--torch_compile_backend", "aot_eager"])
    double = ["--per_device_train_batch_size", str(2 * batch)]
    liger = ["--use_liger_kernel"]
    fp8_launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                    os.path.join(CONFIGS, "fp8.yaml"), "--num_processes", "1"]
    long_flags = ["--bf16", "--chunked_cross_entropy"] + fused
    return {
        "long_none": {"flags": long_flags},
        "long_every2": {"flags": long_flags + ["--selective_ac_option", "2"]},
        "long_op": {"flags": long_flags + ["--selective_ac_option", "op"]},
        "long_full": {"flags": long_flags + ["--gradient_checkpointing"]},
        "long_offload": {"flags": long_flags + ["--gradient_checkpointing", "--activation_offloading"]},
        "bf16_compile_checkpointing": {"flags": half_compile + fused + ["--gradient_checkpointing"]},
        "bf16_compile_8bit": {"flags": half_compile + ["--optim", "adamw_8bit"]},
        "bf16_compile_chunked": {"flags": half_compile + fused + ["--chunked_cross_entropy"]},
        "fp8_compile": {"flags": ["--torch_compile"] + fused, "launcher": fp8_launcher,
                        "skip": None if cuda else "FP8 needs an H100/H200"},
        "bf16_compile": {"flags": speed},
        "trainer": {"flags": speed, "script": benchmark.TRAINER},
        "liger": {"flags": speed + liger, "skip": None if cuda else LIGER},
        "bf16_compile_8x": {"flags": speed + double},
        "plain_8x": {"flags": speed + double, "script": benchmark.PLAIN},
        "trainer_8x": {"flags": speed + double, "script": benchmark.TRAINER},
        "liger_8x": {"flags": speed + liger + double, "skip": None if cuda else LIGER},
        "muon": {"flags": speed + ["--optim", "muon"], "skip": None if cuda else MUON},
        "plain_muon": {"flags": speed + ["--optim", "muon"], "script": benchmark.PLAIN,
                       "skip": None if cuda else MUON},
    }


_SHAPES: dict[tuple[str, int], estimate_memory.ModelShape] = {}


def preset_shape(preset: str, vocab: int) -> estimate_memory.ModelShape:
    if (preset, vocab) not in _SHAPES:  # built on the meta device: no memory, about a second for 8b
        _SHAPES[preset, vocab] = estimate_memory.model_shape(argparse.Namespace(
            params=None, config_name=None, model_preset=preset, vocab_size=vocab))
    return _SHAPES[preset, vocab]


def row_estimate(suite: Suite, method: str) -> float | None:
    """estimate_memory.peak_memory's total for a benchmark method's run (what the tool prints for it); None for
    the fp32 baseline and the methods it does not model."""
    s = suite.settings
    if method in LONG_MODES:
        run = estimate_memory.Run(seq=s.long_seq, batch=1, mode=LONG_MODES[method], chunked=True)
    elif method in ESTIMATED_AS:
        flags, checkpointing, chunked = ESTIMATED_AS[method]
        run = estimate_memory.Run(seq=s.perf_seq, batch=s.perf_batch, mode="full" if checkpointing else "none",
                                  chunked=chunked, optimizer_bytes=2 if "adamw_8bit" in flags else 8)
    else:
        return None
    return estimate_memory.peak_memory(preset_shape(s.perf_preset, s.perf_vocab), run)["total"]


def estimate_bytes(preset: str, vocab: int, seq: int, batch: int, config: str, flags: str,
                   checkpointing: bool, chunked: bool = False) -> tuple[float, float]:
    """tools/estimate_memory.py's (GPU bytes, host bytes) for one option on one GPU."""
    shape = preset_shape(preset, vocab)
    option = next(o for o in estimate_memory.options(shape, 1, 1) if (o.config, o.flags) == (config, flags))
    activations = estimate_memory.activation_bytes(shape, seq, batch, checkpointing, chunked=chunked)
    return option.states + activations, option.host


def largest_fitting_presets(gpu_bytes: float, host_bytes: float, seq: int, batch: int,
                            vocab: int = 8192) -> dict[str, dict]:
    """Per memory technique, the largest Llama preset whose estimate fits (estimate_memory.py's 90 % headroom)."""
    result = {}
    for label, (config, flags, checkpointing) in TECHNIQUES.items():
        best = None
        for preset, shape in LLAMA_PRESETS.items():
            if shape["max_position_embeddings"] < seq:
                continue
            gpu, host = estimate_bytes(preset, vocab, seq, batch, config, flags, checkpointing)
            if estimate_memory.fits(gpu, gpu_bytes) and host <= estimate_memory.HEADROOM * host_bytes:
                best = {"preset": preset, "gpu_bytes": gpu, "host_bytes": host}
        result[label] = best
    return result


def benchmark_argv(suite: Suite, methods: list[str], long_context: bool) -> list[str]:
    """benchmark.py's command line for `methods` of the suite's perf (or long-context) benchmark."""
    s = suite.settings
    seq, batch = (s.long_seq, 1) if long_context else (s.perf_seq, s.perf_batch)
    # The long rows build the preset's shape from a config with positions for one long sequence (--config_name)
    model = [] if long_context else ["--model_preset", s.perf_preset]
    argv = ["--no_baseline", "--methods", ",".join(methods), *model, "--seq_len", str(seq),
            "--per_device_train_batch_size", str(batch), "--warm_steps", str(s.warm_steps), "--timed_steps",
            str(s.timed_steps), "--output_dir", os.path.join(suite.work, "long" if long_context else "benchmark")]
    if not long_context:
        argv = ["--plain_reference", "bf16_compile"] + argv
    argv += headline_run_flags(suite)
    if suite.seconds_left() < math.inf:
        argv += ["--time_budget_s", f"{max(suite.seconds_left(), 1):.0f}"]
    argv += ["--", "--cache_dir", os.path.join(suite.work, "cache"), "--tokenizer_vocab_size", str(s.perf_vocab)]
    if long_context:  # every held-out row: benchmark.py keeps 2, fewer than one block of 16,384 tokens
        argv += ["--config_name", long_context_config(suite), "--max_eval_samples", "100000"]
    if not suite.cuda:  # the tiny dry run trains on the suite's small corpus; the GPU on the embedded default one
        argv += ["--train_file", suite.data["train"], "--validation_file", suite.data["validation"]]
    return argv


def long_context_config(suite: Suite) -> str:
    """A config folder of the perf preset's shape with max_position_embeddings = long_seq: the presets stop at 2,048
    positions (1b), which the recipe refuses for a 16,384-token block."""
    from transformers import LlamaConfig

    from common.inputs.modeling import LLAMA_PRESETS

    s = suite.settings
    path = os.path.join(suite.work, "data", f"{s.perf_preset}-{s.long_seq}-positions")
    LlamaConfig(**{**LLAMA_PRESETS[s.perf_preset], "max_position_embeddings": s.long_seq}).save_pretrained(path)
    return path


def run_benchmark(suite: Suite, long_context: bool = False, methods: list[str] | None = None) -> dict:
    """benchmark.py's runs of `methods` (default: every planned perf method, or long-context method at `long_seq`
    tokens, one sequence per step), added to those this suite's benchmark ran before; over all of them
    {"rows": {method: row}, "failed": {method: why}, "markdown": ...}. The fp32 baseline runs only as its own row."""
    state = suite.memo("long" if long_context else "benchmark",
                       lambda: {"runs": {}, "failed": {}, "skipped": {}, "rows": {}, "markdown": ""})
    table = LONG_METHODS if long_context else PERF_METHODS
    methods = methods or sorted({table[name] for name in suite.planned if name in table},
                                key=lambda m: (m != "baseline", m))
    tried = [*state["runs"], *state["failed"], *state["skipped"]]
    new = [m for m in methods if m not in tried]
    if not new:
        return state
    argv = benchmark_argv(suite, new, long_context)
    try:
        args = benchmark.parse_args(argv, extra_methods=perf_extra_methods(suite.cuda, suite.settings.perf_batch))
    except SystemExit as e:
        state["failed"].update({m: f"benchmark.py refused its arguments (exit {e.code})" for m in new})
        return state
    os.makedirs(args.output_dir, exist_ok=True)
    usable = os.sched_getaffinity(0)
    if not suite.cuda:  # on a CPU its runs inherit one core (steadier figures: README, Benchmarks)
        os.sched_setaffinity(0, {min(usable)})
    try:
        runs, skipped, failed = benchmark.run_all(args, done=tuple(tried))
    finally:
        os.sched_setaffinity(0, usable)
    for key, value in (("runs", runs), ("skipped", skipped), ("failed", failed)):
        state[key].update(value)
    if state["runs"]:
        env = benchmark.environment(argv)  # the command this benchmark's runs so far are equivalent to
        env["command"] = "python benchmarks/benchmark.py " + shlex.join(
            benchmark_argv(suite, list(dict.fromkeys(tried + new)), long_context))
        state["rows"] = {r["method"]: r for r in benchmark.summarise(args, state["runs"], env)}
        md = os.path.join(args.output_dir, "results.md")
        benchmark.write_markdown(md, list(state["rows"].values()), env, state["skipped"], state["failed"], args)
        with open(md, encoding="utf-8") as f:  # its title one level under the suite's section
            state["markdown"] = f.read().replace("# Benchmark:", "### Benchmark:", 1)
    return state


def headline_run_flags(suite: Suite) -> list[str]:
    """The headline part does not wait for a run's evaluation and export once its timed steps are logged."""
    return ["--stop_after_timed_steps"] if suite.args.part == "headline" else []


def tail_note(result: dict) -> str:
    """Said of a run stopped at its cap or the budget after its timed steps (its figures are whole)."""
    return "; stopped after its timed steps (evaluation and export cut)" if result.get("tail_cut") else ""


def one_method(suite: Suite, method: str) -> list[str] | None:
    """The headline part runs (and saves) one method per row; part 2 runs all its planned methods at its first row."""
    return [method] if suite.args.part == "headline" else None


def perf_row(name: str, what: str, cuda_only: str | None = None, needs: tuple[str, ...] = ()) -> Row:
    long_context = name in LONG_METHODS
    method = (LONG_METHODS if long_context else PERF_METHODS)[name]

    def check(suite: Suite) -> Outcome:
        result = run_benchmark(suite, long_context, one_method(suite, method))
        row = result["rows"].get(method)
        if row is None:
            why = result["failed"].get(method) or "not run: " + result["skipped"].get(method, "no result")
            return Outcome(FAIL, why.splitlines()[0][:240])
        detail = {k: row[k] for k in ("tokens_per_second", "mfu", "peak_memory_bytes", "peak_memory_reserved_bytes",
                                      "final_loss", "step_time_median_s", "speed_vs_baseline")}
        if not all(math.isfinite(row[k]) for k in ("tokens_per_second", "final_loss")):
            return Outcome(FAIL, f"non-finite figures {detail}", detail)
        figure = f"{row['tokens_per_second']:,.0f} tok/s, step {1e3 * row['step_time_median_s']:,.1f} ms"
        if row["mfu"] is not None:
            figure += f", MFU {row['mfu']:.1%}"
        figure += memory_figure(suite, method, row, detail) + tail_note(row)
        if long_context:
            detail["logits"] = "chunked"
            figure += "; " + CHUNKS
        if method in PEERS:
            ours_method, key = PEERS[method]
            ours = result["rows"].get(ours_method)
            if ours is None:
                why = (result["failed"].get(ours_method) or "not run").splitlines()[0][:160]
                return Outcome(FAIL, f"no ratio: {ours_method} has no run ({why}); {method}: {figure}", detail)
            detail[key] = row["step_time_median_s"] / ours["step_time_median_s"]
            figure = f"{key.replace('_', ' ')} {detail[key]:.3f}x ({ours_method} flags); {method}: {figure}"
        return Outcome(PASS, figure, detail)
    return Row(name, 2, what, check, cuda_only, needs)


def memory_figure(suite: Suite, method: str, row: dict, detail: dict) -> str:
    estimate = row_estimate(suite, method)
    if estimate is not None:
        detail["estimate_bytes"] = estimate
    if not suite.cuda:  # a process's peak RSS is no allocator peak: nothing to compare
        return f", peak RSS {row['peak_memory_bytes'] / 2**20:,.0f} MiB (a CPU process)"
    text = f", peak {row['peak_memory_bytes'] / 2**30:.1f}/{(row['peak_memory_reserved_bytes'] or 0) / 2**30:.1f} " \
           "GiB alloc/reserved"
    if estimate is not None:
        text += f" vs estimate {estimate / 2**30:.1f} GiB ({row['peak_memory_bytes'] / estimate:.2f}x)"
    return text


def check_mfu_goal(suite: Suite) -> Outcome:
    result = run_benchmark(suite, methods=one_method(suite, "bf16_compile"))
    row = result["rows"].get("bf16_compile")
    if row is None or row["mfu"] is None:
        return Outcome(FAIL, "no bf16_compile MFU: " + result["failed"].get("bf16_compile", "unknown GPU")[:200])
    status = PASS if row["mfu"] >= MFU_GOAL else FAIL
    return Outcome(status, f"bf16 + compile + fused AdamW: MFU {row['mfu']:.1%} (goal >= {MFU_GOAL:.0%})",
                   {"mfu": row["mfu"]})


PEER_LABELS = {"bf16_compile": "ours", "plain_pytorch": "textbook loop", "trainer": "Trainer",
               "liger": "ours + Liger"}


def peer_table(rows: dict[str, dict]) -> list[dict]:
    """The peer rows the benchmark has, at each batch: step time, tokens/s, MFU, peak memory, and ours' speed over
    each peer (its median step time over ours')."""
    table = []
    for suffix in ("", "_8x"):
        for method, label in PEER_LABELS.items():
            name = ("plain" if method == "plain_pytorch" and suffix else method) + suffix
            row = rows.get(name)
            if row is None:
                continue
            ours = rows.get("bf16_compile" + suffix)
            table.append({"loop": label, "method": name, "batch_times": 2 if suffix else 1,
                          **{key: row[key] for key in ("step_time_median_s", "tokens_per_second", "mfu",
                                                       "peak_memory_bytes", "peak_memory_reserved_bytes")},
                          "ours_over_it": row["step_time_median_s"] / ours["step_time_median_s"] if ours else None})
    return table


def peer_markdown(table: list[dict], cuda: bool, batch: int, seq: int) -> list[str]:
    """The peer table as markdown lines (none when no peer ran)."""
    if not table:
        return []
    unit, scale = ("GiB", 2**30) if cuda else ("MiB (peak RSS)", 2**20)
    lines = [f"| loop | sequences x tokens | step, ms (median) | tokens/s | MFU | peak allocated / reserved, {unit} | "
             "ours over it |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in table:
        reserved = f"{r['peak_memory_reserved_bytes'] / scale:,.1f}" if r["peak_memory_reserved_bytes"] else "-"
        lines.append(f"| {r['loop']} | {batch * r['batch_times']} x {seq:,} | "
                     f"{1e3 * r['step_time_median_s']:,.1f} | {r['tokens_per_second']:,.0f} | "
                     + (f"{r['mfu']:.1%}" if r["mfu"] is not None else "-")
                     + f" | {r['peak_memory_bytes'] / scale:,.1f} / {reserved} | "
                     + (f"{r['ours_over_it']:.3f}x" if r["ours_over_it"] is not None else "-") + " |")
    return lines


def check_peer_table(suite: Suite) -> Outcome:
    """The peer rows that ran before it, side by side (it runs nothing)."""
    rows = (suite.memoized("benchmark") or {}).get("rows", {})
    table = peer_table(rows)
    ours = rows.get("bf16_compile")
    missing = [PEER_LABELS[m] for m in ("bf16_compile", "plain_pytorch", "trainer") if m not in rows]
    if missing:
        return Outcome(FAIL, f"no run of {', '.join(missing)} (the peer rows before this one)", {"rows": table})
    detail = {"rows": table, "mfu": ours["mfu"],
              **{key: rows[m]["step_time_median_s"] / ours["step_time_median_s"]
                 for m, (reference, key) in PEERS.items() if reference == "bf16_compile" and m in rows}}
    figure = f"ours {1e3 * ours['step_time_median_s']:,.1f} ms a step; " + ", ".join(
        f"{key.replace('_', ' ')} {detail[key]:.3f}x" for key in ("ours_over_plain", "ours_over_trainer",
                                                                   "ours_over_liger") if key in detail)
    figure += f"; MFU {ours['mfu']:.1%}" if ours["mfu"] is not None else "; no MFU (no GPU of known peak)"
    return Outcome(PASS, figure, detail)


def check_profile_step(suite: Suite) -> Outcome:
    """benchmarks/profile_step.py on one step of ours (bf16_compile's flags at the perf shape): its wall time and, on a
    GPU, the share of it the GPU is busy."""
    s = suite.settings
    step = s.warm_steps + 5  # compiled and warm (docs/results: step 8 on a GPU)
    figures_path = os.path.join(suite.work, "profile_step.json")
    if os.path.exists(figures_path):
        os.remove(figures_path)
    recipe = [PRETRAIN, "--model_preset", s.perf_preset, "--block_size", str(s.perf_seq),
              "--per_device_train_batch_size", str(s.perf_batch), "--max_steps", str(step), "--logging_steps", "1",
              "--sample_max_new_tokens", "0", "--max_eval_samples", "2", "--tokenizer_vocab_size", str(s.perf_vocab),
              "--cache_dir", os.path.join(suite.work, "cache"),
              *perf_extra_methods(suite.cuda, s.perf_batch)["bf16_compile"]["flags"]]
    if not suite.cuda:
        recipe += ["--train_file", suite.data["train"], "--validation_file", suite.data["validation"]]
    run = suite.train("profile_step", os.path.join(ROOT, "benchmarks", "profile_step.py"),
                      ["--step", str(step), "--exit_after_step", "--output_json", figures_path, "--", *recipe])
    if not os.path.isfile(figures_path):
        return Outcome(FAIL, run.error or "profile_step.py wrote no figures")
    with open(figures_path, encoding="utf-8") as f:
        figures = json.load(f)
    top = figures["top_cpu_operators"][0]["name"] if figures["top_cpu_operators"] else "-"
    figure = f"step {step} of ours: {1e3 * figures['wall_s']:,.1f} ms"
    if not suite.cuda:
        return Outcome(PASS, f"{figure} (a CPU: no GPU busy share); most CPU time: {top}", figures)
    if not figures["gpu_busy_s"]:
        return Outcome(FAIL, f"{figure}, but the profile holds no GPU kernel", figures)
    return Outcome(PASS, f"{figure}, GPU busy {1e3 * figures['gpu_busy_s']:,.1f} ms ({figures['gpu_busy_share']:.1%});"
                   f" the rest it waits for the host", figures)


def check_largest_presets(suite: Suite) -> Outcome:
    s = suite.settings
    gpu = torch.cuda.get_device_properties(0).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fitting = largest_fitting_presets(gpu, host, s.perf_seq, s.perf_batch, s.perf_vocab)
    figure = "; ".join(f"{label}: {v['preset'] if v else 'none'}" for label, v in fitting.items())
    return Outcome(PASS, f"estimates for {s.perf_batch} x {s.perf_seq} tokens on {gpu / 2**30:.0f} GiB: {figure}",
                   {"largest_presets": fitting, "gpu_bytes": gpu, "host_bytes": host})


def part2_rows() -> list[Row]:
    fp8 = "FP8 matmuls need an NVIDIA GPU of compute capability 8.9+ (H100/H200)"
    return [
        perf_row("perf_baseline", "fp32 AdamW (benchmark.py's baseline: every ratio is against it)"),
        perf_row("perf_bf16_compile", "bf16 + --torch_compile + fused AdamW (the speed combination)"),
        perf_row("perf_bf16_compile_checkpointing", "the same + --gradient_checkpointing"),
        perf_row("perf_fp8_compile", "FP8 (torchao, fp8.yaml) + --torch_compile + fused AdamW", cuda_only=fp8,
                 needs=("torchao",)),
        perf_row("perf_bf16_compile_8bit", "bf16 + --torch_compile + 8-bit AdamW", needs=("bitsandbytes",)),
        perf_row("perf_bf16_compile_chunked", "bf16 + --torch_compile + fused AdamW + --chunked_cross_entropy"),
        perf_row("perf_long_none", "long context: bf16 + --chunked_cross_entropy (checkpointed chunks on a torch "
                 "without F.linear_cross_entropy), no checkpointing"),
        perf_row("perf_long_every2", "long context: the same + --selective_ac_option 2 (every 2nd layer)"),
        perf_row("perf_long_op", "long context: the same + --selective_ac_option op (matmul outputs kept)"),
        perf_row("perf_long_full", "long context: the same + --gradient_checkpointing (every layer)"),
        perf_row("perf_long_offload", "long context: the same + --gradient_checkpointing --activation_offloading"),
        perf_row("perf_plain_loop", "benchmarks/plain_loop.py with the bf16_compile flags: our speed over its"),
        perf_row("perf_trainer", "benchmarks/trainer_loop.py (transformers' Trainer: whole-model torch_compile, fused "
                 "AdamW, bf16, use_cache=False): our speed over its"),
        perf_row("perf_liger", "ours + --use_liger_kernel", cuda_only=LIGER, needs=("liger_kernel",)),
        perf_row("perf_muon", "ours + --optim muon (Muon for the hidden matrices, fused AdamW for the rest)",
                 cuda_only=MUON),
        perf_row("perf_plain_muon", "the textbook loop with torch.optim.Muon + AdamW (two optimizers): our speed over "
                 "its", cuda_only=MUON),
        Row("perf_peer_table", 2, "the peer rows side by side: step time, tokens/s, MFU, peak memory, ours over each",
            check_peer_table),
        Row("perf_profile_step", 2, "benchmarks/profile_step.py on one step of ours: the share of it the GPU is busy",
            check_profile_step),
        perf_row("perf_bf16_compile_8x", "ours at twice the batch"),
        perf_row("perf_plain_loop_8x", "the textbook loop at twice the batch: our speed over its"),
        perf_row("perf_trainer_8x", "Trainer at twice the batch: our speed over its"),
        perf_row("perf_liger_8x", "ours + --use_liger_kernel at twice the batch", cuda_only=LIGER,
                 needs=("liger_kernel",)),
        Row("perf_mfu_goal", 2, f"MFU of bf16 + compile + fused AdamW >= {MFU_GOAL:.0%}", check_mfu_goal,
            cuda_only="MFU needs a GPU of known peak FLOP/s"),
        Row("perf_largest_presets", 2, "largest preset that fits per memory technique (estimate_memory.py)",
            check_largest_presets, cuda_only="needs the GPU's memory size"),
    ]
