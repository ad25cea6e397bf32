"""The loops' step bookkeeping (common/steps.py), in-process: a resume at any step hands out exactly the micro-batches
the uninterrupted run would have, epochs included, and never goes past `total_steps`."""

from __future__ import annotations

import time

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader

from common.steps import TrainingProgress, count_optimizer_steps, optimizer_step_windows

EXAMPLES, BATCH, ACCUMULATION = 22, 2, 2  # 11 micro-batches: 5 optimizer steps per epoch, one micro-batch left over


@pytest.fixture()
def accelerator():
    yield Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=7))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def loader(accelerator, drop_last: bool = False) -> tuple[DataLoader, DataLoader]:
    """(unprepared, prepared) shuffled loaders over examples 0..EXAMPLES-1."""
    plain = DataLoader([{"input_ids": torch.tensor([i])} for i in range(EXAMPLES)], batch_size=BATCH, shuffle=True,
                       drop_last=drop_last)
    return plain, accelerator.prepare(plain)


def run(accelerator, start_step: int, total_steps: int) -> list[list[int]]:
    """The example ids of each optimizer step from `start_step`, as a freshly started process sees them."""
    plain, prepared = loader(accelerator)
    steps_per_epoch, _ = count_optimizer_steps(plain, ACCUMULATION, 1, total_steps, 0)
    progress = TrainingProgress()
    progress.step = start_step
    steps = []
    for window in optimizer_step_windows(prepared, progress, steps_per_epoch, total_steps, ACCUMULATION):
        steps.append(torch.cat([b["input_ids"].flatten() for b in window]).tolist())
        assert progress.step == start_step + len(steps)  # the step this window completes
    assert progress.step == max(start_step, total_steps)
    return steps


def test_step_counts(accelerator):
    plain, _ = loader(accelerator)
    assert count_optimizer_steps(plain, ACCUMULATION, 1, -1, 2.0) == (5, 10)
    assert count_optimizer_steps(plain, ACCUMULATION, 2, -1, 1.5) == (3, 5)  # 6 micro-batches per process
    assert count_optimizer_steps(plain, ACCUMULATION, 1, 7, 1.0) == (5, 7)  # max_steps wins
    dropped, _ = loader(accelerator, drop_last=True)
    assert count_optimizer_steps(dropped, ACCUMULATION, 2, -1, 1.0) == (2, 2)  # 5 per process with drop_last


def test_every_epoch_sees_each_example_at_most_once_in_a_new_order(accelerator):
    steps = run(accelerator, 0, 10)
    epochs = [sum(steps[:5], []), sum(steps[5:], [])]
    assert all(len(set(e)) == len(e) == 20 for e in epochs)  # 20 of 22: the last micro-batch is a partial window
    assert epochs[0] != epochs[1]  # reshuffled per epoch


@pytest.mark.parametrize("start", [1, 3, 5, 6, 9, 12, 13])
def test_resume_at_any_step_continues_the_uninterrupted_run(accelerator, start):
    """13 steps (2.6 epochs): resuming mid-epoch, at an epoch boundary, or at the very last step (nothing more)."""
    full = run(accelerator, 0, 13)
    assert len(full) == 13
    assert run(accelerator, start, 13) == full[start:]


def test_the_progress_bar_draws_nothing_before_the_first_step(accelerator, tmp_path, capsys):
    """Each recipe logs its `Model: ...` line once the step log (and its bar) exists: the bar's `train: 0%` frame,
    drawn at once, left that line to begin after it, on the same line. Now the bar is drawn from the first step."""
    from common.metrics import StepLog

    log = StepLog(accelerator, str(tmp_path), 0, 10, 5, 1)
    assert capsys.readouterr().err == ""  # the recipe's "Model:" line starts a line of its own
    time.sleep(log.bar.mininterval)  # a step's time
    log.bar.update(1)
    assert "train:  10%" in capsys.readouterr().err
    log.bar.close()
