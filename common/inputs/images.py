"""Image + text rows for vision-language fine-tuning, in TRL's formats: `messages` with content parts
(`{"type": "image"}`, `{"type": "text", "text": ...}`) and an `images` column, or prompt/completion rows with images.
Images are paths (relative to the data file), bytes (parquet, `datasets`' Image features) or hub Image features.

Up front, cheaply, every row is checked (images readable, as many placeholders as images) and its text tokenized with
the labels of its assistant turns (common/inputs/responses.py, as for text SFT); the images are only opened for their
size, which gives each row's length after the processor expands its image placeholders. The pixels are decoded and
processed in the DataLoader's collate (`ImageTextCollator`, in its workers), where the processor's own expansion is
aligned with the text's labels: image placeholders and other vision tokens never carry a label.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import io
import os

import torch
from accelerate import Accelerator

from common.errors import fail
from common.inputs.responses import chat_problem, render_chat, tokenize_with_response_labels

VISION_TOKEN_NAMES = ("image_token", "boi_token", "eoi_token", "vision_start_token", "vision_end_token",
                      "fake_image_token", "global_image_token", "video_token", "image_start_token", "image_end_token")


def as_messages(row: dict, columns: argparse.Namespace) -> tuple[list[dict] | None, int]:
    """A row as chat turns, and how many of them are the prompt (no loss on those): `messages`, or the prompt's
    turns followed by the completion's. A plain-text prompt becomes a user turn with the row's images first (as TRL
    does); a plain-text completion an assistant turn."""
    if row.get(columns.messages_column) is not None:
        return row[columns.messages_column], 0
    prompt, completion = row.get(columns.prompt_column), row.get(columns.completion_column)
    if prompt is None or completion is None:
        return None, 0
    if isinstance(prompt, str):
        parts = [{"type": "image"} for _ in images_of(row, columns)] + [{"type": "text", "text": prompt}]
        prompt = [{"role": "user", "content": parts}]
    if isinstance(completion, str):
        completion = [{"role": "assistant", "content": [{"type": "text", "text": completion}]}]
    return list(prompt) + list(completion), len(prompt)


def images_of(row: dict, columns: argparse.Namespace) -> list:
    """The row's images as listed (`images`, or one `image`); a missing column gives none."""
    value = row.get(columns.images_column)
    if value is None and columns.images_column == "images":
        value = row.get("image")
        value = [] if value is None else [value]
    return list(value or [])


def count_placeholders(messages: list[dict]) -> int:
    return sum(1 for turn in messages if isinstance(turn.get("content"), list)
               for part in turn["content"] if isinstance(part, dict) and part.get("type") == "image")


def open_image(image, folder: str):
    """A PIL image (not decoded yet) from a path relative to `folder`, bytes, a `datasets` Image dict or a PIL image."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    if isinstance(image, (bytes, bytearray)):
        return Image.open(io.BytesIO(image))
    return Image.open(os.path.join(folder, image))


def image_problem(row: dict, columns: argparse.Namespace, folder: str) -> str | None:
    """What makes a row unusable, or None: bad chat turns, placeholders that do not match the images, an image
    that is missing or not an image (only its header is read)."""
    messages, prompt_turns = as_messages(row, columns)
    if messages is None:
        return f"has no '{columns.prompt_column}' or '{columns.completion_column}'"
    problem = chat_problem(messages, columns.messages_column, prompt_turns, text_only=False)
    if problem:
        return problem
    images, placeholders = images_of(row, columns), count_placeholders(messages)
    if placeholders != len(images):
        return (f"has {placeholders} image placeholder(s) ({{\"type\": \"image\"}} parts) but {len(images)} image(s) "
                f"in '{columns.images_column}'")
    for number, image in enumerate(images, 1):
        try:
            open_image(image, folder).size
        except (OSError, ValueError, TypeError, AttributeError) as e:
            return f"image {number} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    return None


def check_takes_images(config) -> None:
    if getattr(config, "vision_config", None) is None:
        fail(f"the model ({config.model_type}) takes no images: give a vision-language model "
             "(AutoModelForImageTextToText), or use scripts/finetune_causal_lm.py for text")


def load_processor(name: str, flag: str):
    """The model's `AutoProcessor`. A processor with a part that needs a library not installed is one line: Qwen2-VL's
    and Qwen2.5-VL's need torchvision for their video processor, even to take images (docs/vlm.md)."""
    from transformers import AutoProcessor

    from common.inputs import from_pretrained_or_fail

    try:
        return from_pretrained_or_fail(AutoProcessor.from_pretrained, name, flag)
    except ImportError as e:
        needs = " ".join(str(e).split()).split(" but ")[0]  # "Qwen2VLVideoProcessor requires the Torchvision library"
        fail(f"{flag} {name}: its processor cannot load here: {needs}, which is not installed (torchvision: a build "
             f"for torch {torch.__version__}; see docs/vlm.md)")


