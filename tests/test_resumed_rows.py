"""A resumed run logs the uninterrupted run's rows, figure for figure, also when its checkpoint's step is not a
multiple of --logging_steps (a SIGTERM stop's checkpoint usually is not): the logging window not yet logged (the
losses and skipped steps of its steps, its padding and positions, DPO's reward sums) travels in the checkpoint
(common/metrics.py `StepLog.window_state`, saved with `TrainingProgress`).

Each recipe runs STEPS steps with a row every LOGGING_STEPS and a checkpoint every CHECKPOINT steps, then again from
the checkpoint at step CHECKPOINT in a fresh folder: the resumed run's first row (step 4) covers steps 1-4 as the
uninterrupted run's does, its last (step 6) steps 5-6. Every figure of those rows equals the uninterrupted run's to
1e-12 (the counts exactly), except the time and what depends on it (tokens per second) and the process's memory. On
one process for each recipe (pretraining also with --async_checkpointing, which saves the window from its own
staging); on 2 processes for DPO, whose padding, positions and reward sums are per process (rank 0 resumes with all
processes' sums, the others with none, so the row's sum over processes is right).
"""

from __future__ import annotations


import pytest
from conftest import CORE_OPTIMIZER, code_at, launcher, read_metrics, run_script
from test_finetune_causal_lm import sft  # noqa: F401  (fixture)
from test_finetune_classifier import tiny  # noqa: F401  (fixture)
from test_finetune_dpo import dpo  # noqa: F401  (fixture)

STEPS, LOGGING_STEPS, CHECKPOINT = 6, 4, 3
BEFORE_WINDOW = "246a6dd6cb05c1b555c9f3f27ae85ee81e406446"  # checkpoints held the step alone
MEASURED = {"time", "tokens_per_second", "mfu", "peak_memory_bytes", "peak_memory_reserved_bytes"}
COMMON = ("--max_steps", str(STEPS), "--logging_steps", str(LOGGING_STEPS), "--seed", "0", "--mixed_precision", "no")


def train_rows(out: str) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out) if "loss" in r}


def assert_resumed_rows_are_the_uninterrupted_ones(script: str, out: str, *flags: str,
                                                   processes: int = 1) -> dict[int, dict]:
    """Train `script` uninterrupted and resumed from its checkpoint at step CHECKPOINT; return the rows."""
    run = launcher("cpu_2proc.yaml") if processes == 2 else None
    run_script(script, *flags, *COMMON, "--output_dir", f"{out}/full", "--checkpointing_steps", str(CHECKPOINT),
               launcher=run)
    run_script(script, *flags, *COMMON, "--output_dir", f"{out}/resumed", "--resume_from_checkpoint",
               f"{out}/full/checkpoints/step_{CHECKPOINT}", launcher=run)
    full, resumed = train_rows(f"{out}/full"), train_rows(f"{out}/resumed")
    assert sorted(full) == [4, 6] and sorted(resumed) == [4, 6]
    for step, row in full.items():
        assert row.keys() == resumed[step].keys()
        for figure in sorted(row.keys() - MEASURED):
            assert resumed[step][figure] == pytest.approx(row[figure], rel=0, abs=1e-12), (script, step, figure)
    return full


def pretraining(corpus, tmp_path) -> tuple[str, ...]:
    return ("--train_file", corpus["train"], "--validation_file", corpus["validation"], "--block_size", "64",
            "--tokenizer_vocab_size", "512", "--cache_dir", str(tmp_path / "cache"), "--per_device_train_batch_size",
            "4", "--sample_max_new_tokens", "0", "--max_eval_samples", "4")


@pytest.mark.parametrize("saving", [(), ("--async_checkpointing",)], ids=["blocking", "async"])
def test_pretraining(corpus, tmp_path, saving):
    rows = assert_resumed_rows_are_the_uninterrupted_ones("pretrain_llama.py", str(tmp_path),
                                                          *pretraining(corpus, tmp_path), *saving)
    assert rows[4]["padding_fraction"] == 0  # packed blocks


def test_a_checkpoint_without_the_window_resumes_with_an_empty_one(corpus, tmp_path):
    """A checkpoint of the code before the window travelled (BEFORE_WINDOW, from git) resumes: its first row is step
    4 alone, its next one steps 5-6, as the old run logged them."""
    old = code_at(BEFORE_WINDOW, tmp_path / "old_code")
    flags = (*pretraining(corpus, tmp_path), "--max_steps", str(STEPS), "--seed", "0", "--mixed_precision", "no",
             *CORE_OPTIMIZER)  # the old default
    run_script(str(old / "scripts" / "pretrain_llama.py"), *flags, "--output_dir", f"{tmp_path}/old",
               "--logging_steps", "1", "--checkpointing_steps", str(CHECKPOINT))
    run_script("pretrain_llama.py", *flags, "--output_dir", f"{tmp_path}/resumed", "--logging_steps",
               str(LOGGING_STEPS), "--resume_from_checkpoint", f"{tmp_path}/old/checkpoints/step_{CHECKPOINT}")
    old_rows, resumed = train_rows(f"{tmp_path}/old"), train_rows(f"{tmp_path}/resumed")
    assert sorted(resumed) == [4, 6]
    assert resumed[4]["loss"] == old_rows[4]["loss"]
    assert resumed[6]["loss"] == pytest.approx((old_rows[5]["loss"] + old_rows[6]["loss"]) / 2, rel=0, abs=1e-12)


def test_supervised_fine_tuning(sft, tmp_path):  # noqa: F811
    rows = assert_resumed_rows_are_the_uninterrupted_ones(
        "finetune_causal_lm.py", str(tmp_path), "--model_name_or_path", sft["model"], "--train_file", sft["train"],
        "--validation_file", sft["validation"], "--learning_rate", "1e-3", "--per_device_train_batch_size", "2")
    assert rows[4]["padding_fraction"] > 0.1  # the padding counts are tested too


def test_classifier(tiny, tmp_path):  # noqa: F811
    rows = assert_resumed_rows_are_the_uninterrupted_ones(
        "finetune_classifier.py", str(tmp_path), "--model_name_or_path", tiny["model"], "--train_file", tiny["train"],
        "--validation_file", tiny["validation"], "--per_device_train_batch_size", "4")
    assert rows[4]["padding_fraction"] > 0.1


@pytest.mark.parametrize("processes", [1, 2])
def test_dpo(dpo, tmp_path, processes):  # noqa: F811
    rows = assert_resumed_rows_are_the_uninterrupted_ones(
        "finetune_dpo.py", str(tmp_path), "--model_name_or_path", dpo["model"], "--train_file", dpo["train"],
        "--validation_file", dpo["validation"], "--learning_rate", "1e-3", "--per_device_train_batch_size", "2",
        processes=processes)
    assert rows[4]["padding_fraction"] > 0.1 and "rewards/accuracies" in rows[4]
