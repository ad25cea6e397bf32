"""benchmarks/benchmark.py: complete, well-formed outputs (not timings), and a plain loop that does the same work."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from conftest import CORE_OPTIMIZER, ROOT, read_metrics, run_script, train_losses

BENCHMARK, PLAIN_LOOP = (os.path.join(ROOT, "benchmarks", name) for name in ("benchmark.py", "plain_loop.py"))

REQUIRED = ("tokens_per_second", "samples_per_second", "peak_memory_bytes", "final_loss", "step_time_median_s",
            "speed_vs_baseline", "memory_vs_baseline")


@pytest.fixture(scope="module")
def bench(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("bench")
    # On a CPU, fp16 is listed as not run (with its reason) rather than failing the benchmark.
    methods = "baseline,no_clipping,accumulation,plain_pytorch" + ("" if torch.cuda.is_available() else ",fp16")
    run_script(BENCHMARK, "--quick", "--methods", methods, "--plain_reference", "no_clipping",
               "--warm_steps", "1", "--timed_steps", "2",
               "--seq_len", "64", "--output_dir", str(out / "out"),
               "--", "--train_file", corpus["train"], "--validation_file", corpus["validation"],
               "--tokenizer_vocab_size", "512", "--cache_dir", str(out / "cache"))
    with open(out / "out" / "results.json") as f:
        rows = json.load(f)
    return out / "out", rows


def test_results_json_has_a_complete_row_per_method(bench):
    _, rows = bench
    assert isinstance(rows, list)
    assert sorted(r["method"] for r in rows) == ["accumulation", "baseline", "no_clipping", "plain_pytorch"]
    for row in rows:
        for key in REQUIRED:
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]) and row[key] > 0, (row["method"], key)
        assert row["step_time_p25_s"] <= row["step_time_median_s"] <= row["step_time_p75_s"]
        env = row["environment"]
        assert env["machine"]["cpu"] and env["machine"]["cpu_cores"] >= 1 and env["date"]
        assert all(env["versions"][k] for k in ("torch", "accelerate", "transformers", "deepspeed", "bitsandbytes"))
        assert "benchmark.py" in env["command"] and "--quick" in env["command"]
    by = {r["method"]: r for r in rows}
    assert by["baseline"]["speed_vs_baseline"] == 1.0 and by["baseline"]["memory_vs_baseline"] == 1.0
    # Same samples per optimizer step: bs 8 = 2 x 4 accumulation.
    assert by["accumulation"]["flags"] == ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4"]
    plain = by["plain_pytorch"]
    assert plain["reference_method"] == "no_clipping"
    assert math.isfinite(plain["ours_over_plain"]) and plain["ours_over_plain"] > 0


def test_same_work_same_losses(bench):
    """The plain loop (same data order, init, optimizer, schedule; no clipping) reaches the unclipped recipe's loss,
    and exact accumulation the baseline's."""
    _, rows = bench
    by = {r["method"]: r for r in rows}
    assert by["plain_pytorch"]["final_loss"] == pytest.approx(by["no_clipping"]["final_loss"], rel=1e-5)
    assert by["accumulation"]["final_loss"] == pytest.approx(by["baseline"]["final_loss"], rel=1e-4)


def test_plain_loop_writes_metrics_in_the_same_format(bench):
    out, _ = bench
    keys = {}
    for method in ("baseline", "plain_pytorch"):
        rows = read_metrics(str(out / "runs" / f"{method}-0"))
        keys[method] = {k for r in rows if "tokens_per_second" in r for k in r}
    read_by_benchmark = {"step", "loss", "tokens_per_second", "peak_memory_bytes", "time"}
    assert keys["baseline"] >= keys["plain_pytorch"] >= read_by_benchmark | {"lr", "epoch"}