def check_processor(processor) -> None:
    """A vision-language processor whose image token is one token of its tokenizer."""
    token = getattr(processor, "image_token", None)
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is None or getattr(processor, "image_processor", None) is None:
        fail(f"{type(processor).__name__} is not a vision-language processor (it needs a tokenizer and an image "
             "processor)")
    if token is None or token not in tokenizer.get_vocab():
        fail(f"the processor's image token {token!r} is not a token of its tokenizer: add it "
             "(tokenizer.add_special_tokens) and save the processor again")


def vision_token_ids(processor, config) -> set[int]:
    """The ids of image placeholders and vision start/end tokens: never a label."""
    vocab = processor.tokenizer.get_vocab()
    ids = {vocab[t] for t in (getattr(processor, name, None) for name in VISION_TOKEN_NAMES) if isinstance(t, str)
           and t in vocab}
    return ids | {v for k, v in vars(config).items() if isinstance(v, int) and k.endswith("_token_id") and
                  any(word in k for word in ("image", "vision", "video"))}


def image_token_counts(processor, sizes: list[tuple[int, int]]) -> list[int] | None:
    """The tokens each image of these (height, width) sizes becomes, without decoding it: the processors' own count
    (`_get_num_multimodal_tokens`, which vLLM uses too; None for a processor without it)."""
    if not sizes:
        return []
    count = getattr(processor, "_get_num_multimodal_tokens", None)
    try:
        return list(count(image_sizes=sizes).num_image_tokens) if count else None
    except (NotImplementedError, AttributeError, TypeError, KeyError):
        return None


def tokenize_image_rows(batch: dict, processor, columns: argparse.Namespace, folder: str) -> dict:
    """`datasets.map` function: the rendered text, its token ids with assistant-turn labels (one token per image
    placeholder), the images (path or bytes) and the length once the processor expands the placeholders."""
    out = {"text": [], "input_ids": [], "labels": [], "images": [], "length": []}
    tokenizer = processor.tokenizer
    for i in range(len(next(iter(batch.values())))):
        row = {k: v[i] for k, v in batch.items()}
        messages, prompt_turns = as_messages(row, columns)
        text, spans = render_chat(processor, messages, join_parts=False)
        spans = spans[sum(turn["role"] == "assistant" for turn in messages[:prompt_turns]):]
        ids, labels = tokenize_with_response_labels(tokenizer, text, spans, plain_text=False)
        images = [image_reference(image, folder) for image in images_of(row, columns)]
        counts = image_token_counts(processor, [open_image(image["path"] or image["bytes"], folder).size[::-1]
                                                for image in images])
        out["text"].append(text)
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["images"].append(images)
        out["length"].append(len(ids) - len(images) + sum(counts) if counts is not None else len(ids))
    return out


