"""Selective activation checkpointing and activation offloading (common/features/activation_memory.py) change where
activations live, never the result: gradients equal to no checkpointing, training under DDP, ZeRO-3 and FSDP2 equal to
one process, and a resume may change the mode and still continue exactly."""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import copy_checkpoints, launcher, run_script
from test_distributed import assert_same_training, init_model, train_args  # noqa: F401  (fixture)
from test_fsdp import fsdp_launcher

from common.features.activation_memory import check_activation_memory, reduce_activation_memory

MODES = {  # flag values -> (--selective_ac_option, --activation_offloading, --gradient_checkpointing)
    "full": (None, False, True),
    "every 2nd layer": ("2", False, False),
    "op": ("op", False, False),
    "offloading": (None, True, False),
    "op + offloading": ("op", True, False),
    "full + offloading": (None, True, True),
}
GRAD_TOL = 1e-6


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config)


def gradients(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_gives_the_gradients_of_no_checkpointing(mode):
    option, offloading, full = MODES[mode]
    ids = torch.randint(0, 128, (2, 96), generator=torch.Generator().manual_seed(1))
    reference = gradients(tiny_llama(), ids)
    model = tiny_llama()
    if full:
        model.activation_checkpointing_enable({"use_reentrant": False})
    reduce_activation_memory(model, option, offloading)
    from transformers.modeling_layers import GradientCheckpointingLayer

    checkpointed = sum(m.gradient_checkpointing for m in model.modules() if isinstance(m, GradientCheckpointingLayer))
    assert checkpointed == (2 if option == "2" else 4 if option or full else 0)
    got = gradients(model, ids)
    worst = max(((got[k] - reference[k]).abs().max() / reference[k].abs().max().clamp(min=1e-12)).item()
                for k in reference)
    assert worst <= GRAD_TOL, f"{mode}: gradients differ by {worst:.2e} (relative)"


@pytest.mark.parametrize("option, compile_, line", [
    ("0", False, "--selective_ac_option 0: give `op` or a number of layers k, 1 <= k <= 4"),
    ("5", False, "--selective_ac_option 5: give `op` or a number of layers k, 1 <= k <= 4"),
    ("every", False, "--selective_ac_option every: give `op` or a number of layers k, 1 <= k <= 4"),
    (None, True, "--activation_offloading does not compose with --torch_compile"),
])
def test_a_value_the_model_cannot_serve_is_one_line(option, compile_, line, capsys):
    args = argparse.Namespace(selective_ac_option=option, activation_offloading=compile_, torch_compile=compile_)
    with pytest.raises(SystemExit) as exit_info:
        check_activation_memory(args, tiny_llama().config)
    assert exit_info.value.code == 2 and capsys.readouterr().err.strip().startswith(f"error: {line}")


@pytest.fixture(scope="module")
def reference(corpus, init_model, tmp_path_factory):  # noqa: F811
    """One process, no checkpointing, 4 sequences x 2 accumulation steps (tests/test_distributed.py's reference)."""
    out = tmp_path_factory.mktemp("activations") / "reference"
    run_script("pretrain_llama.py", *train_args(corpus, init_model, out, 4), launcher=launcher("cpu_1proc.yaml", 1))
    return out


ENGINES = {  # engine -> (launcher, per-device batch, a mode to run under it)
    "DDP": (lambda: launcher("cpu_2proc.yaml"), 2, ["--selective_ac_option", "op", "--activation_offloading"]),
    "ZeRO-3": (lambda: launcher("deepspeed_zero3.yaml"), 2, ["--selective_ac_option", "2"]),
    "FSDP2": (lambda: fsdp_launcher(2), 2, ["--selective_ac_option", "op"]),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_two_processes_with_a_mode_equal_the_one_process_run(engine, corpus, init_model, reference,  # noqa: F811
                                                             tmp_path):
    make_launcher, per_device_batch, mode = ENGINES[engine]
    out = tmp_path / "run"
    run_script("pretrain_llama.py", *train_args(corpus, init_model, out, per_device_batch, *mode),
               launcher=make_launcher())
    print(f"{engine} with {' '.join(mode)}: {assert_same_training(out, reference)}")


def test_a_resume_may_change_the_mode_and_continues_exactly(corpus, init_model, reference, tmp_path):  # noqa: F811
    """Checkpointed at step 2 with per-op checkpointing, resumed with every 2nd layer and offloading: the
    uninterrupted plain run's losses and weights."""
    first = tmp_path / "first"
    run_script("pretrain_llama.py", *train_args(corpus, init_model, first, 4, "--checkpointing_steps", "2",
                                                "--selective_ac_option", "op"), launcher=launcher("cpu_1proc.yaml", 1))
    resumed = tmp_path / "resumed"
    copy_checkpoints(first, resumed, 2)
    run_script("pretrain_llama.py", *train_args(corpus, init_model, resumed, 4, "--selective_ac_option", "2",
                                                "--activation_offloading", "--resume_from_checkpoint", "latest"),
               launcher=launcher("cpu_1proc.yaml", 1))
    print(f"op to step 2, every 2nd layer + offloading from there: "
          f"{assert_same_training(resumed, reference, steps=(3, 4))}")
