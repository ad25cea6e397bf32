"""`--streaming`: the corpus read as a `datasets` IterableDataset, tokenized and packed on the fly, resumable exactly.

Nothing is tokenized up front and nothing goes to the datasets cache. Every process reads the whole stream, tokenizes
and packs it with the map-style path's functions (`common/inputs/data.py`), mixes its sources, keeps every N-th block
(N processes) and batches them with torchdata's StatefulDataLoader: the same global batches for any process count.
One pass over a process's share is one epoch of that process. Documents come in stream order,
every pass: `datasets` does not checkpoint a shuffle buffer's content (a resume would drop it), so there is no
shuffle buffer; shuffle the corpus beforehand.

Exact resume: every checkpoint holds, per process, `stream_position_rank<R>.json` — the pass number and the
StatefulDataLoader's state (the `datasets` stream's position, down to the document inside a map batch). The traps
avoided (measured, see docs/streaming.md): the stream is split once (here; accelerate would split it
again when the loader goes through `accelerator.prepare`), and the loader's state is not left to `save_state`
(which writes one file that every rank overwrites).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections.abc import Iterator

import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from datasets import Dataset, IterableDataset, IterableDatasetDict, interleave_datasets, load_dataset
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import PreTrainedTokenizerBase, default_data_collator

from common.inputs.data import block_packer, data_format, document_tokenizer, get_tokenizer
from common.inputs.mixture import Mixture, Source, resolve_default, share_counts
from common.accumulation import accumulation_windows
from common.errors import fail

TOKENIZER_SAMPLE_DOCUMENTS = 10_000  # a tokenizer trained here learns from the stream's first documents
DEFAULT_EVAL_DOCUMENTS = 1_000       # held-out documents when --max_eval_samples is not given


def load_streams(source: Source, held_out_percent: int, max_train: int | None,
                 max_eval: int | None) -> tuple[IterableDataset, IterableDataset]:
    """A source's (train, validation) document streams, from the hub or local files."""
    if source.dataset_name:
        raw = load_dataset(source.dataset_name, source.dataset_config_name, streaming=True)
    else:
        files = {"train": source.train_file, **({"validation": source.validation_file} if source.validation_file
                                                else {})}
        builder = data_format(source.train_file)
        raw = load_dataset(builder, data_files=files, streaming=True,
                           **({"keep_linebreaks": True} if builder == "text" else {}))
    if "train" not in raw:
        fail(f"source '{source.name}': the dataset has no 'train' split (splits: {', '.join(raw)})")
    return split_streams(raw, source.text_column, held_out_percent, max_train, max_eval)


def split_streams(raw: IterableDatasetDict, text_column: str, held_out_percent: int, max_train: int | None,
                  max_eval: int | None) -> tuple[IterableDataset, IterableDataset]:
    """(train, validation): at most `max_eval` (--max_eval_samples) validation documents, at most `max_train`
    (--max_train_samples) training ones.

    Without a validation split, `held_out_percent` (--validation_split_percentage) of the training documents are held
    out, chosen by a hash of their text: the choice depends on no position, so it holds however the stream is split.
    """
    train, validation = raw["train"], raw.get("validation")
    if validation is None:
        if held_out_percent <= 0:
            fail("no validation data: pass --validation_file or a --validation_split_percentage > 0")
        validation = train.filter(lambda row: held_out(row[text_column], held_out_percent))
        train = train.filter(lambda row: not held_out(row[text_column], held_out_percent))
    validation = validation.take(max_eval or DEFAULT_EVAL_DOCUMENTS)
    if max_train:
        train = train.take(max_train)
    return train, validation


def held_out(text: str, percent: int) -> bool:
    """Whether a document without a validation split is held out for validation (stable across runs and machines)."""
    return int(hashlib.md5(text.encode()).hexdigest(), 16) % 100 < percent


def packed_blocks(documents: IterableDataset, source: Source, tokenizer: PreTrainedTokenizerBase,
                  block_size: int) -> IterableDataset:
    """Documents -> token ids (EOS after each) -> `block_size` blocks with labels, lazily, as the map-style path."""
    return (documents.select_columns([source.text_column])
            .map(document_tokenizer(tokenizer, source.text_column, source.train_file), batched=True,
                 remove_columns=[source.text_column])
            .map(block_packer(block_size), batched=True))


def process_blocks(blocks: IterableDataset, rank: int, world_size: int) -> IterableDataset:
    """This process's blocks: every `world_size`-th block of the one stream every process reads, from the `rank`-th.

    Split after tokenizing, packing and mixing, so that the global batches (consecutive blocks of that one stream) are
    the same for any process count and accumulation: 2 processes x 4 train as 1 x 8. The price: every process
    tokenizes every document. (Split by document, before tokenizing, each process packed and mixed its own documents:
    other blocks, and another draw of sources, for each process count.)
    """
    if world_size == 1:
        return blocks
    return blocks.filter(lambda _, index: index % world_size == rank, with_indices=True)


