"""Sequence parallelism (accelerate_configs/deepspeed_sequence_parallel.yaml: DeepSpeed ALST/Ulysses, sp_size 2)
trains as one process does, on 2 CPU processes over gloo.

Both processes form one sequence-parallel group: each holds half of every sequence, and attention exchanges the
halves for half of the heads (all-to-all). One optimizer step still trains per-device batch x accumulation x
processes sequences, so 2 processes x 2 sequences x 2 accumulation steps must reproduce 1 process x 4 x 2 under the
same engine (ZeRO-2, deepspeed_zero2.yaml): losses, gradient norms and exported weights, at test_distributed.py's
tolerances (LOSS_RTOL 1e-5, WEIGHT_RTOL 1e-4 relative per tensor). An off-by-one in the slices' targets, a token
count over one slice only or a wrong loss scale each give other losses from step 1 or 2 on.

What it cannot serve stops with one line before any work: a size that does not divide the sequence or the heads,
an engine other than DeepSpeed, an attention kernel that differs from the model's, a recipe it is not wired into.
"""

from __future__ import annotations

import pytest

from conftest import launcher, run_script
from test_distributed import assert_same_training, init_model, train_args  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def zero2_reference(corpus, init_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "zero2-one-process"
    run_script("pretrain_llama.py", *train_args(corpus, init_model, out, 4), launcher=launcher("deepspeed_zero2.yaml", 1))
    return out


def test_two_sequence_parallel_processes_match_one(corpus, init_model, zero2_reference, tmp_path):
    out = tmp_path / "sp2"
    run_script("pretrain_llama.py", *train_args(corpus, init_model, out, 2),
               launcher=launcher("deepspeed_sequence_parallel.yaml"))
    print(f"deepspeed_sequence_parallel.yaml: {assert_same_training(out, zero2_reference)}")


@pytest.mark.parametrize("extra, config, expected", [
    (("--block_size", "63"), "deepspeed_sequence_parallel.yaml", "does not divide the sequence length 63"),
    (("--attn_implementation", "eager"), "deepspeed_sequence_parallel.yaml",
     "sequence parallelism needs parallelism_config_sp_attn_implementation equal to --attn_implementation"),
    (("--chunked_cross_entropy",), "deepspeed_sequence_parallel.yaml",
     "--chunked_cross_entropy is not tested with sequence parallelism"),
], ids=["sequence", "kernel", "chunked"])
def test_what_it_cannot_serve_stops_before_any_work(extra, config, expected, corpus, init_model, tmp_path):
    proc = run_script("pretrain_llama.py", *train_args(corpus, init_model, tmp_path / "run", 2), *extra,
                      launcher=launcher(config), check=False, launcher_output=False, timeout=120)
    assert proc.returncode != 0 and expected in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # stopped before the output folder was claimed


def test_heads_engine_and_recipes_are_checked(monkeypatch):
    """The checks themselves (in-process): heads, key/value heads, the engine, the other recipes."""
    import argparse

    from transformers import LlamaConfig

    from common.features import sequence_parallel as sp

    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION", "sdpa")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = argparse.Namespace(attn_implementation="sdpa")

    assert sp.check_sequence_parallel(args, LlamaConfig(num_attention_heads=4, num_key_value_heads=2), 64) == 2
    for config in (LlamaConfig(hidden_size=96, num_attention_heads=3, num_key_value_heads=3),
                   LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=3)):
        with pytest.raises(SystemExit):
            sp.check_sequence_parallel(args, config, 64)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    with pytest.raises(SystemExit):
        sp.check_sequence_parallel(args, LlamaConfig(num_attention_heads=4), 64)
    with pytest.raises(SystemExit):
        sp.refuse_sequence_parallel("finetune_classifier.py")
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "false")
    assert sp.check_sequence_parallel(args, LlamaConfig(hidden_size=96, num_attention_heads=3), 63) == 1
    sp.refuse_sequence_parallel("finetune_classifier.py")
