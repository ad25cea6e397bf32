"""LoRA and QLoRA (--use_peft, --load_in_4bit) on one process: what trains, what is saved, resumed and merged.

A tiny Llama (hidden 64, 2 layers, its own 300-token BPE) fine-tuned on prompt/completion rows, fp32, lr 1e-3. The
runs that check the frozen base go through a probe that runs the recipe unchanged and, at its export, dumps the
trained model's whole state dict (4-bit bytes and quantization scales included). Properties:
- only adapter tensors change: every base tensor (4-bit bytes included) equals a fresh load, every B matrix moved
  off its zero start; with evaluations between steps, so bitsandbytes' CPU repacking on a no-grad forward is covered;
- at step 0 the wrapped model's logits equal the base's, exactly (LoRA and QLoRA);
- --gradient_checkpointing gives the same adapter gradients (the layers really run twice);
- the exported adapter (peft's format) reloads with PeftModel.from_pretrained to the trained tensors, bit for bit;
- the merged export (output_dir/merged, AutoModelForCausalLM alone) gives base + adapter's logits to MERGE_TOL;
- a checkpoint holds the adapter and its optimizer state, not the base: its size against a full fine-tuning one;
- a run SIGKILLed after its first checkpoint and rerun with --resume_from_checkpoint auto ends at the uninterrupted
  run's adapter, bit for bit, with the default --lora_dropout (the resumed run draws the same dropout masks);
- QLoRA trains on CPU (the loss falls); the classifier trains its head with the adapter, also on a 4-bit base;
- bad input is one line and exit status 2 before any work.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, SCRIPTS, run_script, train_losses
from safetensors.torch import load_file
from test_finetune_causal_lm import load_script
from test_finetune_classifier import classify, tiny  # noqa: F401 (tiny is a fixture)

MERGE_TOL = 1e-5  # fp32 logits, merged vs base + adapter (measured ~2e-7)
LORA = ("--use_peft", "--lora_r", "4", "--lora_alpha", "8")  # the default --lora_dropout, 0.05
# QLoRA's chunked run must match the unchunked one to 1e-5. With dropout on (the same masks in both runs) one adapter
# entry, whose first gradient is below AdamW's eps, took a first update 2e-5 apart from float rounding alone.
QLORA_NO_DROPOUT = ("--lora_dropout", "0")
TRAINING = ("--max_steps", "6", "--learning_rate", "1e-3", "--logging_steps", "1", "--seed", "0",
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--mixed_precision", "no",
            "--checkpointing_steps", "2", "--eval_steps", "2")
PROBE = """
import importlib.util, sys, torch
script, dump = sys.argv[1], sys.argv[2]
sys.argv = [script] + sys.argv[3:]
spec = importlib.util.spec_from_file_location("recipe", script)
recipe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe)
exporter = recipe.exporter

def dumping_exporter(args):
    export = exporter(args)

    def export_and_dump(accelerator, model, tokenizer, output_dir):
        state = accelerator.unwrap_model(model).state_dict()
        torch.save({k: v.detach().cpu().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}, dump)
        return export(accelerator, model, tokenizer, output_dir)
    return export_and_dump

recipe.exporter = dumping_exporter
recipe.main()
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    """A tiny Llama with its own tokenizer, prompt/completion rows of uneven lengths, and the probe script."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.inputs.data import train_bpe_tokenizer

    d = tmp_path_factory.mktemp("lora")
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    rows = [{"prompt": "Q: " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 40))) + "\nA:",
             "completion": " " + " ".join(rng.choice(words) for _ in range(rng.choice([1, 3, 20, 40])))}
            for _ in range(80)]
    paths = {"dir": str(d), "model": str(d / "base"), "probe": str(d / "probe.py")}
    for split, part in (("train", rows[:64]), ("validation", rows[64:])):
        paths[split] = str(d / f"{split}.jsonl")
        with open(paths[split], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    tokenizer = train_bpe_tokenizer([r["prompt"] + r["completion"] for r in rows], 300)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    with open(paths["probe"], "w") as f:
        f.write(PROBE)
    return paths


def data_args(data: dict, out) -> list[str]:
    return ["--model_name_or_path", data["model"], "--train_file", data["train"], "--validation_file",
            data["validation"], "--output_dir", str(out)]


def probed_run(data: dict, name: str, *extra: str) -> dict:
    """The recipe run through the probe: its output folder and the trained model's whole state dict."""
    out, dump = os.path.join(data["dir"], name), os.path.join(data["dir"], f"{name}.pt")
    run_script(data["probe"], os.path.join(SCRIPTS, "finetune_causal_lm.py"), dump, *data_args(data, out), *extra)
    return {"out": out, "state": torch.load(dump)}


