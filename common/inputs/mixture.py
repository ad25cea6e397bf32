"""A weighted mixture of corpora for pretraining (docs/mixtures.md): the sources, read from the flags, a mixture file or
the embedded default and checked before any tokenizing; the order in which their packed blocks are drawn; the
training tokens seen per source; the held-out loss per source.

Weights are shares of training *tokens*: every source is packed into blocks of the same size on its own, and the
mixture draws blocks, so a share of blocks is a share of tokens whatever the sources' document lengths.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import Dataset

from common.errors import fail
from common.evaluation import evaluate_causal_lm
from common.inputs.data import (DATA_EXTENSIONS, Source, build_default_corpus, build_default_docs_corpus,
                               check_data_files)

STOPPING = ("repeat", "first_exhausted")
# The embedded default: the standard library's code and its documentation text (docs/mixtures.md says why).
DEFAULT_WEIGHTS = {"code": 0.7, "docs": 0.3}
MIXTURE_KEYS = {"path", "name", "split", "columns", "weight", "validation_file"}  # a source's keys in a mixture file
STATE_FILE = "mixture_state.json"


def add_mixture_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data mixture")
    g.add_argument("--mixture_weights", type=float, nargs="+",
                   help="One weight per --train_file: shares of training tokens (normalised to sum to 1).")
    g.add_argument("--dataset_mixture", help="A YAML file listing the sources (TRL-style `datasets:` list with path, "
                   "name, split, columns, weight, validation_file); instead of --train_file/--dataset_name.")
    g.add_argument("--mixture_stopping", default="repeat", choices=STOPPING,
                   help="When a source runs out: repeat it (a new shuffled pass) or end the run (first_exhausted).")
    g.add_argument("--new_data_mixture", action="store_true",
                   help="Resume a checkpoint with another mixture (a second stage, e.g. an anneal): weights, "
                        "optimizer and schedule continue, the data order is the new mixture's.")


def source_name(path: str) -> str:
    """A file's name without its extension (`data/web.jsonl` -> `web`); a hub id's last part."""
    base = os.path.basename(os.path.normpath(path))
    return os.path.splitext(base)[0] if os.path.splitext(base)[1].lower() in DATA_EXTENSIONS else base


def read_sources(args: argparse.Namespace) -> list[Source]:
    """The mixture's sources from --dataset_mixture, --train_file (+ --mixture_weights), --dataset_name or the
    embedded default, every one checked (one line naming the source) before any tokenizing."""
    if args.dataset_mixture:
        if args.train_file or args.dataset_name or args.mixture_weights:
            fail("give --dataset_mixture or --train_file/--dataset_name/--mixture_weights, not both")
        sources = read_mixture_file(args.dataset_mixture, args.text_column)
    elif args.train_file:
        files, held_out = args.train_file, args.validation_file or []
        weights = args.mixture_weights or ([1.0] if len(files) == 1 else None)
        if weights is None:
            fail(f"{len(files)} --train_file need --mixture_weights, one per file (shares of training tokens)")
        if len(weights) != len(files):
            fail(f"--mixture_weights has {len(weights)} weights for {len(files)} --train_file: give one per file")
        if held_out and len(held_out) != len(files):
            fail(f"--validation_file has {len(held_out)} files for {len(files)} --train_file: give one per source, "
                 "in the same order")
        sources = [Source(source_name(f), w, f, held_out[i] if held_out else None, text_column=args.text_column)
                   for i, (f, w) in enumerate(zip(files, weights))]
    else:
        if args.mixture_weights or args.validation_file:
            fail(f"--{'mixture_weights' if args.mixture_weights else 'validation_file'} needs --train_file")
        if args.dataset_name:
            sources = [Source(source_name(args.dataset_name), 1.0, dataset_name=args.dataset_name,
                              dataset_config_name=args.dataset_config_name, text_column=args.text_column)]
        else:  # built later (cached), when the data is loaded: a flag check reads no corpus
            sources = [Source(name, w) for name, w in DEFAULT_WEIGHTS.items()]
    check_sources(sources)
    return sources


def check_sources(sources: list[Source]) -> None:
    names = [s.name for s in sources]
    for s in sources:
        if not (math.isfinite(s.weight) and s.weight > 0):
            fail(f"source '{s.name}': weight {s.weight} must be a finite number > 0 (leave a source out instead of "
                 "giving it 0)")
        if names.count(s.name) > 1:
            fail(f"two sources are named '{s.name}' (a source's name is its file's name without the extension): "
                 "rename one file")
        if s.train_file:
            check_data_files(s.train_file, s.validation_file)


def read_mixture_file(path: str, text_column: str) -> list[Source]:
    """The sources of a mixture file: `datasets:`, a list of {path, name, split, columns, weight, validation_file}."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            entries = (yaml.safe_load(f) or {}).get("datasets")
    except (OSError, yaml.YAMLError, AttributeError) as e:
        fail(f"--dataset_mixture {path}: cannot read it as a YAML mapping ({str(e).splitlines()[0]})")
    if not isinstance(entries, list) or not entries:
        fail(f"--dataset_mixture {path}: needs a non-empty `datasets:` list")
    sources = []
    for number, entry in enumerate(entries, 1):
        where = f"--dataset_mixture {path}: source {number}"
        if not isinstance(entry, dict) or "path" not in entry:
            fail(f"{where}: needs a `path` (a data file, a dataset folder or a hub id)")
        unknown = sorted(set(entry) - MIXTURE_KEYS)
        if unknown:
            fail(f"{where} ({entry['path']}): unknown key {', '.join(unknown)} "
                 f"(keys: {', '.join(sorted(MIXTURE_KEYS))})")
        if entry.get("split", "train") != "train":
            fail(f"{where} ({entry['path']}): split '{entry['split']}': only the train split is trained on here")
        try:
            weight = float(entry.get("weight", 1.0))
        except (TypeError, ValueError):
            fail(f"{where} ({entry['path']}): weight {entry['weight']!r} is not a number")
        column = (entry.get("columns") or [text_column])[0]
        local = os.path.splitext(str(entry["path"]))[1].lower() in DATA_EXTENSIONS
        sources.append(Source(source_name(str(entry["path"])), weight, str(entry["path"]) if local else None,
                              entry.get("validation_file"), None if local else str(entry["path"]), entry.get("name"),
                              column))
    return sources