def test_plain_loop_runs_alone_on_a_fresh_cache(tmp_path, corpus):
    """It trains its own tokenizer when none is cached (it is not only ever run after the script it mirrors)."""
    run_script(PLAIN_LOOP, "--train_file", corpus["train"], "--validation_file", corpus["validation"],
               "--tokenizer_vocab_size", "512", "--block_size", "64", "--max_steps", "2", "--logging_steps", "1",
               "--cache_dir", str(tmp_path / "cache"), "--output_dir", str(tmp_path / "out"))
    assert [r["step"] for r in read_metrics(str(tmp_path / "out"))] == [1, 2]


def test_markdown_and_chart(bench):
    out, rows = bench
    md = (out / "results.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert sorted(line.split("|")[1].strip() for line in table) == sorted(r["method"] for r in rows)
    assert "Machine:" in md and "Versions:" in md and "torch " in md and "Command: `python" in md
    assert "Plain PyTorch loop" in md
    if not torch.cuda.is_available():
        assert "fp16 (fp16 loss scaling needs a CUDA GPU)" in md
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--methods", "baseline,warp_drive"], "error: unknown method(s) warp_drive"),
    (["--", "--max_steps", "5"], "error: --max_steps is set by the benchmark"),
    (["--timed_steps", "1"], "error: --timed_steps must be >= 2"),
    (["--logging_steps", "4", "--warm_steps", "2", "--timed_steps", "8"], "error: --warm_steps (2) and --timed_steps"),
])
def test_bad_input_fails_fast_with_one_line(tmp_path, args, message):
    proc = run_script(BENCHMARK, "--output_dir", str(tmp_path), *args, check=False, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(message)
    assert not (tmp_path / "runs").exists()


@pytest.fixture(scope="module")
def ten_layers(tmp_path_factory) -> str:
    """A --config_name folder: a small Llama with more decoder layers (10) than torch's recompile limit (8)."""
    from transformers import LlamaConfig

    path = str(tmp_path_factory.mktemp("ten_layers"))
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=10, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=64).save_pretrained(path)
    return path


def test_plain_loop_compiles_each_layer_once(tmp_path, corpus, ten_layers):
    """Compiled layer by layer, ten layers share one graph and nothing breaks it. A training forward that builds a KV
    cache (the config's use_cache=True) compiled a graph per layer on its `layer_idx`, up to torch's recompile limit
    (8), then ran the rest eagerly: the textbook loop measured that, not training."""
    run_script(PLAIN_LOOP, "--train_file", corpus["train"], "--validation_file", corpus["validation"],
               "--tokenizer_vocab_size", "512", "--block_size", "64", "--config_name", ten_layers, "--max_steps", "2",
               "--torch_compile", "--torch_compile_backend", "aot_eager",  # dynamo's graphs, no kernels built
               "--cache_dir", str(tmp_path / "cache"), "--output_dir", str(tmp_path / "out"))
    with open(tmp_path / "out" / "all_results.json") as f:
        results = json.load(f)
    assert (results["compiled_graphs"], results["graph_breaks"]) == (1, 0)


def test_plain_loop_losses_equal_the_recipes(tmp_path, corpus):
    """Same seed, data, model, optimizer and schedule (AdamW + cosine, as benchmark.py runs both), no clipping: every
    step's loss is the recipe's."""
    common = (*CORE_OPTIMIZER, "--train_file", corpus["train"], "--validation_file", corpus["validation"],
              "--tokenizer_vocab_size", "512", "--block_size", "64", "--max_steps", "4", "--logging_steps", "1",
              "--max_grad_norm", "0", "--cache_dir", str(tmp_path / "cache"))
    run_script("pretrain_llama.py", *common, "--sample_max_new_tokens", "0", "--max_eval_samples", "2",
               "--output_dir", str(tmp_path / "recipe"))
    run_script(PLAIN_LOOP, *common, "--output_dir", str(tmp_path / "plain"))
    recipe, plain = (train_losses(str(tmp_path / name)) for name in ("recipe", "plain"))
    assert list(plain) == list(recipe) == [1, 2, 3, 4]
    assert list(plain.values()) == pytest.approx(list(recipe.values()), rel=1e-6, abs=0)