@pytest.fixture(scope="module")
def lora_run(data) -> dict:
    return probed_run(data, "lora", *LORA, *TRAINING, "--merge_adapter")


@pytest.fixture(scope="module")
def qlora_run(data) -> dict:
    return probed_run(data, "qlora", *LORA, *QLORA_NO_DROPOUT, *TRAINING, "--load_in_4bit", "--use_bnb_nested_quant",
                      "--merge_adapter")


def base_state(data: dict, quantized: bool) -> dict[str, torch.Tensor]:
    """The base model's state dict as a fresh run loads it (4-bit: quantized again, deterministically)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs = dict(quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32), device_map={"": "cpu"}) if quantized else {}
    model = AutoModelForCausalLM.from_pretrained(data["model"], dtype=torch.float32, **kwargs)
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def base_key(peft_key: str) -> str:
    """`base_model.model.model.layers.0.mlp.up_proj.base_layer.weight` -> `model.layers.0.mlp.up_proj.weight`"""
    return peft_key.removeprefix("base_model.model.").replace(".base_layer.", ".")


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_only_the_adapter_changes(kind, lora_run, qlora_run, data):
    """Every base tensor is bit-identical to a fresh load (for QLoRA: packed 4-bit bytes, quantized scales, their
    scales and the code book), every adapter B matrix moved off zero, and nothing else was added."""
    trained = (lora_run if kind == "lora" else qlora_run)["state"]
    base = base_state(data, quantized=kind == "qlora")
    adapter = {k: v for k, v in trained.items() if ".lora_" in k}
    frozen = {base_key(k): v for k, v in trained.items() if ".lora_" not in k}
    assert frozen.keys() == base.keys()
    assert all(torch.equal(frozen[k], base[k]) for k in base), [k for k in base if not torch.equal(frozen[k], base[k])]
    b_matrices = [v for k, v in adapter.items() if ".lora_B." in k]
    assert len(b_matrices) == 2 * 7 and all(v.abs().max() > 0 for v in b_matrices)  # 7 linear layers x 2 blocks
    if kind == "qlora":
        assert any(v.dtype == torch.uint8 for v in base.values())  # the packed 4-bit bytes were compared
    print(f"{kind}: {len(base)} base tensors unchanged, {len(adapter)} adapter tensors trained")


@pytest.mark.parametrize("quantized", [False, True])
def test_the_wrapped_model_starts_as_the_base(quantized, data, tmp_path):
    """Right after wrapping (B = 0) the model's logits are the base's, exactly; the recipe's own building code."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from transformers import AutoModelForCausalLM

    from common.features.lora import add_adapter, base_model_kwargs

    args = load_script("finetune_causal_lm").parse_args(
        ["--model_name_or_path", data["model"], "--output_dir", str(tmp_path), *LORA,
         *(["--load_in_4bit"] if quantized else [])])
    accelerator = Accelerator(cpu=True)
    model = AutoModelForCausalLM.from_pretrained(data["model"], **base_model_kwargs(args, accelerator, "CAUSAL_LM"))
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        wrapped = add_adapter(args, accelerator, model, "CAUSAL_LM")
        after = wrapped(input_ids=ids).logits
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    assert sum(p.numel() for p in wrapped.parameters() if p.requires_grad) > 0
    assert torch.equal(before, after)


