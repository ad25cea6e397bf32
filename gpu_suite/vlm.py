"""The vision-language row (`perf_vlm`, part 2): training steps of scripts/finetune_vlm.py beside TRL's `SFTTrainer`
through benchmarks/vlm_vs_trl.py, on the embedded default's shapes task and a LLaVA-style model built here: the
default's CLIP-like encoder (hidden 64, 2 layers, 17 tokens an image) and projector around a Llama of the 125m
preset's shape (random fp32 weights, seed 0, a BPE tokenizer trained on the task's text; nothing from the hub), bf16
on both sides, 16 rows a step, 12 steps each (the median after the first): images/s, tokens/s and ours over TRL. TRL
must be importable on a GPU (tools/lent_gpu.sh --wheels carries it). The dry run leaves the row out (its plumbing is
the GRPO row's: a benchmark beside TRL); tests/test_finetune_vlm.py checks its command against the recipe's flags."""

from __future__ import annotations

import importlib.util
import json
import math
import os

from benchmarks import vlm_vs_trl
from gpu_suite.suite import FAIL, PASS, Outcome, Row, Suite

NO_TRL_ON_CUDA = "trl is not importable: carry it (tools/lent_gpu.sh --wheels pins trl==1.16.0)"


def prepare(suite: Suite) -> str:
    """The VLM's folder: the default's encoder around a 125m-shaped Llama on a GPU, the default's tiny model on a
    CPU."""
    import torch

    from common.inputs.data import train_bpe_tokenizer
    from common.inputs.shapes import build_shapes_task, build_tiny_vlm
    from gpu_suite.data import save_preset_llama

    cache = os.path.join(suite.work, "cache")
    if not suite.cuda:
        return build_tiny_vlm(cache, None)
    with open(build_shapes_task(cache)[0], encoding="utf-8") as f:
        texts = [part["text"] for line in f for turn in json.loads(line)["messages"] for part in turn["content"]
                 if part["type"] == "text"]
    tokenizer = train_bpe_tokenizer(texts + ["user", "assistant"], 400)
    language_model = os.path.join(suite.work, "data", "vlm-125m-language-model")
    save_preset_llama(language_model, tokenizer, "125m", len(tokenizer), torch.float32)
    return build_tiny_vlm(cache, language_model)


def benchmark_argv(suite: Suite, model: str | None, trl: bool) -> list[str]:
    steps = "12" if suite.cuda else "4"
    argv = ["--steps", steps, "--batch", "16", "--cache_dir", os.path.join(suite.work, "cache")]
    return argv + (["--model_name_or_path", model] if model else []) + ([] if trl else ["--ours_only"])


def check_vlm(suite: Suite) -> Outcome:
    """Ours, then TRL's SFTTrainer: median step times, images/s and tokens/s, ours' speed over TRL's."""
    trl = importlib.util.find_spec("trl") is not None
    if suite.cuda and not trl:
        return Outcome(FAIL, NO_TRL_ON_CUDA)
    model = suite.memo("vlm_model", lambda: prepare(suite))
    try:
        figures = vlm_vs_trl.measure(vlm_vs_trl.parse_args(benchmark_argv(suite, model, trl)))
    except SystemExit as e:
        return Outcome(FAIL, str(e.code).removeprefix("error: ").splitlines()[0][:240])
    ours = figures["ours"]
    figure = (f"ours {1e3 * ours['step_seconds']:,.0f} ms a step, {ours['images_per_second']:,.0f} images/s, "
              f"{ours['tokens_per_second']:,.0f} tokens/s")
    if figures["trl"] is None:
        figure += "; TRL not run: trl is not importable here (ours alone)"
    else:
        theirs = figures["trl"]
        figure += (f"; TRL {1e3 * theirs['step_seconds']:,.0f} ms, {theirs['images_per_second']:,.0f} images/s: ours "
                   f"{figures['speed_vs_trl']:.2f}x TRL's speed")
    figure += (f"; 16 rows a step ({figures['images_per_row']:.2f} images, {figures['tokens_per_row']:.0f} tokens a "
               f"row), {'bf16' if figures['bf16'] else 'fp32'}")
    if not all(math.isfinite(row["step_seconds"]) and row["step_seconds"] > 0
               for row in (ours, figures["trl"]) if row is not None):
        return Outcome(FAIL, f"no step time: {figure}", figures)
    return Outcome(PASS, figure, figures)


def vlm_rows() -> list[Row]:
    return [Row("perf_vlm", 2, "Vision-language: steps of scripts/finetune_vlm.py beside TRL's SFTTrainer "
                "(benchmarks/vlm_vs_trl.py; a tiny encoder around a 125m-shaped Llama, bf16): images/s, tokens/s, "
                "ours over TRL", check_vlm)]
