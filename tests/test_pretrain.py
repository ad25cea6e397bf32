"""scripts/pretrain_llama.py end to end: accumulation, resume, export, the embedded default corpus."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import CORE_OPTIMIZER, ROOT, code_at, read_metrics, run_script, train_losses

ROOT_PATH = Path(ROOT)


def pretrain_args(corpus, tmp_path, output: str, *extra: str) -> list[str]:
    return ["--train_file", corpus["train"], "--validation_file", corpus["validation"],
            "--tokenizer_vocab_size", "512", "--block_size", "64", "--cache_dir", str(tmp_path / "cache"),
            "--output_dir", str(tmp_path / output), "--logging_steps", "1", "--sample_max_new_tokens", "0",
            "--mixed_precision", "no", *extra]


def weights(output_dir) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(output_dir, "model.safetensors"))


def max_weight_diff(a, b) -> float:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def test_accumulation_equals_big_batch_and_loss_falls(corpus, tmp_path):
    """8 x 1 and 2 x 4 see the same 8 sequences per optimizer step: same losses, same weights (fp32)."""
    common = ("--max_steps", "12", "--learning_rate", "3e-3", "--warmup_steps", "2")
    run_script("pretrain_llama.py", *pretrain_args(corpus, tmp_path, "big", "--per_device_train_batch_size", "8",
                                                   "--gradient_accumulation_steps", "1", *common))
    run_script("pretrain_llama.py", *pretrain_args(corpus, tmp_path, "acc", "--per_device_train_batch_size", "2",
                                                   "--gradient_accumulation_steps", "4", *common))
    big, acc = train_losses(tmp_path / "big"), train_losses(tmp_path / "acc")
    assert sorted(big) == list(range(1, 13))
    assert [acc[s] for s in big] == pytest.approx([big[s] for s in big], abs=1e-5)
    assert max_weight_diff(tmp_path / "big", tmp_path / "acc") < 1e-4  # Adam's normalised steps, fp32 reordering
    assert big[12] < big[1] - 1.0  # it learns: the loss falls by more than a nat in 12 steps
    results = json.loads((tmp_path / "big" / "all_results.json").read_text())
    assert results["train_steps"] == 12 and results["perplexity"] == pytest.approx(2.718281828 ** results["eval_loss"])
    lrs = [r["lr"] for r in read_metrics(tmp_path / "big") if "lr" in r]
    assert lrs[:3] == pytest.approx([0.0, 1.5e-3, 3e-3])  # transformers' linear warmup over 2 optimizer steps
    assert all(r["grad_norm"] > 0 and r["tokens_per_second"] > 0 for r in read_metrics(tmp_path / "big") if "lr" in r)


def test_resume_mid_epoch_continues_the_uninterrupted_run(corpus, dropout_config, tmp_path):
    """Resume from the step-8 checkpoint (mid-epoch) in a fresh folder: steps 9..12, across an epoch boundary, log
    the same losses and end with the same weights as the run that never stopped. With attention dropout on: the
    resumed run draws the same dropout masks (when its first iterator drew from the restored global RNG, the
    weights ended 1.2e-3 apart)."""
    common = ("--max_steps", "12", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
              "--max_train_samples", "80", "--learning_rate", "3e-3", "--config_name", dropout_config)
    run_script("pretrain_llama.py", *pretrain_args(corpus, tmp_path, "full", "--checkpointing_steps", "4",
                                                   "--save_total_limit", "2", *common))
    assert sorted(os.listdir(tmp_path / "full" / "checkpoints")) == ["step_12", "step_8"]  # step_4 pruned
    epochs = {r["step"]: r["epoch"] for r in read_metrics(tmp_path / "full") if "epoch" in r}
    assert int(epochs[8]) < int(epochs[12]) and epochs[8] % 1 != 0  # mid-epoch checkpoint, epoch boundary ahead
    # The interrupted run: a fresh folder whose only state is the step-8 checkpoint.
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_8", resumed / "checkpoints" / "step_8")
    proc = run_script("pretrain_llama.py", *pretrain_args(corpus, tmp_path, "resumed", "--resume_from_checkpoint",
                                                          "latest", *common))
    assert "Resumed from" in proc.stderr + proc.stdout
    full, again = train_losses(tmp_path / "full"), train_losses(resumed)
    assert sorted(again) == list(range(9, 13))
    assert [again[s] for s in again] == pytest.approx([full[s] for s in again], abs=1e-6)
    difference = max_weight_diff(tmp_path / "full", resumed)
    print(f"resumed vs uninterrupted, attention dropout 0.1: weights max difference {difference:.1e}")
    assert difference < 1e-6


def test_default_run_uses_the_embedded_corpus(tmp_path):
    """No data flags: the stdlib code and docs corpora and a tokenizer trained on both, cached for the next run."""
    args = ["--cache_dir", str(tmp_path / "cache"), "--max_steps", "2", "--max_eval_samples", "4",
            "--sample_max_new_tokens", "4", "--logging_steps", "1"]
    run_script("pretrain_llama.py", "--output_dir", str(tmp_path / "a"), *args)
    cached = sorted(os.listdir(tmp_path / "cache"))
    assert [c.rsplit("-", 1)[0] for c in cached] == ["stdlib-corpus", "stdlib-docs", "tokenizer-bpe"]  # code, docs
    stamp = os.path.getmtime(tmp_path / "cache" / cached[2] / "tokenizer.json")
    proc = run_script("pretrain_llama.py", "--output_dir", str(tmp_path / "b"), *args)
    assert "Training a byte-level BPE tokenizer" not in proc.stderr  # reused, not retrained
    assert os.path.getmtime(tmp_path / "cache" / cached[2] / "tokenizer.json") == stamp
    assert train_losses(tmp_path / "a") == train_losses(tmp_path / "b")  # same seed, same data: same run


def test_moe_preset_trains_in_bf16_and_exports_a_mixtral(corpus, tmp_path):
    from transformers import AutoConfig

    args = pretrain_args(corpus, tmp_path, "moe", "--model_preset", "moe-tiny", "--max_steps", "10",
                         "--learning_rate", "3e-3", "--warmup_steps", "1")
    args[args.index("--mixed_precision") + 1] = "bf16"
    run_script("pretrain_llama.py", *args)
    losses = train_losses(tmp_path / "moe")
    assert losses[10] < losses[1] - 0.5
    config = AutoConfig.from_pretrained(tmp_path / "moe")
    assert config.model_type == "mixtral" and config.num_local_experts == 4


def test_a_copied_script_runs_from_anywhere_and_trains_the_same(corpus, tmp_path):
    """The README's way to adapt a script: copy it anywhere, keep the repository on PYTHONPATH, delete the features'
    marked lines (tools/copy_recipe.py). The copy, importing no feature, trains the same as the original with the
    core's optimizer and schedule (the original's Muon + WSD defaults are features); with --gradient_checkpointing
    the export still generates with a KV cache."""
    from tools.copy_recipe import common_modules, strip_features

    copy = tmp_path / "elsewhere" / "my_pretrain.py"
    copy.parent.mkdir()
    copy.write_text(strip_features((ROOT_PATH / "scripts" / "pretrain_llama.py").read_text()))
    assert not any(".features" in name for name in common_modules(copy.read_text()))
    args = pretrain_args(corpus, tmp_path, "copy", "--max_steps", "3", "--gradient_checkpointing")
    proc = subprocess.run([sys.executable, str(copy), *args], cwd=copy.parent, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_script("pretrain_llama.py", *pretrain_args(corpus, tmp_path, "orig", "--max_steps", "3",
                                                   "--gradient_checkpointing", *CORE_OPTIMIZER))
    assert train_losses(tmp_path / "copy") == train_losses(tmp_path / "orig")
    assert json.loads((tmp_path / "copy" / "config.json").read_text())["use_cache"] is True


# The last commit before common/ was cut into a core and two tiers: its checkpoints must still resume exactly.
BEFORE_TIERS = "87efb57c76710368adb1b70556ecb23124b9d817"


def test_a_checkpoint_written_before_the_tiers_continues_exactly(corpus, tmp_path):
    """The pretraining recipe as it was before the tiers (taken from git) trains 8 steps and checkpoints at 4; this
    version resumes that step-4 checkpoint and ends with the same losses and weights as the old uninterrupted run."""
    old = code_at(BEFORE_TIERS, tmp_path / "old_code")
    common = ("--max_steps", "8", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
              "--max_train_samples", "80", *CORE_OPTIMIZER, "--learning_rate", "3e-3")  # AdamW: the old default
    run_script(str(old / "scripts" / "pretrain_llama.py"),
               *pretrain_args(corpus, tmp_path, "old", "--checkpointing_steps", "4", *common))
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "old" / "checkpoints" / "step_4", resumed / "checkpoints" / "step_4")
    run_script("pretrain_llama.py", *pretrain_args(corpus, tmp_path, "resumed", "--resume_from_checkpoint", "latest",
                                                   *common))
    old_losses, again = train_losses(tmp_path / "old"), train_losses(resumed)
    assert sorted(again) == list(range(5, 9)) and [again[s] for s in again] == [old_losses[s] for s in again]
    assert max_weight_diff(tmp_path / "old", resumed) == 0
