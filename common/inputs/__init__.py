"""What a copier replaces with their own: the corpora and the embedded default data, the tokenizer, packing, the
model presets and how a model is built. Imports the core (`common.*`), never `common.features`."""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Callable

from common.errors import fail, missing_local_path

# transformers' get_scheduler and LengthGroupedSampler import its Trainer helpers, which import peft whenever it is
# installed, and peft imports bitsandbytes, whose CPU backend warns on CPUs with AVX512-BF16 that the optional
# `kernels` package is missing ("Failed to load CPU gemm_4bit_forward"): a run with no 4-bit layer cannot act on it,
# and a QLoRA run on CPU works without it (docs/lora.md). Only that record is dropped.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward"))


def _draw_each_final_frame_once() -> None:
    """tqdm redraws a finished bar when it closes: in a log, where frames are not drawn over each other, every data
    stage's bar (datasets' `map`) ended with its 100 % line twice. A close whose last frame already counted every item
    now skips the redraw (tests/test_upstream.py fails once tqdm stops redrawing)."""
    from datasets.utils import tqdm as data_bar

    draw = data_bar.display

    def display(self, msg=None, pos=None):
        if self.disable and msg is None and self.n == self.last_print_n:  # close(): the last frame is on screen
            return True
        return draw(self, msg, pos)
    data_bar.display = display


_draw_each_final_frame_once()


def from_pretrained_or_fail(load: Callable, name: str, flag: str):
    """`load(name)` (a `from_pretrained`); a missing folder, a broken config.json or an unknown hub id is one line.

    transformers takes a path that does not exist for a hub id and answers "Repo id must be in the form ...".
    """
    try:
        return load(name)
    except (OSError, ValueError) as e:
        # a JSON file of the folder cut short or edited (config.json first): transformers' error does not name it
        json_files = sorted(glob.glob(os.path.join(glob.escape(name), "*.json")), key=lambda f: f[-12:] != "/config.json")
        for json_file in json_files if os.path.isdir(name) else []:
            try:
                with open(json_file, encoding="utf-8") as f:
                    json.load(f)
            except ValueError as bad:
                fail(f"{flag} {name}: {json_file} is not valid JSON ({bad})")
        if missing_local_path(name):
            fail(f"{flag} {name}: no such folder")
        fail(f"{flag} {name}: {(str(e).strip().splitlines() or [type(e).__name__])[0]}")