def test_the_adapter_names_a_local_base_by_its_absolute_path(data, tmp_path, monkeypatch):
    """A base given as a relative --model_name_or_path ("outputs/pretrain") was stored so in the adapter's
    adapter_config.json (`base_model_name_or_path`): AutoPeftModelForCausalLM then failed from any other directory.
    A local base is named by its absolute path, a hub id as given; the adapter loads from elsewhere. The model card
    beside it (README.md) names the same base."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    from common.features.lora import add_adapter, base_model_name

    monkeypatch.chdir(data["dir"])
    args = load_script("finetune_causal_lm").parse_args(
        ["--model_name_or_path", "base", "--output_dir", str(tmp_path), *LORA])
    wrapped = add_adapter(args, Accelerator(cpu=True), AutoModelForCausalLM.from_pretrained("base"), "CAUSAL_LM")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    wrapped.save_pretrained(tmp_path / "adapter")
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        stored = json.load(f)["base_model_name_or_path"]
    assert os.path.isabs(stored) and os.path.samefile(stored, data["model"]), stored
    card = (tmp_path / "adapter" / "README.md").read_text()  # peft's model card: the same base (it kept "base")
    assert f"\nbase_model: {stored}\n" in card and f"- base_model:adapter:{stored}\n" in card, card[:300]
    monkeypatch.chdir(tmp_path)
    reloaded = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"))
    assert reloaded.config.vocab_size == wrapped.config.vocab_size
    assert base_model_name("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"  # a hub id: no such folder here


def adapter_after_steps(keep_16bit: bool, dropout: float, steps: int = 3) -> dict:
    """A bf16 tiny Llama with a LoRA adapter (B drawn non-zero, so A has gradients from the first step) trained
    `steps` AdamW steps under bf16 autocast, peft's fp32 copy of each adapter input kept or not (`keep_16bit`): its
    adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from common.features.lora import keep_adapter_inputs_16bit

    config = LlamaConfig(hidden_size=32, intermediate_size=112, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=1, vocab_size=64)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16),
                           LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    if keep_16bit:
        keep_adapter_inputs_16bit(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    for _ in range(steps):
        with torch.autocast("cpu", torch.bfloat16):
            model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_adapter_inputs_stay_16bit_and_train_the_same_adapter():
    """Under autocast the adapter's matmul runs in bf16 either way, so peft's fp32 copy of its input changes only
    memory: without dropout, and with a dropout whose scale 1/(1-p) is exact in bf16 (p 0.2: 1.25), the adapters
    after 3 AdamW steps are bit-identical (the same mask draws, the same products). Other rates differ on a CPU by
    one rounding: torch's CPU dropout of a bf16 tensor scales by 1/(1-p) rounded to bf16 (p 0.05: 1.0547, not
    1.0526; CUDA's kernel scales in fp32, as the fp32 path does); measured, the loss after 4 steps 5e-7 apart."""
    for dropout in (0.0, 0.2):
        kept, cast = (adapter_after_steps(keep, dropout) for keep in (True, False))
        assert all(torch.equal(kept[k], cast[k]) for k in cast), dropout


@pytest.mark.parametrize("quantized", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(quantized, data, tmp_path):
    """The same adapter (B set non-zero, so A gets gradients too) with and without --gradient_checkpointing: the
    same gradients; with checkpointing each layer's attention runs twice per step (the recomputation happened)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from transformers import AutoModelForCausalLM

    from common.features.lora import add_adapter, base_model_kwargs
    from common.inputs.modeling import enable_gradient_checkpointing

    ft = load_script("finetune_causal_lm")
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    results = {}
    for checkpointing in (False, True):
        args = ft.parse_args(["--model_name_or_path", data["model"], "--output_dir", str(tmp_path), *LORA,
                              *(["--load_in_4bit"] if quantized else [])])
        accelerator = Accelerator(cpu=True)
        model = AutoModelForCausalLM.from_pretrained(data["model"],
                                                     **base_model_kwargs(args, accelerator, "CAUSAL_LM"))
        if checkpointing:
            enable_gradient_checkpointing(model)
        torch.manual_seed(0)
        model = add_adapter(args, accelerator, model, "CAUSAL_LM")
        for i, (name, p) in enumerate(model.named_parameters()):
            if ".lora_B." in name:
                p.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(i))
        calls = []
        for layer in model.base_model.model.model.layers:  # the recomputation runs inside the layer's call
            layer.self_attn.q_proj.register_forward_hook(lambda *_: calls.append(1))
        model.train()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        results[checkpointing] = ({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad},
                                  len(calls))
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    (plain, plain_calls), (checkpointed, checkpointed_calls) = results[False], results[True]
    assert plain.keys() == checkpointed.keys() and len(plain) == 2 * 2 * 7
    assert all(g.abs().max() > 0 for g in plain.values())
    difference = max((plain[k] - checkpointed[k]).abs().max().item() for k in plain)
    print(f"quantized={quantized}: gradients differ by {difference:.1e} with checkpointing; layer runs "
          f"{plain_calls} -> {checkpointed_calls}")
    assert difference == 0.0
    assert (plain_calls, checkpointed_calls) == (2, 4)


def test_the_adapter_export_reloads_exactly(lora_run, data):
    """output_dir holds peft's adapter (config, safetensors) and the tokenizer; PeftModel.from_pretrained gets the
    trained tensors back bit for bit, and no tensor is empty."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, trained = lora_run["out"], lora_run["state"]
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json"):
        assert os.path.isfile(os.path.join(out, name)), name
    assert not os.path.exists(os.path.join(out, "model.safetensors"))  # no copy of the base
    saved = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert all(v.numel() > 0 for v in saved.values())
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(data["model"]), out)
    state = {k: v for k, v in reloaded.state_dict().items() if ".lora_" in k}
    assert state.keys() == {k for k in trained if ".lora_" in k} and len(state) == len(saved)
    assert all(torch.equal(state[k], trained[k]) for k in state)
    assert len(AutoTokenizer.from_pretrained(out)) == 300


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_merged_export_is_base_plus_adapter(kind, lora_run, qlora_run, data):
    """output_dir/merged loads with AutoModelForCausalLM alone, in full precision (a QLoRA adapter is merged into the
    fp32 base, never into the 4-bit one), and its logits are base + adapter's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = (lora_run if kind == "lora" else qlora_run)["out"]
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(out, "merged"))
    assert all(p.dtype == torch.float32 for p in merged.parameters())
    assert not hasattr(merged.config, "quantization_config")
    unmerged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(data["model"]), out)
    base = AutoModelForCausalLM.from_pretrained(data["model"])
    ids = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, got, plain = (m(input_ids=ids).logits for m in (unmerged, merged, base))
    difference, adapter_effect = (got - expected).abs().max().item(), (expected - plain).abs().max().item()
    print(f"{kind}: merged vs base + adapter {difference:.1e} (the adapter moves the logits by {adapter_effect:.1e})")
    assert difference < MERGE_TOL < adapter_effect


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def test_checkpoints_hold_the_adapter_not_the_base(lora_run, data):
    """A LoRA checkpoint's weights are exactly the trainable tensors; against a full fine-tuning checkpoint of the
    same model (weights and AdamW state of every parameter) it is small."""
    checkpoint = os.path.join(lora_run["out"], "checkpoints", "step_4")
    weights = load_file(os.path.join(checkpoint, "model.safetensors"))
    trainable = {k for k in lora_run["state"] if ".lora_" in k}
    assert set(weights) == trainable
    full = os.path.join(data["dir"], "full")
    run_script("finetune_causal_lm.py", *data_args(data, full), *TRAINING[:-4], "--max_steps", "2",
               "--checkpointing_steps", "2")
    lora_bytes, full_bytes = folder_bytes(checkpoint), folder_bytes(os.path.join(full, "checkpoints", "step_2"))
    adapter_params = sum(v.numel() for v in weights.values())
    base_params = sum(v.numel() for v in base_state(data, quantized=False).values())
    print(f"checkpoint: LoRA {lora_bytes:,} bytes ({adapter_params:,} adapter parameters), full fine-tuning "
          f"{full_bytes:,} bytes ({base_params:,} parameters)")
    assert os.path.getsize(os.path.join(checkpoint, "optimizer.bin")) < 3 * 4 * adapter_params + 16_000
    assert lora_bytes < 0.2 * full_bytes


def newest_checkpoint(out: str) -> int:
    root = os.path.join(out, "checkpoints")
    steps = [int(d.split("_")[1]) for d in os.listdir(root) if d.startswith("step_")
             and os.path.isfile(os.path.join(root, d, "checkpoint_complete.json"))] if os.path.isdir(root) else []
    return max(steps, default=0)


def test_killed_and_resumed_run_ends_at_the_uninterrupted_adapter(lora_run, data):
    """SIGKILL right after the first checkpoint is published (mid-epoch); the same command with
    --resume_from_checkpoint auto finishes the run: the same losses after the checkpoint and the same adapter, bit for
    bit. Dropout is on (the default 0.05): the resumed run draws the uninterrupted run's masks (when its first
    iterator drew from the restored global RNG, one adapter matrix ended 6e-2 apart, relative)."""
    out = os.path.join(data["dir"], "killed")
    command = [sys.executable, os.path.join(SCRIPTS, "finetune_causal_lm.py"), *data_args(data, out), *LORA,
               *TRAINING, "--resume_from_checkpoint", "auto"]
    with open(os.path.join(data["dir"], "killed.log"), "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 300
        while newest_checkpoint(out) == 0 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_at = newest_checkpoint(out)
    assert killed_at == 2 and not os.path.exists(os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(lora_run["out"], "adapter_config.json")) as f:
        assert json.load(f)["lora_dropout"] == 0.05  # the masks matter
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=600)
    expected, got = load_file(os.path.join(lora_run["out"], "adapter_model.safetensors")), \
        load_file(os.path.join(out, "adapter_model.safetensors"))
    assert got.keys() == expected.keys()
    difference = max(((got[k] - expected[k]).norm() / expected[k].norm()).item() for k in got)
    print(f"resumed vs uninterrupted adapter, --lora_dropout 0.05: largest relative difference {difference:.1e}")
    assert all(torch.equal(got[k], expected[k]) for k in got)
    later = {s: v for s, v in train_losses(lora_run["out"]).items() if s > killed_at}
    assert {s: v for s, v in train_losses(out).items() if s > killed_at} == later and len(later) == 4


def test_qlora_trains_on_cpu(qlora_run):
    """The 4-bit run's training and evaluation losses fall (steps 1 -> 6, evaluations at 2, 4, 6)."""
    losses = train_losses(qlora_run["out"])
    with open(os.path.join(qlora_run["out"], "metrics.jsonl")) as f:
        evals = [json.loads(line)["eval_loss"] for line in f if "eval_loss" in line]
    print(f"QLoRA losses {[round(losses[s], 4) for s in sorted(losses)]}, evaluation {[round(e, 4) for e in evals]}")
    assert losses[6] < losses[1] and len(evals) == 3 and evals[-1] < evals[0]


