"""The exact token-normalised loss (common/accumulation.py): accumulation equals one big batch, token for token."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import GradientAccumulationPlugin
from transformers import LlamaConfig, LlamaForCausalLM

from common.accumulation import accumulation_windows, backward_loss, count_label_tokens

TOL = 1e-6  # fp32: the same sums in a different order


def padded_batches(num_rows: int, seed: int) -> list[dict]:
    """Rows of very different lengths (3..40 real tokens), right-padded to 40, pads masked from the labels."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 41, (num_rows,), generator=g)
    input_ids = torch.randint(1, 64, (num_rows, 40), generator=g)
    mask = torch.arange(40)[None, :] < lengths[:, None]
    labels = input_ids.masked_fill(~mask, -100)
    return [{"input_ids": input_ids[i:i + 1], "attention_mask": mask[i:i + 1].long(), "labels": labels[i:i + 1]}
            for i in range(num_rows)]


def merge(rows: list[dict]) -> dict:
    return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}


def train(rows: list[dict], batch_size: int, accumulation: int, exact: bool) -> tuple[dict, list[float]]:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=accumulation, sync_with_dataloader=False))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    batches = [merge(rows[i:i + batch_size]) for i in range(0, len(rows), batch_size)]
    losses = []
    for window in accumulation_windows(batches, accumulation):
        num_items = count_label_tokens(window, accelerator)
        step_loss = 0.0
        for batch in window:
            with accelerator.accumulate(model):
                if exact:
                    outputs = model(**batch, num_items_in_batch=num_items)
                    loss, token_loss = backward_loss(outputs, accelerator)
                else:  # the common mistake: mean per micro-batch, then accelerate divides by the steps
                    loss = token_loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            step_loss += token_loss.item() / (1 if exact else accumulation)
        losses.append(step_loss)
    return {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}, losses


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_windows_hold_exactly_the_accumulation_steps():
    windows = list(accumulation_windows(range(10), 4))
    assert windows == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the partial tail [8, 9] is dropped, never half-stepped


def test_label_count_skips_the_first_label_of_each_row():
    rows = padded_batches(4, seed=1)
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    expected = sum(int(r["attention_mask"].sum()) - 1 for r in rows)
    assert count_label_tokens(rows, accelerator).item() == expected


@pytest.mark.parametrize("batch_size,accumulation", [(2, 4), (1, 8)])
def test_accumulated_variable_length_batches_equal_one_big_batch(batch_size, accumulation):
    rows = padded_batches(16, seed=0)  # two optimizer steps of 8 rows
    big_weights, big_losses = train(rows, 8, 1, exact=True)
    weights, losses = train(rows, batch_size, accumulation, exact=True)
    assert losses == pytest.approx(big_losses, abs=TOL)
    assert max_diff(weights, big_weights) < TOL


def test_naive_division_by_accumulation_steps_differs():
    """The same comparison detects the 2024 bug: the naive loss gives other losses and other weights."""
    rows = padded_batches(16, seed=0)
    big_weights, big_losses = train(rows, 8, 1, exact=True)
    naive_weights, naive_losses = train(rows, 2, 4, exact=False)
    assert abs(naive_losses[0] - big_losses[0]) > 100 * TOL
    assert max_diff(naive_weights, big_weights) > 100 * TOL


class MeanLossLlama(LlamaForCausalLM):
    """A model adapted the usual way: its forward drops `num_items_in_batch`, so its loss is a per-batch mean."""

    def forward(self, *args, num_items_in_batch=None, **kwargs):
        return super().forward(*args, **kwargs)


@pytest.mark.parametrize("model_class, accumulation, stops", [
    (MeanLossLlama, 4, True),  # the loss would be scaled x4: gradients 4 times too large
    (MeanLossLlama, 1, False),  # scale 1 on one process: a per-batch mean is then exact
    (LlamaForCausalLM, 4, False),
])
def test_a_model_that_ignores_num_items_in_batch_is_stopped_with_one_line(model_class, accumulation, stops, capsys):
    from common.accumulation import check_loss_honours_num_items

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model = accelerator.prepare(model_class(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                        num_hidden_layers=1, num_attention_heads=4)))
    if not stops:
        check_loss_honours_num_items(model, accelerator)
        assert model.training  # the probe leaves the model as it found it
        return
    with pytest.raises(SystemExit) as exit_info:
        check_loss_honours_num_items(model, accelerator)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    print(err)
    assert len(err.splitlines()) == 1
    assert err.startswith("error: MeanLossLlama's loss ignores num_items_in_batch (doubling it changed the loss by "
                          "x1, not x0.5), so its gradients would come out 4 times too large")


def test_the_loss_leaves_no_logits_alive_through_the_backward():
    """A mixed-precision forward's outputs hold accelerate's fp32 copy of the logits; the loop keeps `outputs` through
    `accelerator.backward`, so `backward_loss` drops them: nothing references that tensor once it returns."""
    import weakref

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = accelerator.prepare(LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                             num_hidden_layers=1, num_attention_heads=4)))
    batch = padded_batches(2, seed=0)[0]
    outputs = model(**batch, num_items_in_batch=count_label_tokens([batch], accelerator))
    assert outputs.logits.dtype == torch.float32  # accelerate's upcast copy
    logits = weakref.ref(outputs.logits)
    loss, _ = backward_loss(outputs, accelerator)
    assert logits() is None and outputs.logits is None and outputs["logits"] is None
    accelerator.backward(loss)  # the backward still runs
    AcceleratorState._reset_state(True)  # leave no bf16 state to the tests that follow in this process
    GradientState._reset_state()
