"""No training loop reads a device value to the host inside a step that neither logs nor checkpoints (on a GPU every
such read waits for the device's queue to drain: the GPU idles). With fused AdamW, the default, a non-finite step is
skipped on the device and the step check's figures (loss, gradient norm, stop request: `common/guard.py`) are read a
step later from a copy made without waiting. A logging step reads its check and then its row (token and padding
counts, the window's losses); DPO a third time, its pair metrics (`rewards/...`), when the queue has already drained.
Optimizers without a device-side skip (here foreach AdamW) keep the one read per step.

Counted with `tests/host_sync_probe.py` (`.item()`, `.tolist()`, `bool()`, `float()`, `int()`, `.cpu()` and
`.numpy()` on any tensor, per optimizer step). Reads inside the model's own forward (transformers) are reported, not
held: transformers 5.23 reads one value per forward to detect packed sequences (`masking_utils.py`).
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import ROOT, run_script
from test_finetune_causal_lm import sft  # noqa: F401  (fixture)
from test_finetune_classifier import tiny  # noqa: F401  (fixture)
from test_finetune_dpo import dpo  # noqa: F401  (fixture)

PROBE = os.path.join(ROOT, "tests", "host_sync_probe.py")
STEPS, LOGGING_STEPS = 6, 3  # steps 3 and 6 write a row
COMMON = ("--max_steps", str(STEPS), "--logging_steps", str(LOGGING_STEPS), "--gradient_accumulation_steps", "2",
          "--mixed_precision", "no", "--seed", "0")


def reads_per_step(tmp_path, script: str, *flags: str, launcher: list[str] | None = None) -> tuple[list, list]:
    """(the reads of each optimizer step, the steps whose late copies each step read), of rank 0."""
    prefix = str(tmp_path / "reads")
    run_script(PROBE, prefix, os.path.join(ROOT, "scripts", script), "--output_dir", str(tmp_path / "out"),
               *COMMON, *flags, launcher=launcher)
    with open(f"{prefix}.0.json") as f:
        probed = json.load(f)
    assert len(probed["steps"]) == STEPS
    return probed["steps"], probed["late"]


def in_model(site: str) -> bool:
    return f"site-packages{os.sep}transformers{os.sep}" in site


def assert_no_read_inside_a_step(probed: tuple[list, list], script: str, row_extras: str | None = None) -> None:
    """No read on steps that do not log; a logging step reads its check, its row (and `row_extras`, where given).
    Every step after a non-logging one reads that step's late copy, and nothing else late."""
    steps, late = probed
    for step, sites in enumerate(steps, start=1):
        loop = [site for site in sites if not in_model(site)]
        logging_step = step % LOGGING_STEPS == 0
        assert len(loop) == logging_step * (2 + bool(row_extras)), f"{script} step {step}: {loop}"
        if logging_step:
            assert "common/guard.py" in loop[0] and "common/metrics.py" in loop[1], loop
        if logging_step and row_extras:
            assert row_extras in loop[2], loop
        previous_logged = (step - 1) % LOGGING_STEPS == 0
        assert late[step - 1] == ([] if previous_logged else [step - 1]), f"{script} step {step}: late {late}"
    report(steps, script)


def assert_one_read_per_step(probed: tuple[list, list], script: str) -> None:
    """An optimizer without a device-side skip: the check's read in every step, before the update."""
    steps, late = probed
    for step, sites in enumerate(steps, start=1):
        loop = [site for site in sites if not in_model(site)]
        assert len(loop) == 1 + (step % LOGGING_STEPS == 0), f"{script} step {step}: {loop}"
        assert "common/guard.py" in loop[0] and loop[0].endswith(" read"), loop
    assert not any(late), late
    report(steps, script)