def test_qlora_with_chunked_cross_entropy_trains_the_same_adapter(qlora_run, data, tmp_path):
    """The 8B recipe's flags: QLoRA with --chunked_cross_entropy (the head is not quantized, its loss chunked) ends at
    the unchunked run's adapter and losses."""
    out = tmp_path / "chunked"
    run_script("finetune_causal_lm.py", *data_args(data, out), *LORA, *QLORA_NO_DROPOUT, *TRAINING, "--load_in_4bit",
               "--use_bnb_nested_quant", "--chunked_cross_entropy")
    adapter, reference = (load_file(os.path.join(d, "adapter_model.safetensors")) for d in (out, qlora_run["out"]))
    assert adapter.keys() == reference.keys()
    difference = max((adapter[k] - reference[k]).abs().max().item() for k in adapter)
    losses, reference_losses = train_losses(str(out)), train_losses(qlora_run["out"])
    print(f"QLoRA chunked vs unchunked: adapter max difference {difference:.1e}")
    assert difference <= 1e-5
    assert all(losses[s] == pytest.approx(reference_losses[s], rel=1e-5) for s in reference_losses)


def test_bad_flags_are_one_line_before_any_work(data, tmp_path, capsys, monkeypatch):
    """In-process (they stop before an Accelerator exists): the flag checks, and target modules that match nothing
    (listing the model's linear module names), for both recipes."""
    ft, classifier = load_script("finetune_causal_lm"), load_script("finetune_classifier")
    base = ["--model_name_or_path", data["model"], "--output_dir", str(tmp_path / "out")]
    cases = [
        (ft, ["--load_in_4bit"], "error: --load_in_4bit needs --use_peft: a 4-bit base cannot be trained, QLoRA "
                                 "trains a LoRA adapter on it"),
        (classifier, ["--merge_adapter"], "error: --merge_adapter needs --use_peft: without it the run trains the "
                                          "whole model, no adapter to merge"),
        (ft, ["--use_peft", "--lora_target_modules", "q_proj", "qkv_proj"],
         "error: --lora_target_modules qkv_proj: no module of LlamaForCausalLM has that name; its linear modules "
         "are: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"),
        (ft, ["--use_peft", "--freeze_layers", "1"], "error: --freeze_layers does nothing with --use_peft: the whole "
                                                    "base model is frozen, only the adapter trains"),
    ]
    for script, flags, line in cases:
        monkeypatch.setattr(sys, "argv", ["script.py", *base, *flags])
        with pytest.raises(SystemExit) as stopped:
            script.main()
        assert stopped.value.code == 2
        assert capsys.readouterr().err.strip().splitlines() == [line]


