"""Batches of variable-length examples: length-grouped sampling, padding multiples."""

from __future__ import annotations

import warnings

import torch
from accelerate import Accelerator
from transformers.trainer_pt_utils import LengthGroupedSampler

# datasets 5.2's `Dataset.sort` (the validation split sorted by length) passes pyarrow 25 a deprecated option: a
# FutureWarning that is not the user's to act on (tests/test_upstream.py fails once datasets stops passing it).
SORT_NOTICE = "Specifying null_placement in SortOptions is deprecated"
warnings.filterwarnings("ignore", message=SORT_NOTICE, category=FutureWarning)


class EpochLengthGroupedSampler(LengthGroupedSampler):
    """transformers' length-grouped order (shuffle, cut into mega-batches of ~50 batches, sort each by length), made
    reproducible: accelerate calls `set_epoch` before every pass, which reseeds the shuffle. Every process therefore
    draws the same order (accelerate then deals out the batches), and a resumed run draws the same order again.
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int) -> None:
        super().__init__(batch_size, lengths=lengths, generator=torch.Generator())
        self.seed = seed
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.generator.manual_seed(self.seed + epoch)


def pad_to_multiple_of(accelerator: Accelerator) -> int:
    """Tensor cores want sequence lengths in multiples of 8 (16 for fp8 matmuls)."""
    return 16 if accelerator.mixed_precision == "fp8" else 8

