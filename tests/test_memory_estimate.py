"""tools/estimate_memory.py for one exact command (`tools/estimate_memory.py -- scripts/<recipe>.py <its flags>`):
its answer adds up, reads only the model's config.json, and each flag moves the part it should (in-process, fast);
and, on shapes it was not tuned on, it is within 5 % of the peak torch's memory profiler measures
(benchmarks/profile_memory.py) for the same command on a CPU (`--device cpu`: the CPU's kernels keep what a GPU's
do not, docs/configs-and-memory.md). One profiled run per kind: a narrow and a Llama-3-wide MLP (3.5x), GQA 4:1, a
vocabulary 30x the hidden size, LoRA, QLoRA, the chunked loss, offloading, full fine-tuning, DPO and a
vision-language model (scripts/finetune_vlm.py); bf16,
checkpointing, batch 2 x 128 tokens, 2 layers, hidden 128."""

from __future__ import annotations

import argparse
import json
import os
import random

import pytest
import torch
from conftest import ROOT, run_script

from tools import estimate_memory

SEQ, BATCH = 128, 2
SHAPES = {  # LlamaConfig sizes, 2 layers; vocab 512 leaves the peak in a layer's backward, 3,840 at the loss
    "narrow": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                   vocab_size=512),
    "wide": dict(hidden_size=128, intermediate_size=448, num_attention_heads=4, num_key_value_heads=4, vocab_size=512),
    "gqa": dict(hidden_size=128, intermediate_size=448, num_attention_heads=8, num_key_value_heads=2, vocab_size=512),
    "vocab": dict(hidden_size=128, intermediate_size=448, num_attention_heads=4, num_key_value_heads=4,
                  vocab_size=3840),
    "vocab16k": dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=8,
                     vocab_size=16000),
}
HELD_OUT = {  # kind -> (shape, recipe, flags)
    "narrow MLP (2x), LoRA": ("narrow", "finetune_causal_lm.py", ["--use_peft"]),
    "Llama-3-wide MLP (3.5x), LoRA": ("wide", "finetune_causal_lm.py", ["--use_peft"]),
    "GQA 4:1, LoRA": ("gqa", "finetune_causal_lm.py", ["--use_peft"]),
    "vocabulary 30x hidden, LoRA": ("vocab", "finetune_causal_lm.py", ["--use_peft"]),
    "QLoRA": ("wide", "finetune_causal_lm.py", ["--use_peft", "--load_in_4bit"]),
    "chunked loss, LoRA": ("vocab", "finetune_causal_lm.py", ["--use_peft", "--chunked_cross_entropy"]),
    # a chunk's bf16 and fp32 logits both alive: 22.5 % under the peak when only the fp32 ones were counted
    "chunked loss, LoRA, 2 x 512 tokens, vocabulary 16k": ("vocab16k", "finetune_causal_lm.py", [
        "--use_peft", "--chunked_cross_entropy", "--max_seq_length", "512"]),
    "offloading, LoRA": ("wide", "finetune_causal_lm.py", ["--use_peft", "--activation_offloading"]),
    "full fine-tuning": ("wide", "finetune_causal_lm.py", []),
    "DPO, LoRA": ("wide", "finetune_dpo.py", ["--use_peft"]),
    # the wide Llama behind a CLIP-like encoder (hidden 64, 2 layers, 17 tokens an image), one image a row
    "vision-language, full fine-tuning": ("vlm", "finetune_vlm.py", []),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, str]:
    """Per shape: a random bf16 model, its tokenizer, SFT rows of at least SEQ tokens and DPO pairs."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from common.inputs.data import train_bpe_tokenizer
    from gpu_suite.data import WORDS

    folder = tmp_path_factory.mktemp("memory")
    rng = random.Random(0)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731 (each word one token or more)
    rows = [{"prompt": "Summarise: ", "completion": words(SEQ)} for _ in range(12)]
    long_rows = [{"prompt": "Summarise: ", "completion": words(4 * SEQ)} for _ in range(12)]  # 512 tokens or more
    pairs = [{"prompt": "Summarise: " + words(8), "chosen": words(SEQ), "rejected": words(SEQ)} for _ in range(12)]
    for name, data in (("sft", rows), ("sft_long", long_rows), ("dpo", pairs)):
        for split, part in (("train", data[:10]), ("validation", data[10:])):
            (folder / f"{name}_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    tokenizer = train_bpe_tokenizer([r["completion"] for r in rows], 512)
    for name, sizes in SHAPES.items():
        config = LlamaConfig(**sizes, num_hidden_layers=2, bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    write_tiny_vlm(folder, tokenizer, [{"messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe: " + words(8)}]},
        {"role": "assistant", "content": [{"type": "text", "text": words(SEQ)}]}], "images": [f"{i}.png"]}
        for i in range(12)])
    return {"root": str(folder)}


def write_tiny_vlm(folder, tokenizer, rows: list[dict]) -> None:
    """folder/vlm: a LLaVA-style bf16 model, the wide shape's Llama behind a CLIP-like encoder; its rows and images."""
    from PIL import Image
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaProcessor)
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    from common.inputs.shapes import CHAT_TEMPLATE, IMAGE_TOKEN, TURN_END, TURN_START

    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, TURN_START, TURN_END]})
    processor = LlavaProcessor(image_processor=LlavaImageProcessorPil(size={"shortest_edge": 32},
                                                                      crop_size={"height": 32, "width": 32}),
                               tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="full",
                               image_token=IMAGE_TOKEN, num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    text = LlamaConfig(**{**SHAPES["wide"], "vocab_size": len(tokenizer)}, num_hidden_layers=2,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = LlavaConfig(text_config=text, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_config=CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                        num_attention_heads=4, image_size=32, patch_size=8),
                         vision_feature_select_strategy="full", vision_feature_layer=-1)
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(folder / "vlm")
    processor.save_pretrained(folder / "vlm")
    for i in range(len(rows)):
        Image.new("RGB", (32, 32), (40 * i % 256, 90, 200)).save(folder / f"{i}.png")
    for split, part in (("train", rows[:10]), ("validation", rows[10:])):
        (folder / f"vlm_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))


def recipe_command(bases: dict, kind: str, tmp_path) -> list[str]:
    shape, recipe, flags = HELD_OUT[kind]
    data = {"finetune_dpo.py": "dpo", "finetune_vlm.py": "vlm"}.get(recipe, "sft_long" if "512" in flags else "sft")
    root = bases["root"]
    return [os.path.join(ROOT, "scripts", recipe), "--model_name_or_path", os.path.join(root, shape),
            "--train_file", os.path.join(root, f"{data}_train.jsonl"), "--validation_file",
            os.path.join(root, f"{data}_validation.jsonl"), "--bf16", "--gradient_checkpointing", "--max_seq_length",
            str(SEQ), "--per_device_train_batch_size", str(BATCH), "--max_steps", "2", "--max_eval_samples", "2",
            "--output_dir", str(tmp_path / "run"), "--cache_dir", str(tmp_path / "cache"), *flags]


@pytest.mark.parametrize("kind", list(HELD_OUT))
def test_the_estimate_is_within_5_percent_of_the_profiled_peak(kind, bases, tmp_path):
    command = recipe_command(bases, kind, tmp_path)
    figures = tmp_path / "peak.json"
    run_script(os.path.join(ROOT, "benchmarks", "profile_memory.py"), "--steps", "2", "--output_json", str(figures),
               "--", *command)
    measured = json.loads(figures.read_text())
    answer = estimate_memory.command_answer(command, 80, device="cpu")  # the profile is a CPU's (--device cpu)
    assert answer["device"] == "cpu"
    ratio = answer["peak_bytes"] / measured["peak_bytes"]
    print(f"{kind}: measured {measured['peak_bytes'] / 2**20:.2f} MiB, estimated {answer['peak_bytes'] / 2**20:.2f} "
          f"MiB ({ratio - 1:+.1%}); measured by category {measured['by_category']}; estimated {answer['parts']}")
    assert abs(ratio - 1) <= 0.05


LLAMA_31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072)


@pytest.fixture(scope="module")
def llama_8b_config(tmp_path_factory) -> str:
    """A folder holding only Llama-3.1-8B's config.json: no weights, no tokenizer."""
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("llama-3.1-8b")
    LlamaConfig(**LLAMA_31_8B, rope_theta=500000.0).save_pretrained(folder)
    assert os.listdir(folder) == ["config.json"]
    return str(folder)


def answer_for(model: str, *flags: str, gpu_gb: float = 24) -> dict:
    command = ["scripts/finetune_causal_lm.py", "--model_name_or_path", model, "--bf16", "--max_seq_length", "2048",
               "--per_device_train_batch_size", "2", "--gradient_checkpointing", *flags]
    return estimate_memory.command_answer(command, gpu_gb)



def test_the_vision_language_flags_move_their_parts(tmp_path, capsys):
    """scripts/finetune_vlm.py, from config.json alone: all parameters hold weights; --freeze_vision_tower takes the
    encoder's AdamW states (8 bytes a parameter) and gradients and its activations away; a second image a row
    doubles those;
    LoRA adapts the language model only; a Qwen2-VL config (tokens per image vary) asks for --image_patches."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, Qwen2VLConfig

    LlavaConfig(text_config=LlamaConfig(**SHAPES["wide"], num_hidden_layers=2), image_token_id=5,
                vision_config=CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                               num_attention_heads=4, image_size=32, patch_size=8)
                ).save_pretrained(tmp_path / "llava")
    command = ["scripts/finetune_vlm.py", "--model_name_or_path", str(tmp_path / "llava"), "--bf16",
               "--max_seq_length", "128", "--per_device_train_batch_size", "2"]
    full, frozen, lora = (estimate_memory.command_answer(command + flags, 80) for flags in (
        [], ["--freeze_vision_tower"], ["--use_peft"]))
    two_images = estimate_memory.command_answer(command, 80, images_per_row=2)
    shape = estimate_memory.model_shape(argparse.Namespace(params=None, config_name=str(tmp_path / "llava"),
                                                           model_preset=None, vocab_size=None))
    assert shape.image_patches == 17 and shape.vision_layers == 2 and shape.vision_params > 0
    assert full["parameters"] == lora["parameters"] == shape.params
    assert full["parts"]["optimizer states"] - frozen["parts"]["optimizer states"] == 8 * shape.vision_params
    assert full["parts"]["vision activations kept"] == 2 * 17 * 2 * 64 * 34  # tokens x layers x hidden x 34
    assert two_images["parts"]["vision activations kept"] == 2 * full["parts"]["vision activations kept"]
    assert "vision activations kept" not in frozen["parts"] and "vision activations kept" not in lora["parts"]
    assert shape.lora_per_rank == sum(2 * (128 + 128) + 2 * (128 + 128) + 3 * (128 + 448) for _ in range(2))
    Qwen2VLConfig(text_config=dict(SHAPES["wide"], num_hidden_layers=2), vision_config=dict(depth=2, embed_dim=32)
                  ).save_pretrained(tmp_path / "qwen")
    with pytest.raises(SystemExit):
        estimate_memory.main(["--", *command[:2], str(tmp_path / "qwen"), *command[3:]])
    assert "give --image_patches" in capsys.readouterr().err
    assert estimate_memory.command_answer(command[:2] + [str(tmp_path / "qwen")] + command[3:], 80,
                                          image_patches=64)["parts"]["vision activations kept"] > 0

def test_the_answer_adds_up_reads_only_the_config_and_says_if_it_fits(llama_8b_config, capsys):
    """One answer for the command: its parts add up to the peak, in JSON and in text alike; the verdict follows
    90 % of the GPU; the recommended 8B commands (README) stay at or under torchtune's published peaks."""
    lora = answer_for(llama_8b_config, *estimate_memory.RECOMMENDED_8B["LoRA"])
    assert lora["peak_bytes"] == pytest.approx(sum(lora["parts"].values()), abs=len(lora["parts"]))
    for gpu_gb in (16, 24):  # a 16 GB GPU cannot hold the bf16 base (16.06 GB) itself
        verdict = answer_for(llama_8b_config, *estimate_memory.RECOMMENDED_8B["LoRA"], gpu_gb=gpu_gb)["fits"]
        assert verdict == (lora["peak_bytes"] <= 0.9 * gpu_gb * 1e9) == (gpu_gb == 24)
    qlora = answer_for(llama_8b_config, *estimate_memory.RECOMMENDED_8B["QLoRA"], gpu_gb=8)
    assert lora["peak_bytes"] <= 16.2 * 2**30 and qlora["peak_bytes"] <= 7.4 * 2**30
    estimate_memory.main(["--json", "--gpu_memory_gb", "24", "--", "scripts/finetune_causal_lm.py",
                          "--model_name_or_path", llama_8b_config, "--bf16", "--max_seq_length", "2048",
                          "--per_device_train_batch_size", "2", "--gradient_checkpointing",
                          *estimate_memory.RECOMMENDED_8B["LoRA"]])
    assert json.loads(capsys.readouterr().out) == lora
    text = estimate_memory.command_report(lora)
    figures = {line.rsplit(None, 2)[0].strip(): float(line.split()[-2]) for line in text.splitlines()
               if line.startswith("  ")}
    total = figures.pop("total")
    assert total == pytest.approx(lora["peak_bytes"] / 2**30, abs=1e-3) == pytest.approx(sum(figures.values()),
                                                                                          abs=1e-3 * len(figures))
    assert text.count("Peak per GPU") == 1 and "Fits a 24 GB GPU" in text and text.endswith(
        "metrics.jsonl after a few steps.")


def test_each_flag_moves_its_part(llama_8b_config):
    """Offloading moves the layers' inputs off the GPU; 8-bit AdamW keeps a quarter of the optimizer states; the
    chunked loss holds less than the full logits; no dropout saves the adapters' own inputs; DPO doubles the rows
    and a live reference adds an fp32 copy; a ZeRO config shards full fine-tuning's states."""
    base = answer_for(llama_8b_config, "--use_peft")["parts"]
    assert "activations kept" not in answer_for(llama_8b_config, "--use_peft", "--activation_offloading")["parts"]
    eight_bit = answer_for(llama_8b_config, "--use_peft", "--optim", "adamw_8bit")["parts"]
    assert eight_bit["optimizer states"] == pytest.approx(base["optimizer states"] / 4, abs=1)
    full_logits = answer_for(llama_8b_config, "--use_peft", "--selective_ac_option", "op")
    chunked = answer_for(llama_8b_config, "--use_peft", "--selective_ac_option", "op", "--chunked_cross_entropy")
    assert chunked["peak_bytes"] < full_logits["peak_bytes"]
    dropout, no_dropout = (answer_for(llama_8b_config, "--use_peft", "--chunked_cross_entropy", *flags)["parts"]
                           for flags in ([], ["--lora_dropout", "0"]))
    assert no_dropout["layer recomputed"] < dropout["layer recomputed"]
    dpo = ["scripts/finetune_dpo.py", "--model_name_or_path", llama_8b_config, "--bf16", "--max_seq_length", "512",
           "--per_device_train_batch_size", "1"]
    live, precomputed = (estimate_memory.command_answer(dpo + flags, 80)
                         for flags in ([], ["--precompute_ref_log_probs"]))
    assert live["tokens_per_micro_batch"] == 1024 and live["parts"]["reference model"] == 4 * live["parameters"]
    assert "reference model" not in precomputed["parts"]
    zero3 = estimate_memory.command_answer(["accelerate", "launch", "--config_file", os.path.join(
        ROOT, "accelerate_configs", "deepspeed_zero3.yaml"), "--num_processes", "8", *dpo[:1], *dpo[1:]], 80)
    assert "model states (ZeRO-3: + weights sharded, 8 GPUs)" in zero3["parts"] and "weights" not in zero3["parts"]


def test_a_command_the_estimate_cannot_serve_is_one_line(llama_8b_config, capsys):
    for command, expected in (
            (["scripts/finetune_causal_lm.py", "--model_name_or_path", llama_8b_config, "--max_seq_length", "8"],
             "add --bf16"),
            (["scripts/finetune_causal_lm.py", "--model_name_or_path", llama_8b_config, "--bf16"],
             "give --max_seq_length"),
            (["scripts/finetune_classifier.py", "--bf16"], "after -- give the recipe")):
        with pytest.raises(SystemExit) as stop:
            estimate_memory.main(["--", *command])
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and len(err.splitlines()) == 1 and expected in err, err


TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
            vocab_size=320)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> str:
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(**TINY).save_pretrained(folder)
    return str(folder)