def test_resume_with_other_lora_settings_is_refused(lora_run, data):
    """The resume guard holds the LoRA settings: another rank is one line, before the data or the model is loaded."""
    out = os.path.join(data["dir"], "other_rank")
    proc = run_script("finetune_causal_lm.py", *data_args(data, out), *LORA[:2], "8", *LORA[3:], *TRAINING,
                      "--resume_from_checkpoint", os.path.join(lora_run["out"], "checkpoints", "step_4"), check=False)
    checkpoint = os.path.join(lora_run["out"], "checkpoints", "step_4")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (f"error: --resume_from_checkpoint {checkpoint}: the checkpoint "
                                                    "was trained with --lora_r 4, this run has --lora_r 8")
    assert "training examples" not in proc.stderr + proc.stdout


def test_classifier_trains_its_head_with_the_adapter_on_a_4bit_base(tiny, tmp_path):  # noqa: F811 (fixture)
    """QLoRA on a tiny BERT: the adapter holds the LoRA matrices and the new head (trained in full precision, moved
    between the checkpoints), and the merged classifier's logits are base + adapter's."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = str(tmp_path / "qlora")
    classify(tiny, out, "--max_steps", "6", "--learning_rate", "3e-3", "--per_device_train_batch_size", "8",
             "--max_seq_length", "128", "--checkpointing_steps", "3", "--save_total_limit", "3", *LORA,
             "--load_in_4bit", "--merge_adapter")
    saved = load_file(os.path.join(out, "adapter_model.safetensors"))
    head = {k for k in saved if ".classifier." in k}
    assert head == {"base_model.model.classifier.weight", "base_model.model.classifier.bias"}
    assert any(".lora_A." in k for k in saved)
    at_3 = load_file(os.path.join(out, "checkpoints", "step_3", "model.safetensors"))
    moved = at_3["base_model.model.classifier.modules_to_save.default.weight"]
    assert not torch.equal(moved, saved["base_model.model.classifier.weight"]) and moved.dtype == torch.float32
    labels = dict(num_labels=2, id2label={0: "negative", 1: "positive"}, label2id={"negative": 0, "positive": 1})
    merged = AutoModelForSequenceClassification.from_pretrained(os.path.join(out, "merged"))
    assert merged.config.id2label == labels["id2label"]
    unmerged = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(tiny["model"], **labels),
                                         out)
    batch = AutoTokenizer.from_pretrained(out)(["wonderful film", "dull and boring plot"], return_tensors="pt",
                                               padding=True)
    with torch.no_grad():
        difference = (merged(**batch).logits - unmerged(**batch).logits).abs().max().item()
    assert difference < MERGE_TOL


def test_estimator_counts_the_adapter_and_the_4bit_base(tmp_path):
    """tools/estimate_memory.py's LoRA/QLoRA accounting against real models of the tiny preset: the adapter's
    parameter count equals peft's on all linear layers, the 4-bit base's bytes what bitsandbytes stores (to 0.5 %,
    without the per-layer code books); for Llama-3.1-8B at 2 x 2,048 on 24 GB QLoRA fits with checkpointing, LoRA
    does not, and the published figures are printed next to the estimate."""
    import argparse

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

    from common.inputs.modeling import LLAMA_PRESETS
    from tools import estimate_memory

    shape = estimate_memory.model_shape(argparse.Namespace(params=None, config_name=None, model_preset="tiny",
                                                           vocab_size=512))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_PRESETS["tiny"], vocab_size=512)).save_pretrained(tmp_path)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path), LoraConfig(r=8, target_modules="all-linear"))
    assert sum(p.numel() for p in lora.parameters() if p.requires_grad) == 8 * shape.lora_per_rank
    options = {method: (base, trained) for method, _, base, trained in estimate_memory.adapter_options(shape, 8, True)}
    assert options["LoRA"] == (2 * shape.params, 16 * 8 * shape.lora_per_rank)
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map={"": "cpu"},
                                                     quantization_config=nf4)
    stored = {k: v.numel() * v.element_size() for k, v in quantized.state_dict().items() if isinstance(v, torch.Tensor)}
    code_books = sum(n for k, n in stored.items() if k.endswith("quant_map") or ".quant_state." in k)  # ~1.3 KB a layer
    estimated = options["QLoRA"][0] - estimate_memory.DEQUANTIZED_BYTES * shape.largest_linear  # without the layer
    print(f"4-bit tiny preset: stored {sum(stored.values()):,} bytes ({code_books:,} of them code books), "
          f"estimated {estimated:,.0f}")
    assert abs(sum(stored.values()) - code_books - estimated) < 0.005 * estimated
    text = estimate_memory.report(estimate_memory.parse_args(
        ["--model_preset", "8b", "--vocab_size", "128256", "--gpu_memory_gb", "24", "--micro_batch_size", "2",
         "--use_peft"]))
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
    assert rows["QLoRA"].endswith("| with `--gradient_checkpointing` |") and rows["LoRA"].endswith("| no |")
    assert "QLoRA 7.4 GiB at 2,413 tokens/s; LoRA 16.2 GiB at 3,083 tokens/s" in text


def entries_outside_run_outputs(folder: str) -> list[str]:
    """The top-level files and folders of a run's output folder that `--overwrite_output_dir` would leave behind."""
    import fnmatch

    from common.output_dir import RUN_OUTPUTS

    return [name for name in sorted(os.listdir(folder)) if name != ".lock"
            and not any(fnmatch.fnmatchcase(name, pattern) for pattern in RUN_OUTPUTS)]