def stream_tokenizer(args: argparse.Namespace, accelerator: Accelerator, sources: list[Source],
                     trains: list[IterableDataset], resume_from: str | None) -> PreTrainedTokenizerBase:
    """--tokenizer_name / the model's tokenizer; else a BPE tokenizer trained on the streams' first documents (of a
    mixture, as many of each source's as its weight's share)."""
    if args.tokenizer_name or args.model_name_or_path:
        return get_tokenizer(args, accelerator, {}, resume_from)
    counts = share_counts([s.weight for s in sources], TOKENIZER_SAMPLE_DOCUMENTS)
    texts = [row[s.text_column] for s, train, n in zip(sources, trains, counts) for row in train.take(int(n))]
    return get_tokenizer(args, accelerator, {"train": Dataset.from_dict({args.text_column: texts})}, resume_from,
                         args.tokenizer_vocab_size, args.text_column)


def mix_streams(blocks: list[IterableDataset], mixture: Mixture) -> IterableDataset:
    """The sources' packed blocks interleaved (`datasets.interleave_datasets`): each block drawn from a source with
    its weight as probability (a share of blocks is a share of tokens), a `source` column saying which; a source that
    runs out is restarted (a new pass)."""
    if len(blocks) == 1:
        return blocks[0]
    blocks = [b.map(lambda batch, k=k: {"source": [k] * len(batch["input_ids"])}, batched=True)
              for k, b in enumerate(blocks)]
    blocks = [b.repeat(None) for b in blocks]  # a source that runs out starts a new pass (never first_exhausted)
    weights = [s.weight / sum(s.weight for s in mixture.sources) for s in mixture.sources]
    return interleave_datasets(blocks, probabilities=weights, seed=mixture.seed, stopping_strategy="first_exhausted")


class StreamingLoader:
    """This process's packed blocks as batches on its device, with its place in the stream saved per process.

    Not a DataLoader on purpose: `accelerator.prepare` passes it through untouched (it would split the stream a
    second time, and `save_state` would save one rank's position for all). `epoch` counts this process's completed
    passes; the checkpoint hooks save and restore it together with the loader's state.
    """

    def __init__(self, accelerator: Accelerator, loader: StatefulDataLoader, sources: int = 1,
                 new_stage: bool = False) -> None:
        # Already this process's share: prepared as one process (device placement only, no second split).
        self.loader = prepare_data_loader(loader, accelerator.device, num_processes=1, process_index=0,
                                          put_on_device=True, dispatch_batches=False, use_stateful_dataloader=True)
        self.batch_size, self.epoch = loader.batch_size, 0
        self.rank, self.world_size = accelerator.process_index, accelerator.num_processes
        self.accelerator, self.new_stage = accelerator, new_stage  # a new stage starts its stream afresh
        self.drawn = torch.zeros(sources, dtype=torch.long, device=accelerator.device)  # blocks per source handed out
        accelerator.register_save_state_pre_hook(self._save)
        accelerator.register_load_state_pre_hook(self._load)

    def __iter__(self) -> Iterator[dict]:
        """One pass (the rest of it, after a resume); `epoch` advances when it ends."""
        for batch in self.loader:
            source = batch.pop("source", None)  # a mixture's: which source each block is from
            self.drawn += torch.bincount(source, minlength=len(self.drawn)) if source is not None else len(
                batch["input_ids"])
            yield batch
        self.epoch += 1

    def blocks_drawn(self):
        """Blocks handed out per source since the data stage began, over all processes (collective)."""
        return self.accelerator.reduce(self.drawn.clone(), "sum").cpu().numpy()

    def step_windows(self, progress, total_steps: int, accumulation_steps: int) -> Iterator[list[dict]]:
        """`common.steps.optimizer_step_windows` for the stream: each iteration is one pass (the rest of one, after a
        resume); passes follow each other until `total_steps`. Two passes in a row without a full window mean the
        stream is too short for one optimizer step."""
        empty_passes = 0
        while progress.step < total_steps:
            windows = 0
            for window in accumulation_windows(self, accumulation_steps):
                windows += 1
                progress.step += 1
                yield window
                if progress.step >= total_steps:
                    return
            empty_passes = 0 if windows else empty_passes + 1
            if empty_passes == 2:  # the first may be the finished pass a checkpoint was taken at
                fail(f"a pass over this process's stream holds fewer than one optimizer step "
                     f"({self.batch_size} x {accumulation_steps} accumulation blocks)")

    def _path(self, checkpoint_dir: str) -> str:
        return os.path.join(checkpoint_dir, f"stream_position_rank{self.rank}.json")

    def _save(self, models, weights, checkpoint_dir: str) -> None:
        state = {"epoch": self.epoch, "world_size": self.world_size, "loader": self.loader.state_dict(),
                 "drawn": self.drawn.tolist()}
        with open(self._path(checkpoint_dir), "w") as f:
            json.dump(state, f)

    def _load(self, models, checkpoint_dir: str) -> None:
        if self.new_stage:  # another mixture's position means nothing to this one: its stream starts at the start
            return
        path = self._path(checkpoint_dir)
        if not os.path.isfile(path):
            fail(f"{checkpoint_dir} holds no stream position for process {self.rank}: resume a --streaming run "
                 "from a --streaming checkpoint, with the same number of processes")
        with open(path) as f:
            state = json.load(f)
        if state["world_size"] != self.world_size:
            fail(f"{checkpoint_dir} was saved by {state['world_size']} processes, this run has {self.world_size}: "
                 "a stream's per-process positions resume only at the same process count")
        finished = state["loader"].get("_iterator_finished")  # saved at the end of a pass: the next starts afresh
        self.epoch = state["epoch"] + 1 if finished else state["epoch"]  # (workers would replay a finished pass)
        # accelerate's loader sets the stream's epoch from its own pass count when iterated, and `datasets` restores a
        # position only in the epoch it was saved in: a fresh count (0) would replay a later pass from its start.
        self.loader.set_epoch(self.epoch)
        self.drawn.copy_(torch.tensor(state.get("drawn", [0] * len(self.drawn))))
        if not finished:
            self.loader.load_state_dict(state["loader"])