def image_reference(image, folder: str) -> dict:
    """{"path", "bytes"} as `datasets`' Image(decode=False) stores it; a path made absolute (workers, resumes)."""
    if isinstance(image, dict):
        path = image.get("path")
        return {"path": None if image.get("bytes") or not path else os.path.join(folder, path),
                "bytes": image.get("bytes")}
    if isinstance(image, str):
        return {"path": os.path.join(folder, image), "bytes": None}
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # a decoded hub image: kept as bytes, decoded again in the collate
    return {"path": None, "bytes": buffer.getvalue()}


def row_cutting_an_image(data, max_length: int, vision_ids: set[int]) -> tuple[int, int] | None:
    """(row, length) of the first row that `max_length` would cut inside or before one of its images' tokens."""
    for index, (ids, length) in enumerate(zip(data["input_ids"], data["length"])):
        if length > max_length:
            extra = length - len(ids)  # the expansion of the placeholders, all before the last one's end
            last = max((i for i, t in enumerate(ids) if t in vision_ids), default=-1)
            if last >= 0 and last + 1 + extra > max_length:
                return index, length
    return None


class ImageTextCollator:
    """Rows -> a padded batch: images decoded and processed here (in the DataLoader's workers), the text through the
    processor, which expands each placeholder into the image's tokens; labels carried over from the text's tokens,
    -100 on every token the expansion added, on vision tokens and on padding; rows cut at `max_length` (after their
    last image: longer rows were refused up front)."""

    def __init__(self, processor, vision_ids: set[int], max_length: int | None, pad_to_multiple_of: int,
                 vision_in_every_batch: bool = False) -> None:
        self.processor = copy.copy(processor)
        self.processor.tokenizer = copy.copy(processor.tokenizer)
        self.processor.tokenizer.padding_side = "right"  # positions count from the left
        self.vision_ids, self.max_length, self.multiple = vision_ids, max_length, pad_to_multiple_of
        self.vision_in_every_batch = vision_in_every_batch

    def __call__(self, rows: list[dict]) -> dict:
        images = [[open_image(image["bytes"] or image["path"], "").convert("RGB") for image in row["images"]]
                  for row in rows]
        has_images = any(images)
        if has_images and not all(images):  # processors take a flat list when some rows have none
            images = [image for row_images in images for image in row_images]
        batch = self.processor(text=[row["text"] for row in rows], images=images if has_images else None,
                               padding=True, pad_to_multiple_of=self.multiple, return_tensors="pt")
        labels = torch.full_like(batch["input_ids"], -100)
        for i, row in enumerate(rows):
            expanded = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
            labels[i, :len(expanded)] = torch.tensor(self.align(row["input_ids"], row["labels"], expanded))
        batch["labels"] = labels
        if self.max_length and batch["input_ids"].shape[1] > self.max_length:
            length = batch["input_ids"].shape[1]
            for key, value in batch.items():
                if torch.is_tensor(value) and value.dim() == 2 and value.shape[1] == length and key != "pixel_values":
                    batch[key] = value[:, :self.max_length]
        if self.vision_in_every_batch and not has_images:
            batch = self.with_blank_image(batch)
        return dict(batch)

    def with_blank_image(self, batch) -> dict:
        """The batch with a blank image's tokens after its padding: no token attends to them and none is labelled, so
        the loss and the gradients are those without them (up to summation order), but the vision encoder runs. Under ZeRO and FSDP a process whose
        batch skipped the encoder would leave the others waiting in its collectives (LLaMA-Factory adds such a fake
        image for the same reason)."""
        from PIL import Image

        blank = self.processor(text=[self.processor.image_token], images=[Image.new("RGB", (32, 32))],
                               return_tensors="pt")
        added = blank["input_ids"].shape[1]
        filler = {"input_ids": self.processor.tokenizer.pad_token_id or 0, "labels": -100}
        shape = batch["input_ids"].shape
        for key, value in list(batch.items()):
            if torch.is_tensor(value) and value.shape == shape:
                tail = torch.full((value.shape[0], -(-added // self.multiple) * self.multiple), filler.get(key, 0),
                                  dtype=value.dtype)
                if key in blank and key != "attention_mask":
                    tail[0, :added] = blank[key][0]
                batch[key] = torch.cat([value, tail], dim=1)
        batch.update({key: value for key, value in blank.items() if key not in batch})
        return batch

    def align(self, ids: list[int], labels: list[int], expanded: list[int]) -> list[int]:
        """The labels of `ids` carried over to the processor's `expanded` ids: the text's tokens match one to one,
        and what the expansion inserted or replaced (placeholders only) gets -100."""
        out = [-100] * len(expanded)
        matcher = difflib.SequenceMatcher(None, ids, expanded, autojunk=False)
        for tag, a0, a1, b0, b1 in matcher.get_opcodes():
            if tag == "equal":
                out[b0:b1] = [-100 if t in self.vision_ids else label for t, label in zip(ids[a0:a1], labels[a0:a1])]
            elif any(t not in self.vision_ids for t in ids[a0:a1]):
                raise ValueError("the processor tokenizes the rendered conversation differently from its tokenizer "
                                 f"(text tokens {ids[a0:a1][:8]} became {expanded[b0:b1][:8]})")
        return out


@torch.no_grad()
def evaluate_image_text(model, dataloader, accelerator: Accelerator) -> dict[str, float]:
    """Held-out token-mean loss on the answers, and answer accuracy: the share of rows whose every answer token
    (its end-of-turn token included) is the model's most likely next token, i.e. the rows greedy decoding answers
    exactly. One forward per batch, so it runs as training does under every engine; per-row figures go through
    `gather_for_metrics` (the same for any number of processes)."""
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=accelerator.device)  # loss sum, tokens, right rows, rows
    for batch in dataloader:
        labels = batch.pop("labels")
        logits = model(**batch, use_cache=False).logits[:, :-1].float()
        targets = labels[:, 1:]
        per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100,
                                                      reduction="none")
        answered = targets != -100
        right = ((logits.argmax(-1) == targets) | ~answered).all(1)
        sums, counts, rights = accelerator.gather_for_metrics((per_token.sum(1), answered.sum(1), right))
        totals += torch.stack([sums.double().sum(), counts.double().sum(), rights.double().sum(),
                               torch.tensor(float(len(rights)), device=accelerator.device)])
    model.train()
    loss_sum, tokens, right, rows = totals.tolist()
    return {"eval_loss": loss_sum / max(tokens, 1), "eval_accuracy": right / max(rows, 1), "eval_tokens": int(tokens)}