def test_overwrite_leaves_exactly_what_the_new_run_writes(lora_run, data, tmp_path):
    """Every file a LoRA + merge run writes is a run output (derived from the run's folder, not a hand list). A full
    fine-tune with --overwrite_output_dir into a copy of that folder: every file left is the new run's (the user's
    own file aside), no adapter, model card or merged/ of the old run, and the folder loads as the new model."""
    import shutil

    from transformers import AutoModelForCausalLM

    out = tmp_path / "overwritten"
    shutil.copytree(lora_run["out"], out)
    (out / "notes.txt").write_text("the user's own file")
    for folder, _, files in os.walk(out):
        for name in files:
            os.utime(os.path.join(folder, name), (1e9, 1e9))  # 2001: any other time was written by the new run
    run_script("finetune_causal_lm.py", *data_args(data, out), *TRAINING[:-4], "--max_steps", "2",
               "--checkpointing_steps", "2", "--overwrite_output_dir")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert not hasattr(model, "peft_config")
    exported = load_file(out / "model.safetensors")
    assert all(torch.equal(p, exported[n]) for n, p in model.state_dict().items() if n in exported)
    old = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, files in os.walk(out) for f in files
                 if os.path.getmtime(os.path.join(d, f)) == 1e9)
    assert old == ["notes.txt"]
    assert {"adapter_config.json", "README.md", "merged"} <= set(os.listdir(lora_run["out"]))
    assert entries_outside_run_outputs(lora_run["out"]) == [] and entries_outside_run_outputs(str(out)) == ["notes.txt"]