def resolve_default(sources: list[Source], cache_dir: str) -> list[Source]:
    """The embedded default's files (built once, cached); other sources as they are."""
    if any(s.train_file or s.dataset_name for s in sources):
        return sources
    files = {"code": build_default_corpus(cache_dir), "docs": build_default_docs_corpus(cache_dir)}
    return [Source(s.name, s.weight, files[s.name]["train"], files[s.name]["validation"]) for s in sources]


def check_has_text(name: str, texts) -> None:
    """A source whose training rows hold no text at all: one line, before tokenizing."""
    for batch in texts:
        if any(isinstance(t, str) and t.strip() for t in batch):
            return
    fail(f"source '{name}': its training rows hold no text")


def share_counts(weights: list[float], total: int) -> np.ndarray:
    """`total` split in proportion to `weights`, whole numbers that sum to `total` (largest remainders)."""
    exact = np.asarray(weights, dtype=np.float64) / sum(weights) * total
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(-(exact - counts), kind="stable")[:total - counts.sum()]] += 1
    return counts


@dataclass
class Mixture:
    """Where each position of the mixed training stream comes from. An epoch is `epoch_blocks` positions; each epoch
    draws the same number of blocks from each source (`counts`, its weight's share), in the same interleaved order
    (`pattern`: source k's j-th block of the epoch is due at (j + 1/2) / weight_k, blocks are drawn in due order, so
    every prefix of the stream holds each source's share to within a block: Megatron's greedy blend, without a loop).
    Within a source, blocks come from its passes, each a new permutation of its blocks (seed, source, pass); an epoch
    takes the next `counts[k]` of them. `repeat`: an epoch holds as many blocks as the sources together;
    `first_exhausted`: as many as the mixture holds before its first source would need a second pass, and one epoch;
    either cut to a whole number of global batches, so that any split of the batch over processes and accumulation
    steps has the same steps per epoch."""
    sources: list[Source]
    lengths: list[int] | None  # blocks per source (None: streams, whose lengths are unknown)
    stopping: str
    seed: int
    global_batch: int = 1  # an epoch is a whole number of global batches (in blocks): none wraps or is cut
    counts: np.ndarray = field(init=False)
    pattern: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        weights = np.asarray([s.weight for s in self.sources], dtype=np.float64)
        weights /= weights.sum()
        if self.lengths is None:  # a stream: interleaved by `datasets` (common/features/streaming.py)
            return
        if self.stopping == "first_exhausted":
            self.epoch_blocks = int(min(n / w for n, w in zip(self.lengths, weights)))
        else:
            self.epoch_blocks = int(sum(self.lengths))
        self.epoch_blocks = max(self.epoch_blocks // self.global_batch, 1) * self.global_batch
        self.counts = share_counts(list(weights), self.epoch_blocks)
        due = np.concatenate([(np.arange(c) + 0.5) / w for c, w in zip(self.counts, weights)])
        owner = np.repeat(np.arange(len(self.sources)), self.counts)
        self.pattern = owner[np.argsort(due, kind="stable")]
        self.rank = np.empty_like(self.pattern)  # position -> its index among its source's blocks of the epoch
        for k in range(len(self.sources)):
            self.rank[self.pattern == k] = np.arange(self.counts[k])
        self._permutations = {}

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def describe(self) -> list[dict]:
        """What the resume guard compares: a checkpoint continues only with this mixture (or --new_data_mixture)."""
        return [{**s.describe(), "stopping": self.stopping} for s in self.sources]

    def block(self, epoch: int, position: int) -> tuple[int, int]:
        """(source, block index in that source) of `position` in `epoch`."""
        k = int(self.pattern[position])
        n = epoch * int(self.counts[k]) + int(self.rank[position])  # the n-th block drawn from source k, run-wide
        pass_number, index = divmod(n, self.lengths[k])
        return k, int(self.permutation(k, pass_number)[index])

    def permutation(self, source: int, pass_number: int) -> np.ndarray:
        """Source `source`'s order of blocks in its pass `pass_number` (the newest few kept)."""
        key = (source, pass_number)
        if key not in self._permutations:
            if len(self._permutations) > 2 * len(self.lengths):
                self._permutations.pop(next(iter(self._permutations)))
            rng = np.random.default_rng([self.seed, source, pass_number])
            self._permutations[key] = rng.permutation(self.lengths[source])
        return self._permutations[key]

    def blocks_drawn(self, positions: int) -> np.ndarray:
        """Blocks drawn from each source in the first `positions` positions of the stream (epochs one after another;
        past an epoch's end, a loader that evens out its last batch wraps around to the epoch's start)."""
        epochs, rest = divmod(positions, self.epoch_blocks)
        return epochs * self.counts + np.bincount(self.pattern[:rest], minlength=len(self.sources))

    def passes(self, blocks: np.ndarray) -> dict[str, float]:
        """Passes over each source that `blocks` drawn blocks make."""
        return {s.name: round(int(b) / n, 3) for s, b, n in zip(self.sources, blocks, self.lengths or [])}


class MixedBlocks(Dataset):
    """Epoch `set_epoch(e)` of the mixture as a map-style dataset, in the mixture's order (sample it in order: the
    shuffle is the mixture's). accelerate's prepared loader calls `set_epoch` on its dataset at each epoch."""

    def __init__(self, mixture: Mixture, blocks: list) -> None:
        self.mixture, self.blocks, self.epoch = mixture, blocks, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.mixture.epoch_blocks

    def __getitem__(self, position: int) -> dict:
        source, index = self.mixture.block(self.epoch, position)
        return self.blocks[source][index]


class TokensPerSource:
    """`train_tokens/<source>` for the metrics rows, counted from the start of this data stage and added to the
    stages' before it (a second stage: --new_data_mixture), which every checkpoint saves (`mixture_state.json`).
    Map-style, the blocks drawn are a function of the optimizer step (the mixture's order is fixed); a stream counts
    the blocks it hands out (`drawn`: over all processes since the stage's start, restored with its position)."""

    def __init__(self, accelerator, mixture: Mixture, block_size: int, global_batch: int,
                 steps_per_epoch: int | None, drawn=None) -> None:
        self.mixture, self.block_size, self.global_batch = mixture, block_size, global_batch
        self.steps_per_epoch, self.drawn, self.is_main = steps_per_epoch, drawn, accelerator.is_main_process
        self.before, self.stage_start, self.progress = {n: 0 for n in mixture.names}, 0, None
        accelerator.register_save_state_pre_hook(self._save)
        accelerator.register_load_state_pre_hook(self._load)

    def blocks_at(self, step: int) -> np.ndarray:
        """Blocks drawn from each source in this stage by the end of optimizer step `step`."""
        if self.drawn is not None:
            return self.drawn()
        return self.drawn_by(step) - self.drawn_by(self.stage_start)

    def drawn_by(self, step: int) -> np.ndarray:
        """Blocks of each source in the mixture's first `step` optimizer steps (epoch after epoch)."""
        epochs, done = divmod(step, self.steps_per_epoch)
        return epochs * self.mixture.blocks_drawn(self.steps_per_epoch * self.global_batch) + \
            self.mixture.blocks_drawn(done * self.global_batch)

    def at(self, step: int) -> dict[str, int]:
        drawn = self.blocks_at(step) * self.block_size
        return {name: self.before.get(name, 0) + int(n) for name, n in zip(self.mixture.names, drawn)}

    def row(self) -> dict[str, int]:
        """The row's figures (`StepLog.row_extras`; collective on a stream)."""
        return {f"train_tokens/{name}": n for name, n in self.at(self.progress.step).items()}

    def passes(self, step: int) -> dict[str, float]:
        """Passes over each source in this stage (streaming: over this process's share)."""
        return {f"train_passes/{k}": v for k, v in self.mixture.passes(self.blocks_at(step)).items()}

    def _save(self, models, weights, checkpoint_dir: str) -> None:
        tokens = self.at(self.progress.step)  # collective on a stream: every process
        if self.is_main:
            with open(os.path.join(checkpoint_dir, STATE_FILE), "w", encoding="utf-8") as f:
                json.dump({"step": self.progress.step, "mixture": self.mixture.describe(), "train_tokens": tokens,
                           "stage_start": self.stage_start, "before": self.before}, f)

    def _load(self, models, checkpoint_dir: str) -> None:
        path = os.path.join(checkpoint_dir, STATE_FILE)
        if not os.path.isfile(path):  # a checkpoint written before mixtures: one source, counted from 0
            return
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        if state["mixture"] == self.mixture.describe():
            self.before, self.stage_start = state["before"], state["stage_start"]
        else:  # a new stage: it starts at the checkpoint's step with the tokens seen so far
            self.before, self.stage_start = state["train_tokens"], state["step"]


@torch.no_grad()
def evaluate_sources(model, dataloaders: list, names: list[str], accelerator) -> dict[str, float]:
    """The held-out loss over all sources' held-out blocks (token-weighted) and, for a mixture, each source's
    (`eval_loss/<source>`); `dataloaders` in the order of `names`."""
    if len(dataloaders) == 1:
        return evaluate_causal_lm(model, dataloaders[0], accelerator)
    each = {name: evaluate_causal_lm(model, loader, accelerator) for name, loader in zip(names, dataloaders)}
    tokens = sum(m["eval_tokens"] for m in each.values())
    loss = sum(m["eval_loss"] * m["eval_tokens"] for m in each.values()) / max(tokens, 1)
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0)), "eval_tokens": tokens,
            **{f"eval_loss/{name}": m["eval_loss"] for name, m in each.items()}}


