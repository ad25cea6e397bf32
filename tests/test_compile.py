"""`--torch_compile` compiles each decoder layer once (regional compilation, in place) and then no more: every recipe
compiles a bounded number of graphs whatever its data, with no graph break, and trains as the eager model does.

Counts come from the run's all_results.json (`compiled_graphs`, `graph_breaks`: dynamo's own counters). The
numerical checks use inductor, the default backend; the counting checks use `aot_eager`, which traces forward and
backward as inductor does (the same graphs, guards and recompilations) without building kernels (minutes on 2 cores).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import copy_checkpoints, launcher, read_metrics, run_script
from test_distributed import assert_same_training, init_model, reference, train_args  # noqa: F401  (fixtures)
from test_finetune_causal_lm import finetune, max_difference, sft, weights  # noqa: F401  (fixtures)
from test_finetune_classifier import classify, tiny  # noqa: F401  (fixture)
from test_finetune_dpo import dpo, train_dpo  # noqa: F401  (fixture)

from common.features.compile import compile_model

TRACE_ONLY = ("--torch_compile", "--torch_compile_backend", "aot_eager")
# Graphs a compiled decoder layer may need, whatever the lengths: in training one static, one with the changing
# dimension as a symbol, one for a one-row batch (torch specialises sizes of 1); in evaluation (no gradients: another
# graph) one static and one symbolic (its ragged last batch is topped up to the full batch: no graph of its own).
GRAPH_BOUND = 5


def compile_results(out, fallbacks: bool = False) -> dict:
    with open(f"{out}/all_results.json") as f:
        results = json.load(f)
    return {key: results.get(key) for key in ("compiled_graphs", "graph_breaks") + ("compile_fallbacks",) * fallbacks}


def test_regional_compilation_trains_as_eager_and_compiles_two_graphs(corpus, init_model, reference, tmp_path):  # noqa: F811
    """Inductor, one process: the eager run's losses, gradient norms and weights (tests/test_distributed.py's
    tolerances); one graph for training and one for evaluation, though the validation split's 65 blocks end in a
    batch of one row at every evaluation; the export and the checkpoint keep the model's own keys."""
    out = tmp_path / "compiled"
    run_script("pretrain_llama.py", *train_args(corpus, init_model, out, 4, "--torch_compile", "--eval_steps", "2",
                                                "--checkpointing_steps", "4", "--sample_max_new_tokens", "8"))
    print(f"regional, inductor: {assert_same_training(out, reference)}")
    assert compile_results(out) == {"compiled_graphs": 2, "graph_breaks": 0}
    evals = [row for row in read_metrics(str(out)) if "eval_loss" in row]
    assert [row["step"] for row in evals] == [2, 4]
    from safetensors.torch import load_file

    assert not [key for key in load_file(out / "model.safetensors") if "_orig_mod" in key]
    assert not [key for key in load_file(out / "checkpoints" / "step_4" / "model.safetensors") if "_orig_mod" in key]


def test_two_compiled_processes_train_as_one_eager(corpus, init_model, reference, tmp_path):  # noqa: F811
    """DDP over 2 processes, each compiling its layers (inductor), with the chunked loss (eager, outside the layers):
    the one-process eager run's training; a graph for training and one for the final evaluation."""
    out = tmp_path / "ddp"
    run_script("pretrain_llama.py", *train_args(corpus, init_model, out, 2, "--torch_compile",
                                                "--chunked_cross_entropy"), launcher=launcher("cpu_2proc.yaml"))
    print(f"regional, inductor, 2 processes: {assert_same_training(out, reference)}")
    assert compile_results(out) == {"compiled_graphs": 2, "graph_breaks": 0}