def test_resume_onto_another_base_model_is_refused(lora_run, data, tmp_path):
    """A base of the same shape and tokenizer but other weights: a LoRA resume and a full fine-tuning resume are one
    line before any work; a copy of the right base elsewhere matches; a checkpoint written before bases were recorded
    (no `base_model` in run.json) is not checked."""
    import shutil

    from transformers import AutoConfig, LlamaForCausalLM

    other, copy = tmp_path / "other_base", tmp_path / "base_copy"
    shutil.copytree(data["model"], copy)
    shutil.copytree(data["model"], other)
    torch.manual_seed(1)
    LlamaForCausalLM(AutoConfig.from_pretrained(data["model"])).save_pretrained(other)
    full = tmp_path / "full"
    run_script("finetune_causal_lm.py", *data_args(data, full), *TRAINING[:-4], "--max_steps", "2",
               "--checkpointing_steps", "2")
    for checkpoint, lora in ((os.path.join(lora_run["out"], "checkpoints", "step_4"), LORA),
                             (full / "checkpoints" / "step_2", ())):
        args = [*data_args(data, tmp_path / "resumed"), *lora, *TRAINING, "--resume_from_checkpoint", str(checkpoint)]
        args[1] = str(other)  # --model_name_or_path
        proc = run_script("finetune_causal_lm.py", *args, check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and errors == [
            f"error: --resume_from_checkpoint {checkpoint}: the checkpoint was trained from --model_name_or_path "
            f"{data['model']}, this run from --model_name_or_path {other}, whose weight files differ byte for byte "
            "(model.safetensors holds other bytes (same size); the same weights saved again differ too); resume with "
            "the checkpoint's base model"], proc.stderr[-3000:]
        assert "training examples" not in proc.stderr + proc.stdout and not (tmp_path / "resumed").exists()
    from common.features.resume_guard import base_model_fingerprint, check_run_record

    with open(os.path.join(lora_run["out"], "checkpoints", "step_4", "run.json")) as f:
        saved = json.load(f)
    assert saved["base_model"]["weights"] == base_model_fingerprint(str(copy), None)["weights"]
    assert saved["base_model"]["weights"] != base_model_fingerprint(str(other), None)["weights"]
    older = tmp_path / "older_checkpoint"
    older.mkdir()
    fields = {**saved, "base_model": base_model_fingerprint(str(other), None)}
    del saved["base_model"]
    (older / "run.json").write_text(json.dumps(saved))
    check_run_record(str(older), fields)  # no SystemExit: nothing recorded to compare with
