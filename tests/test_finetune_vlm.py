"""Vision-language fine-tuning (scripts/finetune_vlm.py, common/inputs/images.py) on tiny VLMs built from configs: a
LLaVA-style model (CLIP-like encoder, Llama) and a Qwen2-VL-style one (M-RoPE, `image_grid_thw`, vision start/end
tokens, a variable number of tokens per image).

- labels: exactly the assistant tokens carry a label, checked token by token against the template's rendering of
  each assistant turn, in every data format and both architectures; no image or vision token ever does;
- exactness: accumulation 4 x 2 equals 1 x 8 (losses 1e-6, weights 1e-5 relative, fp32) with 0-2 images and uneven
  text per row, 2 processes equal 1, LoRA too (recipe runs, LLaVA; in-process for Qwen2-VL, whose stock processor
  needs torchvision for its video half: see docs/vlm.md);
- a run SIGKILLed at a random step (dropout on) and resumed ends with the uninterrupted run's weights and rows;
- gradient checkpointing with async checkpoints (and a resume from one), regional compile and the divergence guard,
  each against the one-batch run;
- bad inputs are one line before any model is built; a copy without features trains as the original.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import sys
import time

import pytest
import torch
from conftest import ROOT, SCRIPTS, launcher, read_metrics, run_script, train_losses
from safetensors.torch import load_file

import forked_runs

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu red green blue what colour".split()
COLUMNS = argparse.Namespace(messages_column="messages", prompt_column="prompt", completion_column="completion",
                             images_column="images")
LR = "1e-3"
# A key's bias has no gradient but fp32 summation noise, which AdamW's default epsilon (1e-8) turns into full steps
# that differ between batchings (docs/scaling.md says the same of tensor parallelism): 1e-6 keeps the noise small.
EPSILON = "1e-6"
LORA = ("--use_peft", "--lora_dropout", "0")  # the batchings would draw different adapter dropout masks
COMPILED_GRAPHS = 8  # measured: the two block classes over 2 steps and the evaluations, graph breaks included


def picture(rng: random.Random, path: str) -> str:
    from PIL import Image

    size = (rng.randint(28, 56), rng.randint(28, 56))
    Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3))).save(path)
    return os.path.basename(path)


def make_rows(rng: random.Random, folder: str, count: int) -> list[dict]:
    """Rows of the three formats, with 0, 1 or 2 images and uneven text."""
    rows = []
    for index in range(count):
        images = [picture(rng, os.path.join(folder, f"{index}-{k}.png")) for k in range(index % 3)]
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.choice((1, 2, 9))))
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
        if index % 4 == 3:  # prompt/completion of plain text: the images go first in the user turn
            rows.append({"prompt": question, "completion": answer, "images": images})
            continue
        turns = [{"role": "user", "content": parts}, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        if index % 4 == 2:  # a second exchange, its text only
            turns += [{"role": "user", "content": [{"type": "text", "text": "and then"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": rng.choice(WORDS)}]}]
        rows.append({"messages": turns, "images": images})
    return rows


def tokenizer_with(specials: list[str]):
    from common.inputs.data import train_bpe_tokenizer
    from common.inputs.shapes import CHAT_TEMPLATE

    tokenizer = train_bpe_tokenizer([" ".join(WORDS)] * 20 + ["user assistant and then"], 300)
    tokenizer.add_special_tokens({"additional_special_tokens": specials + ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE.replace("<image>", specials[0] if len(specials) == 1 else
                                                    "<|vision_start|><|image_pad|><|vision_end|>")
    return tokenizer


def tiny_llava(folder: str, dropout: float = 0.0):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tokenizer = tokenizer_with(["<image>"])
    processor = LlavaProcessor(image_processor=LlavaImageProcessorPil(size={"shortest_edge": 32},
                                                                      crop_size={"height": 32, "width": 32}),
                               tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
                               image_token="<image>", num_additional_image_tokens=1,
                               chat_template=tokenizer.chat_template)
    config = LlavaConfig(
        text_config=LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                                attention_dropout=dropout, pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id),
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       image_size=32, patch_size=8, attention_dropout=dropout),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="default")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model, processor


def tiny_qwen2_vl():
    """Qwen2-VL's model and image processing; its processor without the video half (torchvision)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    tokenizer = tokenizer_with(["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"])
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2,
                                               temporal_patch_size=2)
    processor = ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                          chat_template=tokenizer.chat_template)
    ids = {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>") for name in
           ("image_pad", "video_pad", "vision_start", "vision_end")}
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=ids["image_pad"], video_token_id=ids["video_pad"], vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"])
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config), processor


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> dict:
    """The tiny models and data: train.jsonl (16 rows) and validation.jsonl (4 rows), images beside them."""
    d = tmp_path_factory.mktemp("vlm")
    rng = random.Random(0)
    paths = {"dir": str(d)}
    for split, count in (("train", 16), ("validation", 4)):
        paths[split] = str(d / f"{split}.jsonl")
        with open(paths[split], "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in make_rows(rng, str(d), count))
    paths["llava"], paths["llava_dropout"] = str(d / "llava"), str(d / "llava_dropout")
    paths["llava_model"], paths["llava_processor"] = tiny_llava(paths["llava"])
    tiny_llava(paths["llava_dropout"], dropout=0.1)
    paths["qwen_model"], paths["qwen_processor"] = tiny_qwen2_vl()
    return paths


def rows_of_file(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def collated(processor, model, rows: list[dict], folder: str) -> tuple[dict, dict]:
    from common.inputs.images import ImageTextCollator, tokenize_image_rows, vision_token_ids

    keys = sorted({k for row in rows for k in row})
    tokenized = tokenize_image_rows({k: [row.get(k) for row in rows] for k in keys}, processor, COLUMNS, folder)
    collate = ImageTextCollator(processor, vision_token_ids(processor, model.config), None, 8)
    return tokenized, collate([{k: tokenized[k][i] for k in tokenized} for i in range(len(rows))])


@pytest.mark.parametrize("architecture", ["llava", "qwen"])
def test_exactly_the_assistant_tokens_carry_labels(vlm, architecture):
    """Every format (chat turns with images, a second exchange without, plain prompt/completion), from paths and from
    bytes: the labelled tokens are, in order, each trained assistant turn's rendering (its text and end of turn)
    tokenized, each at its own position; the image tokens are the processor's count per image, none labelled."""
    from common.inputs.images import as_messages, vision_token_ids

    model, processor = vlm[f"{architecture}_model"], vlm[f"{architecture}_processor"]
    rows = rows_of_file(vlm["train"])
    with_bytes = [{**row, "images": [{"bytes": open(os.path.join(vlm["dir"], p), "rb").read(), "path": None}
                                     for p in row["images"]]} for row in rows]
    tokenized, batch = collated(processor, model, rows, vlm["dir"])
    assert collated(processor, model, with_bytes, vlm["dir"])[1]["labels"].equal(batch["labels"])
    vision = vision_token_ids(processor, model.config)
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    grids = iter((batch["image_grid_thw"].prod(-1) // 4).tolist()) if "image_grid_thw" in batch else None
    for i, row in enumerate(rows):
        ids, labels = batch["input_ids"][i], batch["labels"][i]
        length = int(batch["attention_mask"][i].sum())
        assert length == tokenized["length"][i]  # the up-front length: what --max_seq_length is checked against
        assert (labels[length:] == -100).all()
        labelled = labels != -100
        assert ids[labelled].equal(labels[labelled]) and not any(int(t) in vision for t in ids[labelled])
        messages, prompt_turns = as_messages(row, COLUMNS)
        answers = [turn for turn in messages[prompt_turns:] if turn["role"] == "assistant"]
        expected = [t for turn in answers for t in processor.tokenizer(
            turn["content"][0]["text"] + "<|im_end|>\n", add_special_tokens=False)["input_ids"]]
        assert labels[labelled].tolist() == expected, row
        per_image = [next(grids) for _ in row["images"]] if grids else [16] * len(row["images"])
        assert int((ids == image_id).sum()) == sum(per_image)


def test_accumulation_equals_one_batch_in_process_for_qwen2_vl(vlm):
    """Qwen2-VL (variable image tokens, M-RoPE): 4 micro-batches of 2 with the window's label count give the loss
    and gradients of one batch of 8 (fp32): loss 1e-6, gradients 1e-5 relative."""
    from common.inputs.images import ImageTextCollator, tokenize_image_rows, vision_token_ids

    model, processor = vlm["qwen_model"], vlm["qwen_processor"]
    rows = rows_of_file(vlm["train"])[:8]
    keys = sorted({k for row in rows for k in row})
    tokenized = tokenize_image_rows({k: [row.get(k) for row in rows] for k in keys}, processor, COLUMNS, vlm["dir"])
    items = [{k: tokenized[k][i] for k in tokenized} for i in range(8)]
    collate = ImageTextCollator(processor, vision_token_ids(processor, model.config), None, 8)

    def gradients(batches: list[dict]) -> tuple[float, dict]:
        model.zero_grad()
        count = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        total = 0.0
        for b in batches:
            loss = model(**b, num_items_in_batch=torch.tensor(count), use_cache=False).loss
            loss.backward()
            total += loss.item()
        return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_one, one = gradients([collate(items)])
    loss_four, four = gradients([collate(items[k:k + 2]) for k in range(0, 8, 2)])
    assert abs(loss_one - loss_four) < 1e-6
    assert one.keys() == four.keys() and any(n.startswith("model.visual") for n in one)
    for name in one:
        assert (one[name] - four[name]).norm() <= 1e-5 * one[name].norm() + 1e-12, name



@pytest.mark.parametrize("architecture", ["llava", "qwen"])
def test_a_blank_image_changes_no_loss_or_gradient(vlm, architecture):
    """A batch without images gets a blank image after its padding (with more than one process): the loss is bit for
    bit the one without it, every gradient within 1e-6 relative, and the vision encoder runs (its gradients exactly
    0). The stacks of blocks that FSDP2 shards are the encoder's blocks and the decoder's layers."""
    from common.inputs.images import ImageTextCollator, tokenize_image_rows, vision_token_ids
    from common.inputs.vision_models import block_classes

    model, processor = vlm[f"{architecture}_model"], vlm[f"{architecture}_processor"]
    rows = [row for row in rows_of_file(vlm["train"]) if not row["images"]][:3]
    keys = sorted({k for row in rows for k in row})
    tokenized = tokenize_image_rows({k: [row.get(k) for row in rows] for k in keys}, processor, COLUMNS, vlm["dir"])
    items = [{k: tokenized[k][i] for k in tokenized} for i in range(len(rows))]
    results = []
    for blank in (False, True):
        batch = ImageTextCollator(processor, vision_token_ids(processor, model.config), None, 8, blank)(items)
        assert ("pixel_values" in batch) == blank
        model.zero_grad()
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (plain, plain_grads), (blanked, blanked_grads) = results
    assert plain == blanked
    for name, grad in plain_grads.items():  # sums over a longer sequence: Qwen2-VL's bias and norm gradients 1e-7 apart
        assert (blanked_grads[name] - grad).norm() <= 1e-6 * grad.norm(), name
    assert {n for n in blanked_grads if n not in plain_grads} and not any(
        blanked_grads[n].any() for n in blanked_grads if n not in plain_grads)
    assert block_classes(model) == (["CLIPEncoderLayer", "LlamaDecoderLayer"] if architecture == "llava" else
                                    ["Qwen2VLVisionBlock", "Qwen2VLDecoderLayer"])

@pytest.mark.parametrize("architecture", ["llava", "qwen"])
def test_the_freezing_flags_and_lora_targets_find_each_part(vlm, architecture):
    """--freeze_vision_tower stops the encoder (not Qwen-VL's merger inside it), --freeze_projector the projector;
    LoRA's default targets are the language model's linear layers, every one of them, nothing else."""
    import copy

    from torch import nn

    from common.inputs.vision_models import freeze_vision_parts, language_model_linears

    model = vlm[f"{architecture}_model"]
    tower, projector = ("model.vision_tower.", "model.multi_modal_projector.") if architecture == "llava" else \
        ("model.visual.", "model.visual.merger.")
    for flags, frozen in (((True, False), lambda n: n.startswith(tower) and not n.startswith(projector)),
                          ((False, True), lambda n: n.startswith(projector)),
                          ((True, True), lambda n: n.startswith(tower) or n.startswith(projector))):
        part = copy.deepcopy(model)
        freeze_vision_parts(part, *flags)
        assert {n for n, p in part.named_parameters() if not p.requires_grad} == \
            {n for n, _ in part.named_parameters() if frozen(n)}, flags
    targets = language_model_linears(model.config)
    assert targets == [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
                       and n.startswith("model.language_model.")] and targets


def finetune(vlm: dict, out: str, *args: str, model: str = "llava", launcher: list[str] | None = None) -> str:
    run_script("finetune_vlm.py", "--model_name_or_path", vlm[model], "--train_file", vlm["train"],
               "--validation_file", vlm["validation"], "--output_dir", out, "--max_steps", "2", "--learning_rate", LR,
               "--logging_steps", "1", "--seed", "0", "--mixed_precision", "no", "--adam_epsilon", EPSILON, *args,
               launcher=launcher)
    return out


def relative_difference(a: str, b: str, name: str = "model.safetensors") -> float:
    """The largest difference of two exports' weights, relative to each tensor's largest weight (absolute below 1:
    a tensor near 0 whose gradient is only summation noise, such as an attention key's bias, is not magnified)."""
    x, y = load_file(os.path.join(a, name)), load_file(os.path.join(b, name))
    assert x.keys() == y.keys()
    return max(((x[k] - y[k]).abs().max() / y[k].abs().max().clamp(min=1)).item() for k in x)


@pytest.fixture(scope="module")
def one_batch_runs(vlm) -> dict[str, str]:
    d = vlm["dir"]
    return {"full": finetune(vlm, f"{d}/b8", "--per_device_train_batch_size", "8"),
            "lora": finetune(vlm, f"{d}/lora_b8", "--per_device_train_batch_size", "8", *LORA)}


def test_accumulation_and_processes_equal_one_batch(vlm, one_batch_runs):
    """LLaVA through the recipe: 4 x 2 and 2 processes x 2 x 2 end where 1 x 8 does (losses 1e-6, weights 1e-5
    relative); LoRA's 4 x 2 where its 1 x 8 does. The export answers from its reload (the run's last line)."""
    d = vlm["dir"]
    runs = {"4x2": (finetune(vlm, f"{d}/b2ga4", "--per_device_train_batch_size", "2",
                             "--gradient_accumulation_steps", "4"), one_batch_runs["full"], "model.safetensors"),
            "2 processes": (finetune(vlm, f"{d}/ddp", "--per_device_train_batch_size", "2",
                                     "--gradient_accumulation_steps", "2", launcher=launcher("cpu_2proc.yaml")),
                            one_batch_runs["full"], "model.safetensors"),
            "lora 4x2": (finetune(vlm, f"{d}/lora_b2ga4", "--per_device_train_batch_size", "2", *LORA,
                                  "--gradient_accumulation_steps", "4"), one_batch_runs["lora"],
                         "adapter_model.safetensors")}
    for name, (out, reference, weights) in runs.items():
        assert train_losses(out) == pytest.approx(train_losses(reference), abs=1e-6), name
        assert relative_difference(out, reference, weights) < 1e-5, name
    adapter = json.load(open(os.path.join(one_batch_runs["lora"], "adapter_config.json")))
    assert all("language_model" in target for target in adapter["target_modules"])
    results = json.load(open(os.path.join(one_batch_runs["full"], "all_results.json")))
    assert 0 <= results["eval_accuracy"] <= 1 and results["images_per_second"] > 0



def test_zero3_and_fsdp2_on_2_processes_equal_one_batch(vlm, one_batch_runs):
    """2 processes x 2 x 2 under ZeRO-3 (ds_configs/zero3.json) and FSDP2 end where 1 x 8 does (losses 1e-6, weights
    1e-5 relative), on rows with 0-2 images (a process whose batch has none runs the encoder on a blank image: else
    it leaves the others in their collectives); FSDP2's shard units are the vision blocks and the decoder layers; the
    reloaded export answers under ZeRO-3 too (it hung there: a hang now fails at the timeout)."""
    d, shown = vlm["dir"], {}
    for config in ("deepspeed_zero3.yaml", "fsdp2.yaml"):
        out = f"{d}/{config.split('.')[0]}"
        proc = run_script("finetune_vlm.py", "--model_name_or_path", vlm["llava"], "--train_file", vlm["train"],
                          "--validation_file", vlm["validation"], "--output_dir", out, "--max_steps", "2",
                          "--learning_rate", LR, "--logging_steps", "1", "--seed", "0", "--mixed_precision", "no",
                          "--adam_epsilon", EPSILON, "--per_device_train_batch_size", "2",
                          "--gradient_accumulation_steps", "2", launcher=launcher(config), timeout=240)
        shown[config] = proc.stdout + proc.stderr
        assert train_losses(out) == pytest.approx(train_losses(one_batch_runs["full"]), abs=1e-6), config
        assert relative_difference(out, one_batch_runs["full"]) < 1e-5, config
    assert "sample answer of the reloaded export" in shown["deepspeed_zero3.yaml"]
    assert "FSDP2 shard units: {'LlavaForConditionalGeneration': 1, 'CLIPEncoderLayer': 2, 'Embedding': 1, " \
        "'LlamaDecoderLayer': 2, 'Linear': 1}" in shown["fsdp2.yaml"]  # the root; embeddings and head their own

def test_a_run_killed_at_a_random_step_resumes_to_the_same_weights_and_rows(vlm):
    """Dropout on (attention, both towers); checkpoints every 2 of 8 steps; SIGKILL once step k (seeded) is logged;
    the resumed run ends bit for bit as the uninterrupted one, with the same metric rows. Every attempt is started
    the same way (forked_runs.start: the same threads, so the same summation order)."""
    d = vlm["dir"]

    def command(out: str, *extra: str) -> list[str]:
        return [sys.executable, os.path.join(SCRIPTS, "finetune_vlm.py"), "--model_name_or_path", vlm["llava_dropout"],
                "--train_file", vlm["train"], "--validation_file", vlm["validation"], "--output_dir", out,
                "--learning_rate", LR, "--logging_steps", "1", "--seed", "0", "--mixed_precision", "no",
                "--adam_epsilon", EPSILON, "--max_steps", "8", "--per_device_train_batch_size", "2",
                "--gradient_accumulation_steps", "2", "--checkpointing_steps", "2", *extra]

    whole, killed = f"{d}/whole", f"{d}/killed"
    assert forked_runs.start(command(whole), ROOT, f"{d}/whole.log").wait(300) == 0
    kill_after = random.Random(57).randint(3, 6)
    proc = forked_runs.start(command(killed), ROOT, f"{d}/killed.log")
    deadline = time.monotonic() + 300
    while proc.poll() is None and not any(r.get("step", 0) >= kill_after for r in (
            read_metrics(killed) if os.path.isfile(f"{killed}/metrics.jsonl") else [])):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before the kill"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = forked_runs.start(command(killed, "--resume_from_checkpoint", "latest"), ROOT, f"{d}/killed.log")
    assert resumed.wait(300) == 0, open(f"{d}/killed.log").read()[-3000:]
    assert [r["step"] for r in read_metrics(killed) if "loss" in r] == list(range(1, 9))  # no row twice
    assert train_losses(killed) == train_losses(whole)
    assert relative_difference(killed, whole) == 0.0


def test_bad_inputs_are_one_line_before_any_model_is_built(vlm, tmp_path):
    """A missing image, more placeholders than images, images without placeholders, a text-only model, a processor
    whose image token the tokenizer lacks, a --max_seq_length that would cut an image, a Qwen2-VL processor without
    torchvision (its video processor needs it): exit 2, one `error:` line."""
    rows = rows_of_file(vlm["train"])
    with_image = next(i for i, row in enumerate(rows) if row["images"] and "messages" in row)

    def data(change) -> str:
        edited = [dict(row) for row in rows]
        change(edited[with_image])
        path = tmp_path / f"train{len(os.listdir(tmp_path))}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in edited))
        shutil.copy(os.path.join(vlm["dir"], rows[with_image]["images"][0]), tmp_path)
        return str(path)

    text_only = tmp_path / "llama"
    vlm["llava_model"].model.language_model.config.save_pretrained(text_only)
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(vlm["llava_model"].model.language_model.config).save_pretrained(text_only)
    vlm["llava_processor"].tokenizer.save_pretrained(text_only)
    bad_token = tmp_path / "bad_token"
    shutil.copytree(vlm["llava"], bad_token)
    processor_config = json.loads((bad_token / "processor_config.json").read_text())
    processor_config["image_token"] = "<picture>"
    (bad_token / "processor_config.json").write_text(json.dumps(processor_config))
    qwen = tmp_path / "qwen"  # as a hub checkout of Qwen2-VL holds it: a video processor beside the image processor
    vlm["qwen_model"].save_pretrained(qwen)
    vlm["qwen_processor"].save_pretrained(qwen)
    for name in ("processor_config.json", "tokenizer_config.json"):
        (qwen / name).write_text((qwen / name).read_text().replace("ImageOnlyQwen2VLProcessor", "Qwen2VLProcessor"))
    image_processor = json.loads((qwen / "processor_config.json").read_text())["image_processor"]
    (qwen / "video_preprocessor_config.json").write_text(json.dumps(
        {**image_processor, "image_processor_type": None, "video_processor_type": "Qwen2VLVideoProcessor"}))
    n = with_image + 1
    cases = {
        "missing": (data(lambda row: row.update(images=["nowhere.png"])), vlm["llava"], (),
                    f"row {n} image 1 cannot be read (FileNotFoundError"),
        "placeholders": (data(lambda row: row.update(images=[])), vlm["llava"], (),
                         f"row {n} has {len(rows[with_image]['images'])} image placeholder(s)"),
        "no placeholder": (data(lambda row: row["messages"][0].update(content="plain text")), vlm["llava"], (),
                           f"row {n} has 0 image placeholder(s)"),
        "text-only model": (vlm["train"], str(text_only), (), "the model (llama) takes no images"),
        "image token": (vlm["train"], str(bad_token), (), "the processor's image token '<picture>' is not a token"),
        "cut image": (vlm["train"], vlm["llava"], ("--max_seq_length", "12"), "would cut inside an image's tokens"),
        "no torchvision": (vlm["train"], str(qwen), (), "Qwen2VLVideoProcessor requires the Torchvision library, "
                           "which is not installed"),
    }
    for name, (train, model, extra, expected) in cases.items():
        out = tmp_path / f"out-{name.replace(' ', '-')}"
        proc = run_script("finetune_vlm.py", "--model_name_or_path", model, "--train_file", train,
                          "--validation_file", vlm["validation"], "--output_dir", str(out), *extra, check=False)
        errors = [line for line in proc.stderr.splitlines() if "error:" in line]
        assert proc.returncode == 2 and len(errors) == 1 and expected in errors[0], (name, proc.stderr[-2000:])
        assert not os.path.exists(out / "model.safetensors"), name


def test_a_copy_without_its_features_trains_exactly_as_the_original(vlm, one_batch_runs, tmp_path):
    from tools.copy_recipe import common_modules, strip_features

    copy = tmp_path / "my_vlm.py"
    copy.write_text(strip_features(open(os.path.join(SCRIPTS, "finetune_vlm.py")).read()))
    assert not any(".features" in name for name in common_modules(copy.read_text()))
    run_script(str(copy), "--model_name_or_path", vlm["llava"], "--train_file", vlm["train"],
               "--validation_file", vlm["validation"], "--output_dir", str(tmp_path / "copy"), "--max_steps", "2",
               "--learning_rate", LR, "--logging_steps", "1", "--seed", "0", "--mixed_precision", "no",
               "--adam_epsilon", EPSILON, "--per_device_train_batch_size", "8", env={"PYTHONPATH": os.path.dirname(SCRIPTS)})
    assert train_losses(str(tmp_path / "copy")) == train_losses(one_batch_runs["full"])
    assert relative_difference(str(tmp_path / "copy"), one_batch_runs["full"]) == 0.0


def test_the_gpu_suite_row_passes_the_recipe_s_flag_checks(tmp_path):
    """The perf_vlm row (gpu_suite/vlm.py, prepared for a GPU, left out of the dry run): the command its benchmark
    gives the recipe on a GPU passes scripts/finetune_vlm.py's flag checks (a renamed flag or value fails here)."""
    from test_bad_inputs import load_script

    from benchmarks import vlm_vs_trl
    from gpu_suite.vlm import benchmark_argv

    train = tmp_path / "train.jsonl"
    train.write_text("{}\n")
    (tmp_path / "model").mkdir()
    on_a_gpu = argparse.Namespace(cuda=True, work=str(tmp_path))
    args = vlm_vs_trl.parse_args(benchmark_argv(on_a_gpu, str(tmp_path / "model"), trl=True))
    args.bf16 = True  # measure()'s default with CUDA
    recipe = load_script("finetune_vlm").parse_args(vlm_vs_trl.ours_argv(args, args.model_name_or_path, str(train),
                                                                         str(tmp_path / "out")))
    assert (recipe.mixed_precision, recipe.per_device_train_batch_size, recipe.max_steps) == ("bf16", 16, 12)
    assert not args.ours_only


def one_nan_row(vlm: dict, folder: str) -> tuple[str, str]:
    """8 of the training rows, the 6th answered with `q` (in no other row), and the tiny LLaVA with rms_norm_eps=0
    whose embedding of `q` alone is zero: that row's forward pass is NaN (tests/test_preemption.py's bad block)."""
    from transformers import AutoConfig, AutoProcessor, LlavaForConditionalGeneration

    rows = rows_of_file(vlm["train"])[:8]
    bad = rows[5]
    bad["messages"][1]["content"][0]["text"] += " q"
    train = os.path.join(vlm["dir"], "one_nan_row.jsonl")  # beside the images, whose paths are relative
    with open(train, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    processor = AutoProcessor.from_pretrained(vlm["llava"])
    config = AutoConfig.from_pretrained(vlm["llava"])
    config.text_config.rms_norm_eps = 0.0
    model = LlavaForConditionalGeneration.from_pretrained(vlm["llava"], config=config)
    q = processor.tokenizer(" q", add_special_tokens=False)["input_ids"][-1]
    assert sum(processor.tokenizer(json.dumps(r))["input_ids"].count(q) for r in rows) == 1
    with torch.no_grad():  # the padding's embedding, zero from its initialisation, made as the others
        model.get_input_embeddings().weight[processor.tokenizer.pad_token_id].normal_(0, 0.02)
        model.get_input_embeddings().weight[q] = 0
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return train, folder


def test_compile_async_checkpoints_gradient_checkpointing_and_the_divergence_guard(vlm, one_batch_runs,
                                                                                   monkeypatch):
    """The shared features on the VLM recipe, each against the 1 x 8 reference run (fp32, 2 steps):
    - gradient checkpointing with async checkpoints at every step ends where the plain run does (losses 1e-6,
      weights 1e-5 relative), and resumed from its async step-1 checkpoint ends there too;
    - regional compilation (aot_eager: dynamo's graphs without building kernels) of the vision blocks and decoder
      layers trains as eager (losses 1e-5) in a bounded number of graphs, none falling back to eager, every graph
      break in transformers' output-capturing hook (a known one: docs/vlm.md#torchcompile);
    - a NaN step (one row's forward pass NaN, batch 2, 3 steps) is skipped: counted once, its weights those of the
      step before, and the next step trains on."""
    d, reference = vlm["dir"], one_batch_runs["full"]
    batch8 = ("--per_device_train_batch_size", "8")
    checkpointed = finetune(vlm, f"{d}/checkpointed", *batch8, "--gradient_checkpointing", "--async_checkpointing",
                            "--checkpointing_steps", "1")
    assert train_losses(checkpointed) == pytest.approx(train_losses(reference), abs=1e-6)
    assert relative_difference(checkpointed, reference) < 1e-5
    resumed = f"{d}/resumed"
    shutil.copytree(os.path.join(checkpointed, "checkpoints", "step_1"), f"{d}/async_step_1")
    finetune(vlm, resumed, *batch8, "--gradient_checkpointing", "--resume_from_checkpoint", f"{d}/async_step_1")
    assert train_losses(resumed) == pytest.approx({2: train_losses(reference)[2]}, abs=1e-6)
    assert relative_difference(resumed, reference) < 1e-5

    compiled = f"{d}/compiled"
    monkeypatch.setenv("TORCH_LOGS", "graph_breaks")  # where each break is, in the run's output
    proc = run_script("finetune_vlm.py", "--model_name_or_path", vlm["llava"], "--train_file", vlm["train"],
                      "--validation_file", vlm["validation"], "--output_dir", compiled, "--max_steps", "2",
                      "--learning_rate", LR, "--logging_steps", "1", "--seed", "0", "--mixed_precision", "no",
                      "--adam_epsilon", EPSILON, *batch8, "--torch_compile", "--torch_compile_backend", "aot_eager")
    monkeypatch.delenv("TORCH_LOGS")
    results = json.load(open(os.path.join(compiled, "all_results.json")))
    assert 0 < results["compiled_graphs"] <= COMPILED_GRAPHS and results["compile_fallbacks"] == 0, results
    # The only breaks: transformers' output-capturing hooks on the vision blocks and their attention (ContextVar.get,
    # which dynamo cannot trace; docs/vlm.md#torchcompile); none in the decoder layers' code.
    sites = re.findall(r"Graph break .*in user code at (\S+):\d+", proc.stdout + proc.stderr)
    assert len(sites) == results["graph_breaks"] and all(s.endswith("utils/output_capturing.py") for s in sites), sites
    assert train_losses(compiled) == pytest.approx(train_losses(reference), abs=1e-5)

    train, model = one_nan_row(vlm, f"{d}/nan_model")
    guarded = f"{d}/guarded"
    run_script("finetune_vlm.py", "--model_name_or_path", model, "--train_file", train, "--output_dir", guarded,
               "--max_steps", "3", "--learning_rate", LR, "--logging_steps", "1", "--seed", "0",
               "--mixed_precision", "no", "--adam_epsilon", EPSILON, "--per_device_train_batch_size", "2",
               "--checkpointing_steps", "1", "--save_total_limit", "10")
    rows = [r for r in read_metrics(guarded) if "loss" in r]
    skipped = [r["step"] for r in rows if r.get("skipped_nonfinite_steps")]
    assert skipped == [2], rows  # with this seed: a checkpoint on each side of it
    before, at, after = (load_file(os.path.join(guarded, "checkpoints", f"step_{s}", "model.safetensors"))
                         for s in (1, 2, 3))
    assert all(torch.equal(before[k], at[k]) for k in at)
    assert not all(torch.equal(at[k], after[k]) for k in at) and all(after[k].isfinite().all() for k in after)