def test_sft_on_many_lengths_compiles_a_bounded_number_of_graphs(sft, tmp_path):  # noqa: F811
    """A whole epoch of prompt/completion rows padded to many lengths, batches of 3 (the last of one row), evaluated
    every 5 steps: at most GRAPH_BOUND graphs, no graph break (with static shapes each new length compiled again and
    torch's recompile limit of 8 was passed), and the eager run's weights."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sft["model"])
    with open(sft["train"]) as f:
        lengths = {-(-len(tokenizer(row["prompt"] + row["completion"])["input_ids"]) // 8) * 8
                   for row in map(json.loads, f)}
    assert len(lengths) > 8, "the data must have more lengths than torch's recompile limit"
    epoch = ("--max_steps", "-1", "--num_train_epochs", "1", "--per_device_train_batch_size", "3", "--eval_steps", "5",
             "--per_device_eval_batch_size", "5")
    compiled = finetune(sft, str(tmp_path / "compiled"), *epoch, *TRACE_ONLY, "--checkpointing_steps", "10")
    eager = finetune(sft, str(tmp_path / "eager"), *epoch)
    counts = compile_results(compiled)
    print(f"SFT over {len(lengths)} padded lengths: {counts}")
    assert counts["compiled_graphs"] <= GRAPH_BOUND and counts["graph_breaks"] == 0
    assert max_difference(weights(compiled), weights(eager)) <= 1e-5
    # the compiled run's checkpoint holds the model's own names: an eager run resumes it and ends where both ended
    copy_checkpoints(compiled, tmp_path / "resumed", 10)
    resumed = finetune(sft, str(tmp_path / "resumed"), *epoch, "--resume_from_checkpoint", "latest")
    assert max_difference(weights(resumed), weights(eager)) <= 1e-5


def test_classifier_compiles_a_bounded_number_of_graphs(tiny, tmp_path):  # noqa: F811
    out = str(tmp_path / "compiled")
    classify(tiny, out, "--max_steps", "8", "--per_device_train_batch_size", "8", "--max_seq_length", "128",
             "--eval_steps", "4", "--per_device_eval_batch_size", "5", *TRACE_ONLY)
    counts = compile_results(out)
    print(f"classifier: {counts}")
    assert counts["compiled_graphs"] <= GRAPH_BOUND and counts["graph_breaks"] == 0


def test_each_repeated_block_is_compiled_in_place_and_nothing_else():
    """Every decoder layer, nothing else (or the whole model, flagged); the state dict keeps its keys; a model without
    repeated blocks is refused in one line naming the flag that serves it."""
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=4, vocab_size=100))
    bert = BertModel(BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                vocab_size=100))
    for model, blocks in ((llama, llama.model.layers), (bert, bert.encoder.layer)):
        keys = list(model.state_dict())
        compile_model(model, False, "aot_eager", None)
        compiled = [m for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None]
        assert compiled == list(blocks)
        assert list(model.state_dict()) == keys
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(SystemExit) as stop:
        compile_model(plain, False, "aot_eager", None)
    assert stop.value.code == 2
    compile_model(plain, True, "aot_eager", None)
    assert plain._compiled_call_impl is not None and list(plain.state_dict()) == ["0.weight", "0.bias"]


def test_compile_flags_without_torch_compile_are_one_line(capsys, tmp_path):
    from test_bad_inputs import load_script

    with pytest.raises(SystemExit) as stop:
        load_script("pretrain_llama").parse_args(["--torch_compile_mode", "max-autotune", "--output_dir",
                                                  str(tmp_path / "out")])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --torch_compile_whole_model and --torch_compile_mode need --torch_compile"]


def test_zero3_is_refused_in_one_line(monkeypatch, capsys):
    """DeepSpeed's ZeRO-3 hooks cut each compiled layer into pieces (55 graph breaks, the recompile limit passed)."""
    import argparse
    import os

    from common.features.compile import check_compile_flags
    from conftest import ROOT

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", raising=False)
    args = argparse.Namespace(torch_compile=True, torch_compile_whole_model=False, torch_compile_mode=None)
    for config, refused in (("zero2.json", False), ("zero3.json", True), ("zero3_offload.json", True)):
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", os.path.join(ROOT, "ds_configs", config))
        if not refused:
            check_compile_flags(args)
            continue
        with pytest.raises(SystemExit):
            check_compile_flags(args)
        assert capsys.readouterr().err.startswith("error: --torch_compile under DeepSpeed ZeRO-3:")