def tensor_parallel_held(config_folder: str, tp: int) -> float:
    """Parameter elements one process holds under common/features/tensor_parallel.py's plan, counted here by module
    name: the model's base_model_tp_plan, the embedding and the LM head split over tp, every other one whole."""
    from fnmatch import fnmatch

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    patterns = [f"{model.base_model_prefix}.{name}" for name in config.base_model_tp_plan]
    patterns += [f"{model.base_model_prefix}.embed_tokens", "lm_head"]
    held = 0.0
    for name, parameter in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        held += parameter.numel() / (tp if any(fnmatch(module, p) for p in patterns) else 1)
    return held


def test_tensor_parallel_states_are_16_bytes_a_held_parameter_and_wide_activations_split(tiny_config):
    """tp.yaml and fsdp2_tp.yaml rows: model states (without the gathered unit) are 16 bytes per parameter element
    one process holds under the TP plan (norms whole, the rest split), FSDP2's dp_shard dividing it again; their
    activations lie between the single GPU's and that divided by tp (the hidden-wide tensors and logits stay whole)."""
    shape = estimate_memory.model_shape(estimate_memory.parse_args(["--config_name", tiny_config]))
    assert 0 < shape.replicated < shape.params
    rows = {o.config: o for o in estimate_memory.options(shape, 4, 4)}
    assert rows["tp.yaml"].tp == 4 and rows["fsdp2_tp.yaml"].tp == 2
    assert rows["tp.yaml"].bytes_per_param * shape.params == pytest.approx(16 * tensor_parallel_held(tiny_config, 4))
    assert rows["fsdp2_tp.yaml"].bytes_per_param * shape.params == pytest.approx(
        16 * tensor_parallel_held(tiny_config, 2) / 2)
    for tp in (2, 4):
        for checkpointing in (False, True):
            one, split = (estimate_memory.activation_bytes(shape, 512, 2, checkpointing, tp=t) for t in (1, tp))
            assert one / tp < split < one
    assert "fsdp2_tp.yaml" not in {o.config for o in estimate_memory.options(shape, 2, 2)}


