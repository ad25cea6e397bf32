"""The embedded vision-language default: a visual question task drawn with Pillow, and a tiny LLaVA-style model
assembled from configs (nothing downloaded). Both are cache entries (common/inputs/cache.py): written whole or not at
all, and the same on every machine (drawn from fixed seeds).

The task: 1 to 3 shapes (circle, square, triangle) of four colours and two sizes, each in its own quadrant of a small
picture, and one question per picture about the colour or the kind of its first shape, how many shapes there are, or
where its first shape is. Answers are one or two words: a model that does not look at the picture is right at most
one time in four (the most frequent answer of each question), one that reads it is right almost always.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from functools import partial

from common.inputs.cache import cached_folder
from common.inputs.responses import split_files, write_jsonl

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
KINDS = ("circle", "square", "triangle")
QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
QUESTIONS = {"colour": "What colour is the {size} shape?", "kind": "What shape is the {size} one?",
             "count": "How many shapes are there?", "where": "Where is the {size} shape?"}
SPLIT_ROWS = {"train": 2000, "validation": 200}
IMAGE_TOKEN, TURN_START, TURN_END = "<image>", "<|im_start|>", "<|im_end|>"
# Content parts as TRL writes them ({"type": "image"} / {"type": "text", "text": ...}), or a plain string.
CHAT_TEMPLATE = ("{% for m in messages %}" + TURN_START + "{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
                 "{% else %}{% for p in m.content %}{% if p.type == 'image' %}" + IMAGE_TOKEN +
                 "{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}" + TURN_END +
                 "\n{% endfor %}{% if add_generation_prompt %}" + TURN_START + "assistant\n{% endif %}")


def build_shapes_task(cache_dir: str) -> tuple[str, str]:
    """train.jsonl and validation.jsonl (messages + images, paths relative to the files), with their PNGs."""
    key = json.dumps({"rows": SPLIT_ROWS, "questions": QUESTIONS, "version": 1})
    out_dir = os.path.join(cache_dir, "shapes-vqa-" + hashlib.sha256(key.encode()).hexdigest()[:12])
    cached_folder(out_dir, write_shapes_task, "the default visual task", key)
    return split_files(out_dir)


def write_shapes_task(out_dir: str) -> None:
    for seed, (split, path) in enumerate(zip(SPLIT_ROWS, split_files(out_dir))):
        rng, rows = random.Random(seed), []
        for index in range(SPLIT_ROWS[split]):
            image, question, answer = draw_question(rng)
            name = f"{split}-{index:05d}.png"
            image.save(os.path.join(out_dir, name))
            rows.append(json.dumps({"messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]}], "images": [name]}))
        write_jsonl(path, rows)


def draw_question(rng: random.Random):
    """A picture of 1-3 shapes, a question about it and its answer. The first shape is the only large one."""
    from PIL import Image, ImageDraw

    side = rng.choice((32, 40, 48))  # the processor resizes: the pictures need not match the model's size
    image = Image.new("RGB", (side, side), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    count = rng.randint(1, 3)
    quadrants = rng.sample(range(4), count)
    shapes = [(rng.choice(list(COLOURS)), rng.choice(KINDS), quadrant) for quadrant in quadrants]
    for number, (colour, kind, quadrant) in enumerate(shapes):
        half = side // 2
        radius = half * (0.42 if number == 0 else 0.22)
        cx, cy = half * (quadrant % 2) + half / 2, half * (quadrant // 2) + half / 2
        box = (cx - radius, cy - radius, cx + radius, cy + radius)
        if kind == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        elif kind == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        else:
            draw.polygon([(cx, cy - radius), (cx - radius, cy + radius), (cx + radius, cy + radius)],
                         fill=COLOURS[colour])
    topic = rng.choice(list(QUESTIONS))
    colour, kind, quadrant = shapes[0]
    answer = {"colour": colour, "kind": kind, "count": str(count), "where": QUADRANTS[quadrant]}[topic]
    return image, QUESTIONS[topic].format(size="large" if count > 1 else "only"), answer


def build_tiny_vlm(cache_dir: str, language_model: str | None) -> str:
    """A tiny LLaVA-style model (CLIP-like vision encoder, 2-layer projector, Llama) and its processor, saved for
    `AutoModelForImageTextToText` / `AutoProcessor`. The language model (and its tokenizer) is `language_model` when
    that folder holds one (the README pipeline's pretrained tiny Llama), else a fresh one with a tokenizer trained on
    the task's text."""
    key = "tiny-llava|v2|" + (model_fingerprint(language_model) if language_model else "fresh")
    out_dir = os.path.join(cache_dir, "tiny-vlm-" + hashlib.sha256(key.encode()).hexdigest()[:12])
    return cached_folder(out_dir, partial(write_tiny_vlm, cache_dir, language_model), "the default tiny VLM", key)


def model_fingerprint(folder: str) -> str:
    """Its files' names, sizes and modification times: a new pretraining run gives a new entry."""
    return ";".join(f"{name}:{os.path.getsize(os.path.join(folder, name))}:{os.path.getmtime(os.path.join(folder, name))}"
                    for name in sorted(os.listdir(folder)) if os.path.isfile(os.path.join(folder, name)))


def write_tiny_vlm(cache_dir: str, language_model: str | None, out_dir: str) -> None:
    import torch
    from transformers import (AutoModelForCausalLM, AutoTokenizer, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    from common.inputs.data import train_bpe_tokenizer

    if language_model:
        tokenizer = AutoTokenizer.from_pretrained(language_model)
    else:
        with open(build_shapes_task(cache_dir)[0], encoding="utf-8") as f:
            texts = [part["text"] for line in f for turn in json.loads(line)["messages"] for part in turn["content"]
                     if part["type"] == "text"]
        tokenizer = train_bpe_tokenizer(texts + ["user", "assistant"], 400)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, TURN_START, TURN_END]})
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = LlavaImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    # strategy "full": the vision encoder's class token is kept, so each image is 1 + (32 / 8)^2 = 17 tokens
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy="full", image_token=IMAGE_TOKEN,
                               num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    torch.manual_seed(0)
    text_model = AutoModelForCausalLM.from_pretrained(language_model, dtype=torch.float32) if language_model else None
    text_config = text_model.config if text_model else LlamaConfig(
        hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=512)
    text_config.vocab_size = len(tokenizer)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(text_config, name, getattr(tokenizer, name))
    config = LlavaConfig(
        text_config=text_config, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_config=CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, image_size=32, patch_size=8),
        vision_feature_select_strategy="full", vision_feature_layer=-1, projector_hidden_act="gelu")
    model = LlavaForConditionalGeneration(config)
    if text_model:  # the pretrained decoder and head, with rows for the new tokens
        text_model.resize_token_embeddings(len(tokenizer))
        model.model.language_model.load_state_dict(text_model.model.state_dict())
        model.lm_head.load_state_dict(text_model.lm_head.state_dict())
    # generation stops at the end of the assistant's turn, as the chat template writes it
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(TURN_END)]
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
