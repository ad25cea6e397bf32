"""Optimizers (bitsandbytes 8-bit, Adafactor) and gradient checkpointing on a tiny Llama, in-process."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.inputs.modeling import enable_gradient_checkpointing
from common.optim import create_optimizer, param_groups


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    # hidden 64 x intermediate 256: the MLP matrices hold 16k values, above bitsandbytes' 4096 8-bit threshold
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4))


def optim_args(name: str, lr: float) -> argparse.Namespace:
    return argparse.Namespace(optim=name, learning_rate=lr, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999,
                              adam_epsilon=1e-8)


def batch(seed: int = 0) -> dict:
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("name", ["adamw_8bit", "paged_adamw_8bit", "adafactor", "adamw_torch", "adamw_torch_fused"])
def test_optimizer_trains(name):
    model = tiny_llama()
    optimizer = create_optimizer(optim_args(name, 3e-3), model)
    data = batch()  # one fixed batch: the loss must fall as the model memorises it
    losses = []
    for _ in range(15):
        loss = model(**data).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_8bit_adamw_keeps_32bit_state_for_embeddings():
    model = tiny_llama()
    optimizer = create_optimizer(optim_args("adamw_8bit", 1e-3), model)
    model(**batch()).loss.backward()
    optimizer.step()
    embedding = optimizer.state[model.model.embed_tokens.weight]
    matrix = optimizer.state[model.model.layers[0].mlp.up_proj.weight]
    assert embedding["state1"].dtype == torch.float32 and embedding["state2"].dtype == torch.float32
    assert matrix["state1"].dtype == torch.uint8 and matrix["state2"].dtype == torch.uint8


def test_no_weight_decay_on_biases_and_norms():
    model = tiny_llama()
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all("norm" in names[id(p)] for p in no_decay["params"])
    assert not any("norm" in names[id(p)] for p in decay["params"])
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


def test_gradient_checkpointing_gives_the_same_gradients():
    grads, q_proj_calls = [], []
    for checkpointing in (False, True):
        model = tiny_llama()
        model.train()
        if checkpointing:
            enable_gradient_checkpointing(model)
        calls = []
        model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *_: calls.append(1))
        model(**batch()).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        q_proj_calls.append(len(calls))
    assert q_proj_calls == [1, 2]  # with checkpointing the layer really is recomputed during backward
    assert max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0]) < 1e-6