def test_a_tensor_parallel_command_gives_its_per_gpu_parts_and_refuses_lora(tiny_config, capsys):
    launch = ["accelerate", "launch", "--config_file", os.path.join(ROOT, "accelerate_configs", "tp.yaml"),
              "--num_processes", "2"]
    recipe = ["scripts/finetune_causal_lm.py", "--model_name_or_path", tiny_config, "--bf16", "--max_seq_length",
              "256", "--per_device_train_batch_size", "2"]
    tp, one = (estimate_memory.command_answer(prefix + recipe, 80) for prefix in (launch, []))
    shape = estimate_memory.model_shape(estimate_memory.parse_args(["--config_name", tiny_config]))
    states = 16 * tensor_parallel_held(tiny_config, 2) + 4 * shape.largest_unit / 2  # + the gathered unit's share
    assert tp["parts"]["model states (TP 2, 2 GPUs)"] == pytest.approx(states, abs=1) and tp["processes"] == 2
    assert tp["peak_bytes"] == pytest.approx(sum(tp["parts"].values()), abs=len(tp["parts"]))
    assert one["parts"]["activations kept"] / 2 < tp["parts"]["activations kept"] < one["parts"]["activations kept"]
    with pytest.raises(SystemExit):
        estimate_memory.main(["--", *launch, *recipe, "--use_peft"])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not supported with tensor parallelism" in err, err


