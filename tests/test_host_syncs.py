"""Each training loop reads a device value to the host once per optimizer step outside logging steps: the divergence
guard's read of the step's loss, gradient norm and stop request (`common/guard.py`). A logging step adds the row's
one read (token and padding counts); DPO's a second one, its pair metrics (`rewards/...`), right after the first,
when the queue has already drained. On a GPU every such read waits for the device's queue to drain.

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


def reads_per_step(tmp_path, script: str, *flags: str) -> list[list[str]]:
    prefix = str(tmp_path / "reads")
    run_script(PROBE, prefix, os.path.join(ROOT, "scripts", script), "--output_dir", str(tmp_path / "out"),
               *COMMON, *flags)
    with open(f"{prefix}.0.json") as f:
        steps = json.load(f)["steps"]
    assert len(steps) == STEPS
    return steps


def in_model(site: str) -> bool:
    return f"site-packages{os.sep}transformers{os.sep}" in site


def assert_one_read_per_step(steps: list[list[str]], script: str, row_extras: str | None = None) -> None:
    """One read per step (the guard's), plus the row's on logging steps (and `row_extras`' read, where given)."""
    for step, sites in enumerate(steps, start=1):
        loop = [site for site in sites if not in_model(site)]
        logging_step = step % LOGGING_STEPS == 0
        assert len(loop) == 1 + logging_step * (1 + bool(row_extras)), f"{script} step {step}: {loop}"
        assert "common/guard.py" in loop[0] and " check" in loop[0], loop
        if logging_step:
            assert "common/metrics.py" in loop[1], loop
        if logging_step and row_extras:
            assert row_extras in loop[2], loop
    model = sorted({site for sites in steps for site in sites if in_model(site)})
    print(f"{script}: {sum(len(s) - len([x for x in s if in_model(x)]) for s in steps)} loop reads in {STEPS} steps "
          f"({LOGGING_STEPS}-step logging); model's own reads per step: {len(steps[1]) - 1} at {model}")


def test_pretraining_reads_once_per_step(corpus, tmp_path):
    steps = reads_per_step(tmp_path, "pretrain_llama.py", "--train_file", corpus["train"], "--validation_file",
                           corpus["validation"], "--block_size", "64", "--tokenizer_vocab_size", "512",
                           "--per_device_train_batch_size", "4", "--sample_max_new_tokens", "0",
                           "--max_eval_samples", "4", "--cache_dir", str(tmp_path / "cache"))
    assert_one_read_per_step(steps, "pretrain_llama.py")


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_sft_reads_once_per_step(sft, tmp_path, packing):  # noqa: F811
    steps = reads_per_step(tmp_path, "finetune_causal_lm.py", "--model_name_or_path", sft["model"], "--train_file",
                           sft["train"], "--validation_file", sft["validation"], "--per_device_train_batch_size", "4",
                           *(["--packing"] if packing else []))
    assert_one_read_per_step(steps, "finetune_causal_lm.py")


def test_classifier_reads_once_per_step(tiny, tmp_path):  # noqa: F811
    steps = reads_per_step(tmp_path, "finetune_classifier.py", "--model_name_or_path", tiny["model"], "--train_file",
                           tiny["train"], "--validation_file", tiny["validation"], "--per_device_train_batch_size",
                           "8", "--max_seq_length", "128")
    assert_one_read_per_step(steps, "finetune_classifier.py")


@pytest.mark.parametrize("reference", ["live", "precomputed"])
def test_dpo_reads_once_per_step(dpo, tmp_path, reference):  # noqa: F811
    """The reference's forward (live) or its values in the batch (precomputed) and the pairs' figures add no read:
    the metrics stay on the device until the logging step's row."""
    steps = reads_per_step(tmp_path, "finetune_dpo.py", "--model_name_or_path", dpo["model"], "--train_file",
                           dpo["train"], "--validation_file", dpo["validation"], "--per_device_train_batch_size", "2",
                           "--cache_dir", str(tmp_path / "cache"),
                           *(["--precompute_ref_log_probs"] if reference == "precomputed" else []))
    assert_one_read_per_step(steps, "finetune_dpo.py", row_extras="scripts/finetune_dpo.py")