def report(steps: list[list[str]], script: str) -> None:
    model = sorted({site for sites in steps for site in sites if in_model(site)})
    print(f"{script}: {sum(len(s) - len([x for x in s if in_model(x)]) for s in steps)} loop reads in {STEPS} steps "
          f"({LOGGING_STEPS}-step logging); model's own reads per step: {len(steps[1])} at {model}")


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "muon"])
def test_pretraining_reads_nothing_inside_a_step(corpus, tmp_path, optim):
    steps = reads_per_step(tmp_path, "pretrain_llama.py", "--train_file", corpus["train"], "--validation_file",
                           corpus["validation"], "--block_size", "64", "--tokenizer_vocab_size", "512",
                           "--per_device_train_batch_size", "4", "--sample_max_new_tokens", "0",
                           "--max_eval_samples", "4", "--cache_dir", str(tmp_path / "cache"), "--optim", optim)
    assert_no_read_inside_a_step(steps, f"pretrain_llama.py --optim {optim}")


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_sft_reads_nothing_inside_a_step(sft, tmp_path, packing):  # noqa: F811
    steps = reads_per_step(tmp_path, "finetune_causal_lm.py", "--model_name_or_path", sft["model"], "--train_file",
                           sft["train"], "--validation_file", sft["validation"], "--per_device_train_batch_size", "4",
                           *(["--packing"] if packing else []))
    assert_no_read_inside_a_step(steps, "finetune_causal_lm.py")


def test_classifier_reads_nothing_inside_a_step(tiny, tmp_path):  # noqa: F811
    steps = reads_per_step(tmp_path, "finetune_classifier.py", "--model_name_or_path", tiny["model"], "--train_file",
                           tiny["train"], "--validation_file", tiny["validation"], "--per_device_train_batch_size",
                           "8", "--max_seq_length", "128")
    assert_no_read_inside_a_step(steps, "finetune_classifier.py")


@pytest.mark.parametrize("reference", ["live", "precomputed"])
def test_dpo_reads_nothing_inside_a_step(dpo, tmp_path, reference):  # noqa: F811
    """The reference's forward (live) or its values in the batch (precomputed) and the pairs' figures add no read:
    the metrics stay on the device until the logging step's row."""
    steps = reads_per_step(tmp_path, "finetune_dpo.py", "--model_name_or_path", dpo["model"], "--train_file",
                           dpo["train"], "--validation_file", dpo["validation"], "--per_device_train_batch_size", "2",
                           "--cache_dir", str(tmp_path / "cache"),
                           *(["--precompute_ref_log_probs"] if reference == "precomputed" else []))
    assert_no_read_inside_a_step(steps, "finetune_dpo.py", row_extras="scripts/finetune_dpo.py")


def pretraining_flags(corpus, tmp_path) -> tuple[str, ...]:
    return ("--train_file", corpus["train"], "--validation_file", corpus["validation"], "--block_size", "64",
            "--tokenizer_vocab_size", "512", "--per_device_train_batch_size", "2", "--sample_max_new_tokens", "0",
            "--max_eval_samples", "4", "--cache_dir", str(tmp_path / "cache"))


def test_an_optimizer_without_a_device_side_skip_reads_once_per_step(corpus, tmp_path):
    """foreach AdamW cannot skip on the device: the step waits for its check before the update."""
    probed = reads_per_step(tmp_path, "pretrain_llama.py", *pretraining_flags(corpus, tmp_path),
                            "--optim", "adamw_torch")
    assert_one_read_per_step(probed, "pretrain_llama.py --optim adamw_torch")


@pytest.mark.parametrize("config", ["cpu_2proc.yaml", "fsdp2.yaml"])
def test_two_processes_read_nothing_inside_a_step(corpus, tmp_path, config):
    """DDP and FSDP2 (its gradient norm a DTensor): the same reads as one process, on every rank."""
    from test_fsdp import fsdp_launcher

    run = fsdp_launcher(2, config)
    probed = reads_per_step(tmp_path, "pretrain_llama.py", *pretraining_flags(corpus, tmp_path), launcher=run)
    assert_no_read_inside_a_step(probed, f"pretrain_llama.py on {config}")
    with open(tmp_path / "reads.1.json") as f:
        rank1 = json.load(f)
    assert [len(s) for s in rank1["steps"]] == [len(s) for s in probed[0]] and rank1["late"] == probed[1]