def load_mixed_blocks(args: argparse.Namespace, accelerator, resume_from: str | None, sources: list[Source]):
    """The map-style stages: sources -> fast tokenizer (one for all) -> each source tokenized and packed on its own
    (cached by `datasets`) -> the mixture. Returns (tokenizer, mixed training blocks, {source: held-out blocks})."""
    from datasets import DatasetDict, concatenate_datasets

    from common.inputs.data import HeldOut, get_tokenizer, load_raw_datasets, tokenize_and_pack

    sources = resolve_default(sources, args.cache_dir)
    held_out = HeldOut(args.validation_split_percentage, args.seed, args.max_train_samples, args.max_eval_samples)
    raw = {s.name: load_raw_datasets(s, held_out, args.cache_dir) for s in sources}
    for s in sources:
        check_has_text(s.name, (b[s.text_column] for b in raw[s.name]["train"].iter(batch_size=1000)))
    if len(sources) == 1:  # the tokenizer cache key of a one-corpus run stays what it was
        text, texts = sources[0].text_column, raw[sources[0].name]
    else:
        text = "text"
        texts = DatasetDict(train=concatenate_datasets(
            [raw[s.name]["train"].select_columns([s.text_column]).rename_column(s.text_column, text)
             if s.text_column != text else raw[s.name]["train"].select_columns([text]) for s in sources]))
    tokenizer = get_tokenizer(args, accelerator, texts, resume_from, args.tokenizer_vocab_size, text)
    blocks = {s.name: tokenize_and_pack(accelerator, raw[s.name], s, tokenizer, args.block_size,
                                        args.preprocessing_num_workers) for s in sources}
    eval_blocks = {s.name: blocks[s.name]["validation"] for s in sources}
    if len(sources) == 1:  # one corpus: its blocks, for the sampler to shuffle (as before mixtures)
        return tokenizer, blocks[sources[0].name]["train"], eval_blocks, Mixture(
            sources, [len(blocks[sources[0].name]["train"])], args.mixture_stopping, args.seed)
    processes = accelerator.num_processes // getattr(accelerator.parallelism_config, "tp_size", 1)  # tp: one batch
    mixture = Mixture(sources, [len(blocks[s.name]["train"]) for s in sources], args.mixture_stopping, args.seed,
                      args.per_device_train_batch_size * args.gradient_accumulation_steps * processes)
    return tokenizer, MixedBlocks(mixture, [blocks[s.name]["train"] for s in sources]), eval_blocks, mixture