def gb_pair(cell: str) -> list[float]:
    """'19.8 / 17.6 GB' -> [19.8, 17.6]; '17.6 GB' -> [17.6, 17.6]."""
    figures = [float(part.strip().removesuffix("GB")) for part in cell.split("(")[0].split("/")]
    return figures * 2 if len(figures) == 1 else figures


@pytest.mark.parametrize("chunked", [False, True])
def test_every_figure_the_estimator_prints_agrees_with_the_others(chunked):
    """The 1b preset printed model states of 19.8 GB and then totals of 18.2 / 17.8 GB, and activations of 3.9 GB in
    one table and 5.2 GB (115.7 kB per token per layer) in the next, for one micro-batch. Every output mode (the
    configs' table, --activation_modes, --use_peft, --dpo, one command) now states the same figures, to their
    rounding: each row's states + activations = its total, one GPU's row = the modes', LoRA table's and command's."""
    flags = ["--model_preset", "1b"] + ["--chunked_cross_entropy"] * chunked
    text = "\n".join(estimate_memory.report(estimate_memory.parse_args(flags + more))
                     for more in (["--activation_modes", "--dpo"], ["--use_peft"]))  # (with --use_peft: QLoRA's modes)
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("config", "mode", "method") and "GB" in line:
            rows.setdefault(cells[0], cells)
    for name, cells in rows.items():  # the configs' table: states, activations, totals (plain / checkpointed)
        if name.endswith(".yaml") or ".yaml +" in name:
            states, acts, totals = gb_pair(cells[3]), gb_pair(cells[4]), gb_pair(cells[5])
            assert all(abs(s + a - t) <= 0.11 for s, a, t in zip(states, acts, totals)), cells
    single = rows["single_gpu.yaml"]
    states, acts, totals = gb_pair(single[3]), gb_pair(single[4]), gb_pair(single[5])
    header = next(line for line in text.splitlines() if line.startswith("Activation memory by mode"))
    assert f"model states {states[0]:.1f} GB on one GPU without checkpointing, {states[1]:.1f} GB with it" in header
    assert gb_pair(rows["none"][3])[0] == totals[0] and gb_pair(rows["full"][3])[0] == totals[1]
    shape = estimate_memory.model_shape(estimate_memory.parse_args(flags))
    per_token_layer = float(rows["none"][2].removesuffix(" kB")) * 1e3
    assert per_token_layer * 2048 * shape.layers / 1e9 == pytest.approx(acts[0], abs=0.06)  # the layer's moment
    full = rows["full fine-tuning"]  # the --use_peft table's, to two decimals
    assert [round(x, 1) for x in gb_pair(full[2]) + gb_pair(full[3]) + gb_pair(full[4])] == states + acts + totals
    for name in ("full, live reference", "full, precomputed reference"):  # --dpo: the same states
        assert gb_pair(rows[name][2]) == states
    command = ["scripts/pretrain_llama.py", "--model_preset", "1b", "--tokenizer_vocab_size", "32000", "--block_size",
               "2048", "--per_device_train_batch_size", "1", "--bf16", "--optim", "adamw_torch_fused"
               ] + ["--chunked_cross_entropy"] * chunked  # the tables count AdamW; the recipe's default is Muon
    for extra, total in (([], totals[0]), (["--gradient_checkpointing"], totals[1])):
        assert round(estimate_memory.command_answer(command + extra, 80)["peak_bytes"] / 1e9, 1) == total


def test_a_hub_id_the_machine_cannot_reach_is_one_line_at_once(monkeypatch, capsys):
    """Offline, `-- ... --model_name_or_path <hub id>` retried the hub for ~25 s and then named --config_name, a flag
    the user had not given. Now: offline (HF_HUB_OFFLINE) or with the hub unreachable (here a closed local port), one
    line at once naming the flag given."""
    import time

    from huggingface_hub import constants

    command = ["scripts/finetune_causal_lm.py", "--model_name_or_path", "no-such-org/no-such-model", "--bf16",
               "--max_seq_length", "2048"]
    cases = ((True, constants.ENDPOINT, "and not in the hub cache (HF_HUB_OFFLINE is set): give a folder"),
             (False, "http://127.0.0.1:9", "not in the hub cache, and http://127.0.0.1:9 cannot be reached ("))
    for offline, endpoint, why in cases:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        started = time.monotonic()
        with pytest.raises(SystemExit) as stop:
            estimate_memory.command_answer(command, 80)
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and time.monotonic() - started < 5, err
        assert err.startswith("error: --model_name_or_path no-such-org/no-such-model: no such folder") and why in err
