"""Throughput, MFU, memory, and the run's outputs: `metrics.jsonl` (one JSON object per logged step) and
`all_results.json` (final figures)."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from contextlib import contextmanager

import torch

# Dense bf16 peak of one GPU (no sparsity), by a substring of its name.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def flops_per_token(config, num_params: int, num_embedding_params: int, seq_len: int) -> float:
    """Training FLOPs per token as torchtitan / PaLM count them: 6 * non-embedding params + attention 12*L*H*Q*T.

    For a mixture of experts only the experts a token visits count (top-k of the expert MLP weights).
    """
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dense = num_params - num_embedding_params
    experts, active = getattr(config, "num_local_experts", 0), getattr(config, "num_experts_per_tok", 0)
    if experts and active:
        expert_params = 3 * config.hidden_size * config.intermediate_size * layers * experts
        dense -= expert_params * (experts - active) // experts
    return 6 * dense + 12 * layers * heads * head_dim * seq_len


def peak_flops_per_device() -> float | None:
    """Dense bf16 peak of this GPU, or None (CPU, or a GPU not in the table): MFU is then not reported."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def peak_memory_bytes() -> int:
    """Peak GPU memory allocated by this process; on CPU, the process's peak resident set size."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class Throughput:
    """Tokens and training seconds since the last report (all processes' tokens; evaluation time excluded)."""

    def __init__(self) -> None:
        self.start, self.tokens = time.perf_counter(), 0

    @contextmanager
    def paused(self):
        """Time spent inside (evaluation, checkpointing) does not count as training time."""
        began = time.perf_counter()
        yield
        self.start += time.perf_counter() - began

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def report(self) -> tuple[float, float]:
        """(tokens per second, seconds) since the last call, then restart."""
        now = time.perf_counter()
        seconds = max(now - self.start, 1e-9)
        rate = self.tokens / seconds
        self.start, self.tokens = now, 0
        return rate, seconds


class MetricsWriter:
    """Appends one JSON object per logged step to `<output_dir>/metrics.jsonl` (main process only)."""

    def __init__(self, output_dir: str, enabled: bool, resume_step: int = 0) -> None:
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.enabled = enabled
        if enabled and os.path.isfile(self.path):
            # A resumed run re-logs the steps after its checkpoint: drop those lines so each step appears once.
            with open(self.path, encoding="utf-8") as f:
                rows = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            with open(self.path, "w", encoding="utf-8") as f:
                f.writelines(rows)

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


def write_all_results(output_dir: str, results: dict) -> None:
    with open(os.path.join(output_dir, "all_results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