# LoRA: a frozen embedding (the first layer's input needs no gradient, the others' do), a reference pass through the
# disabled adapter (DPO), evaluation without gradients. Before: SFT 7 graphs, DPO 8 and torch's recompile limit
# (the layers then ran eagerly, silently). Padded recipes compile symbolic shapes from the first graph.
LORA_GRAPH_BOUND = 4


def adapter(out: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{out}/adapter_model.safetensors")


def test_sft_lora_compiles_once_per_state(sft, tmp_path):  # noqa: F811
    """A whole epoch of LoRA SFT on uneven lengths with evaluations: at most LORA_GRAPH_BOUND graphs, no fallback to
    eager, and the eager LoRA run's weights."""
    epoch = ("--max_steps", "-1", "--num_train_epochs", "1", "--per_device_train_batch_size", "3", "--eval_steps", "5",
             "--per_device_eval_batch_size", "5", "--use_peft")
    compiled = finetune(sft, str(tmp_path / "compiled"), *epoch, *TRACE_ONLY)
    eager = finetune(sft, str(tmp_path / "eager"), *epoch)
    counts = compile_results(compiled, fallbacks=True)
    print(f"SFT LoRA, one epoch with evaluations: {counts}")
    assert counts["compiled_graphs"] <= LORA_GRAPH_BOUND and counts["graph_breaks"] == counts["compile_fallbacks"] == 0
    assert max_difference(adapter(compiled), adapter(eager)) <= 1e-5


def test_dpo_lora_compiles_once_per_state(dpo, tmp_path):  # noqa: F811
    """LoRA DPO with checkpointing (the reference: the disabled adapter, without gradients; checkpointing adds
    transformers' and peft's own input hook) over an epoch with evaluations: at most LORA_GRAPH_BOUND graphs, no
    fallback, and the eager run's adapter."""
    epoch = ("--max_steps", "-1", "--num_train_epochs", "1", "--per_device_train_batch_size", "2", "--eval_steps", "4",
             "--per_device_eval_batch_size", "3", "--use_peft", "--gradient_checkpointing")
    compiled = train_dpo(dpo, str(tmp_path / "compiled"), *epoch, *TRACE_ONLY)
    counts = compile_results(compiled, fallbacks=True)
    print(f"DPO LoRA + checkpointing, one epoch with evaluations: {counts}")
    assert counts["compiled_graphs"] <= LORA_GRAPH_BOUND and counts["graph_breaks"] == counts["compile_fallbacks"] == 0
    eager = train_dpo(dpo, str(tmp_path / "eager"), *epoch)
    assert max_difference(adapter(compiled), adapter(eager)) <= 1e-5


def test_a_fallback_to_eager_is_said_and_counted(monkeypatch, caplog):
    """torch says it once in its own log; the run's log says it as a warning and all_results.json counts it."""
    import logging

    from accelerate import PartialState

    from common.features.compile import compile_counts

    PartialState(cpu=True)  # the run's logger needs accelerate's state, as in a recipe

    class Block(torch.nn.Module):  # not torch's own: dynamo does not trace into torch.nn's modules
        def forward(self, x):
            return x * 2

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block(), Block()])

        def forward(self, x):
            return self.layers[1](self.layers[0](x))

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    torch._dynamo.reset()
    model = Model()
    compile_model(model, False, "eager", None)
    before = compile_counts()["compile_fallbacks"]
    with caplog.at_level(logging.WARNING):
        for rows in (2, 3, 5):  # a static shape, then a symbolic one: past a limit of 1
            model(torch.ones(rows, 4))
    assert compile_counts()["compile_fallbacks"] > before
    assert any("runs EAGERLY" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    torch._dynamo.reset()