def sample_answer(folder: str, row: dict, columns: argparse.Namespace, data_folder: str) -> tuple[str, str, str]:
    """(question, answer, the row's answer) from the exported model in `folder`, reloaded with the Auto classes: greedy, on the first
    held-out row's prompt turns."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from common.inputs.modeling import outside_zero3

    processor = AutoProcessor.from_pretrained(folder)
    messages, prompt_turns = as_messages(row, columns)
    last_answer = max(i for i, turn in enumerate(messages) if turn["role"] == "assistant")
    prompt = messages[:prompt_turns or last_answer]
    images = [open_image(image, data_folder).convert("RGB") for image in images_of(row, columns)]
    text = processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    # This process alone: under ZeRO-3 the model is not built partitioned, and generate() does not step in lockstep
    # with the other processes (synced_gpus: an all_reduce a token that they never join; the run hung there)
    with outside_zero3(), torch.no_grad():
        model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
        generated = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = processor.tokenizer.decode(generated[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    question = " ".join(part.get("text") or "" for turn in prompt if isinstance(turn["content"], list)
                        for part in turn["content"]) or str(prompt[-1]["content"])
    reference = messages[last_answer if not prompt_turns else prompt_turns]["content"]
    reference = reference if isinstance(reference, str) else " ".join(p.get("text") or "" for p in reference)
    return question.strip(), answer.strip(), reference.strip()
