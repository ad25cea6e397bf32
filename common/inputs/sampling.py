"""Completions sampled with transformers' `generate` (KV cache, eval mode, no gradient), each from its own noise: a
completion depends only on (seed, optimizer step, prompt, generation index), never on the batch it was generated in,
the number of processes or a resume (scripts/finetune_grpo.py, docs/grpo.md).

`generate(do_sample=True)` draws from the global RNG, so a completion would depend on what was drawn before it (other
rows, other micro-batches, the process count). Here each completion has its own uniforms, one per position, drawn
from a generator seeded by its key; at every step the next token is the inverse CDF of the filtered distribution
(temperature, top-k, top-p, min-p: transformers' own warpers) at that uniform, and `generate` runs greedy on a score
row that only this token does not mask. The distribution sampled is the one `do_sample=True` samples.
"""

from __future__ import annotations

import hashlib

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)


def slot_uniforms(key: tuple, length: int) -> torch.Tensor:
    """`length` uniforms in [0, 1) from a generator seeded by the key (e.g. seed, step, prompt, generation)."""
    seed = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") >> 1
    return torch.rand(length, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


class SeededSampling(LogitsProcessor):
    """Row i's token at completion position t: the warped distribution's inverse CDF at `uniforms[i, t]`; every
    other score is -inf, so that greedy decoding takes it."""

    def __init__(self, uniforms: torch.Tensor, prompt_length: int, warpers: list) -> None:
        self.uniforms, self.prompt_length, self.warpers = uniforms, prompt_length, warpers

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        cdf = scores.double().softmax(-1).cumsum(-1)
        u = self.uniforms[:, input_ids.shape[1] - self.prompt_length].unsqueeze(1) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, u, right=True).clamp(max=scores.shape[-1] - 1)
        return torch.full_like(scores, -torch.inf).scatter_(1, tokens, 0.0)


def warpers(temperature: float, top_k: int, top_p: float, min_p: float | None) -> list:
    """transformers' sampling filters, in `generate`'s order."""
    found = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
    found += [TopKLogitsWarper(top_k)] if top_k else []
    found += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    return found + ([MinPLogitsWarper(min_p)] if min_p else [])


@torch.no_grad()
def sample(module, prompts: list[list[int]], keys: list[tuple], max_new_tokens: int, filters: list, pad_id: int,
           eos_id: int, synced: bool = False) -> dict[str, torch.Tensor]:
    """Left-pad the prompts, generate a completion for each from its key's uniforms; returns `prompt_ids`
    (B x P, left-padded), `prompt_mask`, `completion_ids` (B x C, C <= max_new_tokens, pad after EOS),
    `completion_mask` (1 through the first EOS) and `truncated` (no EOS). `synced`: every process keeps stepping until
    all are done (ZeRO-3 and FSDP2 gather weights layer by layer in each forward, together)."""
    device = next(module.parameters()).device
    width = max(len(p) for p in prompts)
    prompt_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    uniforms = torch.stack([slot_uniforms(key, max_new_tokens) for key in keys]).to(device)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                              eos_token_id=eos_id, use_cache=True)
    was_training = module.training
    module.eval()
    with torch.compiler.set_stance("force_eager"):  # shapes change every step: generation stays eager
        out = module.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config,
                              logits_processor=LogitsProcessorList([SeededSampling(uniforms, width, filters)]),
                              synced_gpus=synced)
    module.train(was_training)
    completion = out[:, width:]
    is_eos = completion == eos_id
    ends = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion.shape[1])
    completion_mask = (torch.arange(completion.shape[1], device=device) <= ends.unsqueeze(1)).long()
    completion_mask = completion_mask[:, :completion.shape[1]]
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion,
            "completion_mask": completion_mask, "truncated": ~is_eos.any(1)}
