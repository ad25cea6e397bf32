"""The GPU suite's dry run: its plumbing on a CPU, so that it cannot rot between GPU sessions.

The dry run really runs every selected row that a CPU can run (tiny preset, 3 steps, block 64, a corpus made here)
and reports every CUDA-only row as SKIP, never as PASS. To stay well under two minutes on a 2-core machine, the test
leaves out the rows whose cost on a CPU is a one-time build rather than the suite's plumbing: torch.compile (a cold
inductor build takes minutes on two cores), DeepSpeed's CPU Adam for the offload rows (a C++ build), and the compiled
performance methods; and the rows that repeat another row's plumbing with other flags (a run of ~10 s each): ZeRO-2
stays in as the accelerate-launch row (fsdp2 is the same row with another config file; tests/test_distributed.py and
tests/test_fsdp.py cover the engines on CPUs), perf_lora_8b as the adapters' benchmark row (perf_qlora_8b adds
--load_in_4bit; tests/test_lora.py covers QLoRA); perf_grpo runs in the headline's dry run.
The dry run goes through tools/lent_gpu.sh (the lent GPU machine's wrapper: with --dry-run it passes through to
`python -m gpu_suite` and turns $OUT into --copy_to), so that the wrapper is proven with the suite.

The headline part's dry run (about 70 s) runs its peer rows at the tiny size, their compile tracing only (aot_eager):
ours, the textbook loop, transformers' Trainer (the Liger row is CUDA only), the peer table, one profiled step and the
GRPO row at the tiny size (ours alone where trl is not installed, as here); the 8B adapter rows are left out
(perf_lora_8b runs in the full dry run). Each row's result must be on disk before the
next row ends, and the peer rows' ratios must be their step times' quotients. The long-context rows' label and flags
as on the lent machine's torch 2.11, which has no F.linear_cross_entropy, are checked in-process (their plumbing is
perf_long_op's in the full dry run). Every memory row's detail carries its peak and tools/estimate_memory.py's
estimate for its run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT

# Pretraining rows that differ from the bf16 row by their flags only: their flags are checked by the recipe in
# test_the_pretraining_rows_left_out_pass_the_recipes_flag_checks, not run again (~13 s).
SAME_PLUMBING = ("fused_adamw", "paged_adamw_8bit", "adafactor", "gradient_checkpointing")
SKIPPED_HERE = ("compile,zero1,zero3,*offload,fsdp2,perf_bf16_compile*,perf_plain_loop,perf_long_none,perf_long_every2,"
                "perf_long_full,perf_qlora_8b,dpo_zero3,perf_trainer*,perf_peer_table,perf_profile_step,perf_*_8x,"
                "perf_grpo,perf_vlm," + ",".join(SAME_PLUMBING))
CUDA_ONLY = {"fp16", "tf32", "tp", "fp8", "perf_fp8_compile", "perf_mfu_goal", "perf_largest_presets", "liger",
             "sft_liger", "dpo_liger"}
CPU_ROWS = {"bf16", "eager", "adamw_8bit", "moe", "accumulation", "zero2", "sft", "dpo", "dpo_precomputed", "classifier",
            "perf_baseline", "perf_long_op", "perf_lora_8b", "perf_async_checkpoint"}
LOSS = re.compile(r"loss (-?[\d.]+|nan|inf) -> (-?[\d.]+|nan|inf) in (\d+) steps")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU check")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu_suite")
    results_before = sorted(os.listdir(os.path.join(ROOT, "docs", "results")))
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "tools", "lent_gpu.sh"), "--dry-run", "--skip", SKIPPED_HERE,
         "--work_dir", str(d / "work"), "--results_dir", str(d / "results")],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHON": sys.executable, "OUT": str(d / "out")})
    assert sorted(os.listdir(os.path.join(ROOT, "docs", "results"))) == results_before  # never a GPU result
    return proc, d


def table(stdout: str) -> dict[str, tuple[str, str]]:
    """The summary table at the end of the output: row -> (status, figure); the total row under 'total'."""
    lines = stdout.rstrip("\n").splitlines()
    start = max(i for i, line in enumerate(lines) if line == "| row | status | figure |")
    rows = lines[start + 2:]
    assert rows and all(line.startswith("| ") and line.endswith(" |") for line in rows), rows
    return {cells[0]: (cells[1], cells[2]) for cells in (line[2:-2].split(" | ") for line in rows)}


def test_exits_zero_with_the_summary_table_last(dry_run):
    proc, _ = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = table(proc.stdout)
    assert proc.stdout.rstrip("\n").splitlines()[-1].startswith("| total | ")
    assert "CUDA-only rows SKIP" in proc.stdout.rstrip("\n").splitlines()[-(len(rows) + 4)]
    counts = {status: int(n) for n, status in re.findall(r"(\d+) (PASS|FAIL|SKIP)", rows.pop("total")[0])}
    assert counts == {
        s: sum(status == s for status, _ in rows.values()) for s in ("PASS", "FAIL", "SKIP")}


def test_cuda_only_rows_are_skipped_never_passed(dry_run):
    proc, _ = dry_run
    rows = table(proc.stdout)
    for name in CUDA_ONLY:
        status, figure = rows[name]
        assert status == "SKIP" and figure.startswith("CUDA only: "), (name, status, figure)


def test_cpu_rows_really_run_and_pass(dry_run):
    proc, _ = dry_run
    rows = table(proc.stdout)
    for name in CPU_ROWS:
        status, figure = rows[name]
        assert status == "PASS", (name, figure)
        found = LOSS.search(figure)
        if found:  # training rows: finite, falling, over the steps asked for
            first, last, steps = float(found[1]), float(found[2]), int(found[3])
            assert math.isfinite(first) and math.isfinite(last) and steps in (3, 6, 90)
            assert last < first, (name, figure)
    assert LOSS.search(rows["bf16"][1])[3] == "3"
    assert re.match(r"[\d,]+ tok/s", rows["perf_baseline"][1])
    accuracy, eval_loss = map(float, re.search(r"accuracy ([\d.]+), eval loss ([\d.]+)", rows["classifier"][1]).groups())
    assert accuracy >= 0.9 and eval_loss <= 0.6  # learned: chance is 0.5 and ln 2
    assert "held-out rewards/accuracies" in rows["dpo"][1]
    assert rows["dpo_precomputed"][1].startswith("vs live reference: losses within ")
    assert all(f"per {mode} save" in rows["perf_async_checkpoint"][1] for mode in ("blocking", "async"))
    deselected = {name for name, (status, figure) in rows.items() if figure == "not selected (--only / --skip)"}
    assert deselected == {"compile", "zero1", "zero3", "zero2_offload", "zero3_offload", "fsdp2", "perf_bf16_compile",
                          "perf_bf16_compile_checkpointing", "perf_bf16_compile_8bit", "perf_bf16_compile_chunked",
                          "perf_plain_loop", "perf_long_none", "perf_long_every2", "perf_long_full",
                          "perf_long_offload", "perf_qlora_8b", "dpo_zero3", "perf_trainer", "perf_peer_table",
                          "perf_profile_step", "perf_bf16_compile_8x", "perf_plain_loop_8x", "perf_trainer_8x",
                          "perf_liger_8x", "perf_grpo", "perf_vlm", *SAME_PLUMBING}
    assert all(rows[name][0] == "SKIP" for name in deselected)


def test_results_files_parse_and_say_dry_run(dry_run):
    proc, d = dry_run
    for folder in ("results", "out"):
        names = sorted(os.listdir(d / folder))
        stems = {n.split(".")[0] for n in names if n.endswith((".json", ".md"))}
        assert len(stems) == 1 and next(iter(stems)).startswith("gpu-suite-dry-run-"), names
    stem = next(iter(stems))
    record = json.loads((d / "out" / f"{stem}.json").read_text())
    assert record["dry_run"] is True and record["part"] == "all" and record["device"].startswith("CPU")
    assert record["environment"]["versions"]["torch"] and record["settings"]["steps"] == 3
    table_rows = table(proc.stdout)
    table_rows.pop("total")
    assert {r["name"]: r["status"] for r in record["rows"]} == {k: v[0] for k, v in table_rows.items()}
    assert all(r["status"] == "SKIP" for r in record["rows"] if r["cuda_only"])
    assert [r["method"] for r in record["performance"]] == ["baseline"]
    md = (d / "out" / f"{stem}.md").read_text()
    assert "DRY RUN on a CPU" in md and "not a GPU result" in md
    assert (d / "out" / f"{stem}-logs.tar.gz").stat().st_size > 0


def test_the_pretraining_rows_left_out_pass_the_recipes_flag_checks(tmp_path):
    """Each pretraining row's command (the suite's arguments and the row's flags) passes pretrain_llama.py's flag
    checks (on a CPU: the rows that run on one), those the dry run leaves out above included: a renamed flag or value
    fails here."""
    import argparse

    from gpu_suite.correctness import part1_rows
    from gpu_suite.suite import Suite, settings_for
    from test_bad_inputs import pretrain
    for name in ("train", "validation"):
        (tmp_path / f"{name}.jsonl").write_text('{"text": "a b c"}\n')
    suite = argparse.Namespace(settings=settings_for(False), work=str(tmp_path),
                               data={name: str(tmp_path / f"{name}.jsonl") for name in ("train", "validation")})
    rows = {row.name: row for row in part1_rows() if row.flags and not row.cuda_only}  # CUDA's: refused here
    assert set(SAME_PLUMBING) <= set(rows)
    for row in rows.values():
        # an unknown flag or value, or a combination the checks refuse, exits (SystemExit 2) with its one line
        args = pretrain.parse_args(Suite.pretrain_args(suite) + list(row.flags) + ["--output_dir", str(tmp_path / "o")])
        assert args.output_dir == str(tmp_path / "o"), row.name


def test_largest_preset_per_technique_from_the_estimator():
    from gpu_suite.performance import largest_fitting_presets

    big_host = largest_fitting_presets(80e9, 1e12, seq=2048, batch=4)
    assert big_host["AdamW"]["preset"] == "1b" and big_host["8-bit AdamW + checkpointing"]["preset"] == "1b"
    assert big_host["ZeRO-3 offload + checkpointing"]["preset"] == "8b"  # 18 B/param on the host, ~0 on the GPU
    small_host = largest_fitting_presets(80e9, 64e9, seq=2048, batch=4)
    assert small_host["ZeRO-3 offload + checkpointing"]["preset"] == "1b"
    assert largest_fitting_presets(1e9, 1e12, seq=2048, batch=4)["AdamW"] is None


def test_the_long_context_rows_build_a_model_that_takes_their_sequence(tmp_path):
    """On a GPU the long rows train the 1b shape on 16,384-token blocks; the 1b preset has 2,048 positions, which the
    recipe refuses (all five rows failed so on an H200). Their command builds the preset's shape from a config whose
    positions hold the sequence, and keeps every held-out row (2 rows hold less than one block)."""
    import argparse

    from common.inputs.modeling import LLAMA_PRESETS, check_block_size
    from gpu_suite.performance import benchmark_argv
    from gpu_suite.suite import settings_for
    from transformers import AutoConfig

    settings = settings_for(cuda=True)
    suite = argparse.Namespace(settings=settings, work=str(tmp_path), cuda=True, seconds_left=lambda: math.inf,
                               args=argparse.Namespace(part="headline"))
    argv = benchmark_argv(suite, ["long_none"], long_context=True)
    assert "--model_preset" not in argv and argv[argv.index("--seq_len") + 1] == str(settings.long_seq)
    config = AutoConfig.from_pretrained(argv[argv.index("--config_name") + 1])
    check_block_size(config, settings.long_seq)  # the recipe's own check: no SystemExit
    assert config.max_position_embeddings == settings.long_seq
    shape = {k: v for k, v in LLAMA_PRESETS[settings.perf_preset].items() if k != "max_position_embeddings"}
    assert {k: getattr(config, k) for k in shape} == shape
    assert argv[argv.index("--max_eval_samples") + 1] == "100000"


def test_a_gpu_part_on_a_cpu_is_refused_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gpu_suite", "--part", "1",
                           "--results_dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: no CUDA GPU here")
    assert not os.listdir(tmp_path)


HEADLINE_SKIPPED_HERE = "perf_lora_8b,perf_qlora_8b"
PEER_ROWS = {"perf_bf16_compile", "perf_plain_loop", "perf_trainer", "perf_peer_table", "perf_profile_step"}


@pytest.fixture(scope="module")
def headline_dry_run(tmp_path_factory):
    """The headline dry run, and every state of its results file seen while it ran (read every 0.1 s)."""
    d = tmp_path_factory.mktemp("headline")
    with open(d / "stdout", "w") as stdout:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpu_suite", "--part", "headline", "--dry-run", "--skip", HEADLINE_SKIPPED_HERE,
             "--work_dir", str(d / "work"), "--results_dir", str(d / "results"), "--copy_to", str(d / "out")],
            cwd=ROOT, stdout=stdout, stderr=subprocess.STDOUT, text=True)
        seen, began = [], time.monotonic()
        while proc.poll() is None and time.monotonic() - began < 600:
            for path in (d / "out").glob("*-headline.json"):
                statuses = {r["name"]: r["status"] + ": " + r["figure"] for r in json.loads(path.read_text())["rows"]}
                if not seen or seen[-1] != statuses:
                    seen.append(statuses)
            time.sleep(0.1)
        proc.kill()
        proc.wait()
    return proc.returncode, (d / "stdout").read_text(), d, seen


def test_headline_rows_run_in_order_and_each_is_saved_before_the_next_ends(headline_dry_run):
    from gpu_suite.headline import CAPS_S

    returncode, stdout, d, seen = headline_dry_run
    assert returncode == 0, stdout[-3000:]
    rows = table(stdout)
    rows.pop("total")
    assert list(rows) == list(CAPS_S)  # the headline's order, nothing else
    assert {name for name, (status, _) in rows.items() if status == "PASS"} == PEER_ROWS | {"perf_grpo"}
    for name in ("perf_mfu_goal", "perf_liger"):
        assert rows[name][0] == "SKIP" and rows[name][1].startswith("CUDA only: ")
    # while the second row ran, the file already held the first one's result (the rest: not reached yet)
    assert any(s["perf_bf16_compile"].startswith("PASS") and s["perf_plain_loop"].startswith("SKIP: not reached")
               for s in seen), seen
    for folder in ("results", "out"):
        names = sorted(p.name for p in (d / folder).iterdir() if not p.name.endswith(".tar.gz"))
        assert len(names) == 2 and all(re.fullmatch(r"gpu-suite-dry-run-[\d-]{10}-headline\.(json|md)", n)
                                       for n in names), names


def test_headline_peer_rows_carry_their_ratios_and_mfu(headline_dry_run):
    """Each peer's `ours_over_*` is its median step time over ours' (the benchmark's own rows, recomputed here); the
    peer table repeats them and ours' MFU (None on a CPU: no known peak); every loop ran ours' flags, the Trainer
    through benchmarks/trainer_loop.py."""
    _, _, d, _ = headline_dry_run
    record = json.loads(next((d / "out").glob("*-headline.json")).read_text())
    runs = {r["method"]: r for r in record["performance"]}
    assert sorted(runs) == ["bf16_compile", "plain_pytorch", "trainer"]
    ours = runs["bf16_compile"]
    assert runs["trainer"]["script"] == "benchmarks/trainer_loop.py"
    assert runs["plain_pytorch"]["script"] == "benchmarks/plain_loop.py"
    for run in runs.values():
        assert {"--bf16", "--torch_compile"} <= set(run["flags"]) and run["flags"] == ours["flags"]
        assert 0 < run["step_time_p25_s"] <= run["step_time_median_s"] <= run["step_time_p75_s"]
        assert run["tokens_per_second"] > 0 and run["peak_memory_bytes"] > 0 and math.isfinite(run["final_loss"])
    detail = {r["name"]: r["detail"] for r in record["rows"]}
    ratios = {"ours_over_plain": runs["plain_pytorch"]["step_time_median_s"] / ours["step_time_median_s"],
              "ours_over_trainer": runs["trainer"]["step_time_median_s"] / ours["step_time_median_s"]}
    assert detail["perf_plain_loop"]["ours_over_plain"] == ratios["ours_over_plain"]
    assert detail["perf_trainer"]["ours_over_trainer"] == ratios["ours_over_trainer"]
    for name in ("perf_bf16_compile", "perf_plain_loop", "perf_trainer"):
        assert detail[name]["mfu"] is None and detail[name]["step_time_median_s"] > 0
    peers = detail["perf_peer_table"]
    assert {k: peers[k] for k in ratios} == ratios and peers["mfu"] is None and "ours_over_liger" not in peers
    assert [(r["loop"], r["ours_over_it"]) for r in peers["rows"]] == [
        ("ours", 1.0), ("textbook loop", ratios["ours_over_plain"]), ("Trainer", ratios["ours_over_trainer"])]
    profile = detail["perf_profile_step"]
    assert profile["wall_s"] > 0 and profile["gpu_busy_s"] is None and profile["top_cpu_operators"]
    md = next((d / "out").glob("*-headline.md")).read_text()
    peer_lines = md.split("## Peer table")[1].split("\n## ")[0].splitlines()
    assert [line.split(" | ")[0] for line in peer_lines if line.startswith("| ")][1:] == [
        "| ours", "| textbook loop", "| Trainer"]  # after the header


def test_headline_grpo_row_carries_ours_and_trl_or_says_ours_alone(headline_dry_run):
    """The GRPO row's detail: ours' median step and generation share (its generation over its step); TRL's and ours'
    speed over it (TRL's step over ours') where trl is importable, else none and the figure says ours ran alone."""
    _, _, d, _ = headline_dry_run
    record = json.loads(next((d / "out").glob("*-headline.json")).read_text())
    grpo = next(r for r in record["rows"] if r["name"] == "perf_grpo")
    detail, figure = grpo["detail"], grpo["figure"]
    assert grpo["status"] == "PASS", figure
    assert (detail["preset"], detail["steps"], detail["bf16"]) == ("tiny", 3, False)
    runs = [detail["ours"]] + ([detail["trl"]] if detail["trl"] else [])
    for run in runs:
        assert 0 < run["generation_seconds"] < run["step_seconds"]
        assert run["generation_share"] == run["generation_seconds"] / run["step_seconds"]
        assert 0 < run["mean_completion_length"] <= detail["max_completion_length"]
    assert figure.startswith(f"ours {1e3 * detail['ours']['step_seconds']:,.0f} ms a step")
    if importlib.util.find_spec("trl") is None:
        assert detail["trl"] is None and detail["speed_vs_trl"] is None
        assert "TRL not run: trl is not importable here (a CPU dry run: ours alone)" in figure
    else:
        assert detail["speed_vs_trl"] == detail["trl"]["step_seconds"] / detail["ours"]["step_seconds"]
        assert f"ours {detail['speed_vs_trl']:.2f}x TRL's speed" in figure


def test_the_grpo_row_fails_in_one_line_without_trl_on_cuda_and_reports_the_ratio_with_it(tmp_path, monkeypatch):
    """On a GPU a missing trl is a FAIL before any work; with TRL's figures the row's ratio is TRL's step over ours'
    (benchmarks/grpo_vs_trl.py's measure stands in for the two runs here)."""
    import argparse

    from benchmarks import grpo_vs_trl
    from gpu_suite import grpo

    built = []
    suite = argparse.Namespace(cuda=True, work=str(tmp_path), seconds_left=lambda: 80.0,
                               memo=lambda key, make: built.append(key) or {"path": "model", "parameters": 98e6})
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else find_spec(name, *a))
    assert grpo.check_grpo(suite) == grpo.Outcome("FAIL", grpo.NO_TRL_ON_CUDA) and not built

    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "trl" else find_spec(name, *a))
    seen = []

    def measure(args):
        seen.append(args)
        runs = {"ours": (0.5, 0.4), "trl": (0.8, 0.6)}
        figures = {name: {"step_seconds": step, "generation_seconds": gen, "generation_share": gen / step,
                          "mean_completion_length": 64.0, "version": "1.16.0"} for name, (step, gen) in runs.items()}
        return {**figures, "speed_vs_trl": 0.8 / 0.5, "bf16": True}

    monkeypatch.setattr(grpo_vs_trl, "measure", measure)
    outcome = grpo.check_grpo(suite)
    args = seen[0]
    assert outcome.status == "PASS" and built == ["grpo_model"]
    assert (args.model_name_or_path, args.steps, args.num_generations, args.per_device_train_batch_size,
            args.max_completion_length, args.ours_only) == ("model", 4, 8, 16, 64, False)
    assert args.trl_python == sys.executable and args.bf16 is None and args.time_budget_s == 80
    assert outcome.detail["speed_vs_trl"] == 1.6 and outcome.detail["preset"] == "125m"
    assert outcome.figure == ("ours 500 ms a step (80% generating), TRL 1.16.0 800 ms (75% generating): ours 1.60x "
                              "TRL's speed; completions of 64.0 / 64.0 tokens on average; 125m (98.0M), 16 "
                              "completions (G 8) of <= 64 tokens, bf16")


