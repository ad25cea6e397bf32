"""A non-finite step skipped on the device (fused AdamW's `found_inf`, its figures read a step later: common/guard.py,
common/features/divergence.py) leaves exactly what a step skipped on the host's word leaves: the weights, Adam's
moments and step counts, and the schedule, bit for bit, after every step; divergence stops a run with the same
finite weights, one step later.

In process, on the recipes' loop shape (check, update, schedule, zero_grad, step_check), with a model whose input is
NaN on the chosen steps."""

from __future__ import annotations

import math

import pytest
import torch
from accelerate import Accelerator
from transformers import get_scheduler

from common.features.divergence import NonFiniteGuard
from common.features.muon import MuonWithAdamW
from common.guard import Verdict
from common.steps import TrainingProgress


def train(nan_steps: set[int], on_device: bool, read_every: int, steps: int = 10, max_nonfinite: int = 3,
          muon: bool = False):
    """(the state after each step: weights, optimizer state, schedule; the verdicts; the step the run stopped at).
    `muon`: --optim muon's optimizer (Muon for the weight matrices, fused AdamW for the biases)."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    if muon:
        optimizer = MuonWithAdamW([{"params": [model[0].weight, model[2].weight], "use_muon": True},
                                   {"params": [model[0].bias, model[2].bias]}], lr=1e-2)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=2, num_training_steps=steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    progress = TrainingProgress()
    guard = NonFiniteGuard(accelerator, progress, max_nonfinite)
    assert guard.skips_on_device()
    guard.skips_on_device = lambda: on_device  # False: every check is read before the update, as other optimizers
    data = torch.randn(steps, 4, 6, generator=torch.Generator().manual_seed(1))
    states, verdicts = [], []
    for step in range(1, steps + 1):
        progress.step = step
        x = data[step - 1] * (math.nan if step in nan_steps else 1.0)
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        if guard.check(loss.detach(), grad_norm).verdict is Verdict.APPLY:
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        checked = guard.step_check(read=step % read_every == 0)
        if checked.verdict is Verdict.DIVERGED:
            return states, verdicts, step
        verdicts.append(checked.verdict if checked.read else None)
        states.append(snapshot(model, optimizer, scheduler))
    return states, verdicts, None


def snapshot(model, optimizer, scheduler) -> dict:
    return {"weights": [p.detach().clone() for p in model.parameters()],
            "moments": [{k: v.clone() for k, v in s.items()} for s in optimizer.optimizer.state.values()],
            "schedule": dict(scheduler.scheduler.state_dict()), "lr": optimizer.param_groups[0]["lr"]}


def assert_same(a: dict, b: dict, step: int, schedule_known: bool) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"])), f"weights differ after step {step}"
    if not a["moments"]:  # a first step skipped on the host's word has created no state; the device skip a fresh one
        assert all(not v.any() for state in b["moments"] for v in state.values()), f"state after step {step}"
    for x, y in zip(a["moments"], b["moments"]):
        assert all(torch.equal(x[k], y[k]) for k in x), f"Adam state differs after step {step}"
    if schedule_known:  # a skip read a step late has its schedule step taken back then, before the next update
        assert a["schedule"] == b["schedule"] and a["lr"] == b["lr"], f"schedule differs after step {step}"


@pytest.mark.parametrize("nan_steps", [{4}, {1}, {4, 5}, {10}], ids=["one", "first", "two_in_a_row", "last"])
@pytest.mark.parametrize("read_every", [1, 3, 100], ids=["read_each", "read_every_3", "read_late"])
def test_a_step_skipped_on_the_device_leaves_what_a_host_skip_leaves(nan_steps, read_every):
    host, host_verdicts, _ = train(nan_steps, on_device=False, read_every=1)
    device, _, _ = train(nan_steps, on_device=True, read_every=read_every)
    assert [v is Verdict.SKIP for v in host_verdicts] == [s in nan_steps for s in range(1, 11)]
    late = {s for s in nan_steps if s % read_every}  # read a step later
    assert len(host) == len(device) == 10
    for step, (a, b) in enumerate(zip(host, device), start=1):
        assert_same(a, b, step, schedule_known=step not in late)
    # the skipped steps changed nothing: the state after each equals the state before it
    for step in nan_steps - {1}:
        assert all(torch.equal(x, y) for x, y in zip(device[step - 2]["weights"], device[step - 1]["weights"]))


def test_divergence_stops_one_step_later_with_the_same_finite_weights():
    host, _, host_stop = train({3, 4, 5, 6, 7}, on_device=False, read_every=1)
    device, _, device_stop = train({3, 4, 5, 6, 7}, on_device=True, read_every=100)
    assert host_stop == 5 and device_stop == 6  # the third non-finite step in a row, read a step late on the device
    # neither applied anything after step 2: the weights each run would save are those after step 2
    for states in (host, device):
        assert all(torch.equal(x, y) for x, y in zip(states[1]["weights"], states[-1]["weights"]))
        assert all(torch.isfinite(p).all() for p in states[-1]["weights"])


@pytest.mark.parametrize("nan_steps", [{1}, {4, 5}], ids=["first", "two_in_a_row"])
def test_muon_skips_on_the_device_as_a_host_skip_does(nan_steps):
    """--optim muon: the weights, Muon's momentum buffers, AdamW's moments and steps and the schedule, bit for bit."""
    host, _, _ = train(nan_steps, on_device=False, read_every=1, muon=True)
    device, _, _ = train(nan_steps, on_device=True, read_every=3, muon=True)
    assert len(host) == len(device) == 10
    for step, (a, b) in enumerate(zip(host, device), start=1):
        assert_same(a, b, step, schedule_known=step not in {s for s in nan_steps if s % 3})