def load_streaming_data(args: argparse.Namespace, accelerator: Accelerator, resume_from: str | None,
                        sources: list[Source]) -> tuple[PreTrainedTokenizerBase, StreamingLoader, list, Mixture]:
    """The streaming stages: sources -> documents -> tokenizer -> each source packed on the fly -> the mixture -> this
    process's blocks -> its loader. Returns (tokenizer, this process's training stream, an eval dataloader per source
    over its held-out blocks kept in memory, mixture). The flags are read here; the stages take plain values."""
    sources = resolve_default(sources, args.cache_dir)
    streams = [load_streams(s, args.validation_split_percentage, args.max_train_samples, args.max_eval_samples)
               for s in sources]
    tokenizer = stream_tokenizer(args, accelerator, sources, [train for train, _ in streams], resume_from)
    loader_kwargs = dict(collate_fn=default_data_collator, num_workers=args.dataloader_num_workers,
                         pin_memory=args.dataloader_pin_memory and torch.cuda.is_available())
    eval_loaders = []
    for source, (_, validation) in zip(sources, streams):
        eval_blocks = list(packed_blocks(validation, source, tokenizer, args.block_size))
        if not eval_blocks:
            fail(f"source '{source.name}': the held-out documents hold fewer than --block_size={args.block_size} "
                 "tokens; use more data, a larger --max_eval_samples or a smaller --block_size")
        eval_loaders.append(DataLoader(eval_blocks, batch_size=args.per_device_eval_batch_size, **loader_kwargs))
    mixture = Mixture(sources, None, args.mixture_stopping, args.seed)
    blocks = mix_streams([packed_blocks(train, s, tokenizer, args.block_size) for s, (train, _) in
                          zip(sources, streams)], mixture)
    blocks = process_blocks(blocks, accelerator.process_index, accelerator.num_processes)
    # Its own generator: a new iterator then draws its seed from it, not from the global RNG that dropout uses (a
    # resumed run creates one after the checkpoint's RNG is restored; from that RNG, every later mask would change).
    train_loader = StreamingLoader(accelerator, StatefulDataLoader(
        blocks, batch_size=args.per_device_train_batch_size, generator=torch.Generator(), **loader_kwargs),
        len(sources), args.new_data_mixture)
    return tokenizer, train_loader, eval_loaders, mixture


def add_streaming_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument_group("streaming").add_argument(
        "--streaming", action="store_true",
        help="Read the corpus as a stream: tokenized and packed on the fly, no cache; needs --max_steps.")


def check_streaming_flags(args: argparse.Namespace) -> None:
    if args.streaming and args.max_steps <= 0:
        fail("--streaming needs --max_steps: a stream has no length to count epochs in")
    if args.streaming and getattr(args, "mixture_stopping", None) == "first_exhausted":  # processes would end apart
        fail("--mixture_stopping first_exhausted needs the map-style path: each process's stream would run out at "
             "another step; with --streaming the run ends at --max_steps (sources repeat)")