def test_grpo_vs_trl_without_trl_here_is_one_line(capsys):
    from benchmarks import grpo_vs_trl

    importable = importlib.util.find_spec("trl") is not None
    with pytest.raises(SystemExit) as e:
        grpo_vs_trl.parse_args(["--model_name_or_path", "m", "--steps", "1", "--ours_only"])
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--steps must be at least 2: the first step is warm-up")
    if not importable:
        with pytest.raises(SystemExit):
            grpo_vs_trl.parse_args(["--model_name_or_path", "m"])
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
            "trl is not importable here: pip install trl==1.16.0, give --trl_python (a venv with TRL) or --ours_only")
    args = grpo_vs_trl.parse_args(["--model_name_or_path", "m", "--trl_python", "/venv/bin/python"])
    assert args.trl_python == "/venv/bin/python" and not args.ours_only


def test_long_rows_on_a_torch_without_f_linear_cross_entropy_say_checkpointed_chunks(monkeypatch):
    """The long-context rows as on the lent machine's torch 2.11 (no F.linear_cross_entropy): each says it trains with
    the chunked loss's checkpointed chunks, runs --bf16 --chunked_cross_entropy, and its estimate orders as its
    checkpointing does. Their plumbing runs in the full dry run (perf_long_op); the checkpointed chunks' numerics are
    tests/test_chunked_loss.py's."""
    import argparse
    import importlib

    import gpu_suite.performance as performance
    from common.features import chunked_loss
    from gpu_suite.suite import settings_for

    monkeypatch.delattr(torch.nn.functional, "linear_cross_entropy")
    monkeypatch.setattr(chunked_loss, "OPTIONS", None)
    try:
        reloaded = importlib.reload(performance)
        assert reloaded.CHUNKS == (f"chunked loss (checkpointed chunks: torch {torch.__version__} has no "
                                   "F.linear_cross_entropy)")
        methods = reloaded.perf_extra_methods(False, 8)
        suite = argparse.Namespace(settings=settings_for(False))
        for name in ("perf_long_none", "perf_long_full"):
            method = reloaded.LONG_METHODS[name]
            assert {"--chunked_cross_entropy", "--bf16"} <= set(methods[method]["flags"]), name
        # the estimate is the one function's, for the row's run: no checkpointing holds more than checkpointing
        assert reloaded.row_estimate(suite, "long_none") > reloaded.row_estimate(suite, "long_full") > 0
    finally:
        monkeypatch.undo()
        importlib.reload(performance)


def assert_memory_figures(details: dict, names: tuple[str, ...]) -> None:
    """Each memory row's detail: its measured peak and tools/estimate_memory.py's peak_memory for its run."""
    for name in names:
        assert details[name]["peak_memory_bytes"] > 0 and details[name]["estimate_bytes"] > 0, (name, details[name])


def test_memory_rows_carry_their_peak_and_the_estimate(dry_run):
    _, d = dry_run
    record = json.loads(next((d / "out").glob("gpu-suite-dry-run-*.json")).read_text())
    assert_memory_figures({r["name"]: r["detail"] for r in record["rows"]}, ("perf_lora_8b", "perf_long_op"))
