#!/usr/bin/env python
"""What a mixture costs the data path: tokens/s of reading, tokenizing, packing and batching one corpus against the
same text as three sources, map-style and streaming (no model, no training step).

    python benchmarks/mixture_data_path.py --output_dir /tmp/mixture-bench --repeats 3

The text is the embedded default corpus (this Python's standard library sources, ~6 MB), once as one file and once
cut into three files of about a third each, mixed with the weights of their token shares. Map-style: the recipe's
`load_mixed_blocks` (tokenized and packed from scratch: the datasets cache is off) and one pass of its DataLoader;
streaming: the recipe's streams (`load_streams`, `packed_blocks`, `mix_streams`) read through a StatefulDataLoader
for twice as many blocks as the map-style pass had (the corpus twice: sources repeat). Documents are cut to 2,000
characters, so that each source holds thousands. The tokenizer is trained once beforehand and passed by path. Runs
alternate (one source, three sources) `--repeats` times; the table gives the median tokens/s and the spread. Prints
one Markdown table and writes it, with the settings, to <output_dir>/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import datasets  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from transformers import default_data_collator  # noqa: E402

from common.errors import fail  # noqa: E402
from common.flags import ArgumentParser, add_data_args, add_model_args, add_training_args  # noqa: E402
from common.features.streaming import load_streams, mix_streams, packed_blocks  # noqa: E402
from common.inputs.data import build_default_corpus, train_bpe_tokenizer  # noqa: E402
from common.inputs.mixture import Mixture, add_mixture_args, load_mixed_blocks, read_sources  # noqa: E402

BLOCK, BATCH = 256, 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", required=True, help="Where the corpus parts, the tokenizer and results go.")
    parser.add_argument("--repeats", type=int, default=3, help="Runs of each case, alternating.")
    parser.add_argument("--max_bytes", type=int, default=6_000_000, help="Bytes of the default corpus used.")
    args = parser.parse_args()
    if args.repeats < 1:
        fail(f"--repeats must be >= 1 (got {args.repeats})")
    return args


def write_corpus(output_dir: str, max_bytes: int) -> dict[str, list[str]]:
    """The default corpus as one file and as three of about a third of its rows each: {"one": [...], "three": [...]}."""
    corpus = build_default_corpus(os.path.join(output_dir, "cache"), max_bytes)
    with open(corpus["train"], encoding="utf-8") as f:  # documents of 2,000 characters: thousands per source
        texts = [json.loads(line)["text"] for line in f]
    rows = [json.dumps({"text": t[i:i + 2000]}) + "\n" for t in texts for i in range(0, len(t), 2000)]
    parts = {"one": [rows], "three": [rows[i::3] for i in range(3)]}
    files = {}
    for case, chunks in parts.items():
        files[case] = []
        for i, chunk in enumerate(chunks):
            path = os.path.join(output_dir, f"{case}-part{i}.jsonl")
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(chunk)
            files[case].append(path)
    return files


def recipe_args(files: list[str], tokenizer: str, cache_dir: str, weights: list[float], streaming: bool):
    """The pretraining recipe's data flags (common/flags.py, common/inputs/mixture.py) for these files."""
    parser = ArgumentParser()
    add_model_args(parser)
    add_data_args(parser, files="+")
    add_training_args(parser)
    add_mixture_args(parser)
    parser.add_argument("--block_size", type=int, help="Tokens per block.")
    parser.add_argument("--tokenizer_vocab_size", type=int, help="Unused: the tokenizer is given.")
    argv = ["--train_file", *files, "--tokenizer_name", tokenizer, "--block_size", str(BLOCK), "--cache_dir",
            cache_dir, "--validation_split_percentage", "1", "--per_device_train_batch_size", str(BATCH)]
    args = parser.parse_args(argv + (["--mixture_weights", *map(str, weights)] if len(files) > 1 else []))
    args.streaming = streaming
    return args


def time_map_style(args, accelerator) -> tuple[float, int]:
    start = time.perf_counter()
    _, train, _, _ = load_mixed_blocks(args, accelerator, None, read_sources(args))
    blocks = sum(len(batch["input_ids"]) for batch in DataLoader(train, batch_size=BATCH,
                                                                  collate_fn=default_data_collator))
    return blocks * BLOCK / (time.perf_counter() - start), blocks


def time_streaming(args, tokenizer, blocks: int) -> float:
    """`blocks` blocks of the stream: twice the corpus, so that each source's tokenizing in batches of 1,000
    documents (three sources hold three batches in flight, one source one) evens out over passes."""
    start = time.perf_counter()
    sources = read_sources(args)
    streams = [packed_blocks(load_streams(s, args.validation_split_percentage, None, None)[0], s, tokenizer, BLOCK)
               for s in sources]
    mixed = mix_streams(streams, Mixture(sources, None, "repeat", args.seed))
    loader = StatefulDataLoader(mixed if len(sources) > 1 else mixed.repeat(None), batch_size=BATCH,
                                collate_fn=default_data_collator)
    seen = 0
    for batch in loader:
        seen += len(batch["input_ids"])
        if seen >= blocks:
            break
    return seen * BLOCK / (time.perf_counter() - start)


def main() -> None:
    args = parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    datasets.disable_caching()  # every map-style run tokenizes from scratch
    files = write_corpus(args.output_dir, args.max_bytes)
    with open(files["one"][0], encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    tokenizer_dir = os.path.join(args.output_dir, "tokenizer")
    tokenizer = train_bpe_tokenizer(texts, 8192)
    tokenizer.save_pretrained(tokenizer_dir)
    sizes = {case: [os.path.getsize(p) for p in paths] for case, paths in files.items()}
    weights = {case: [s / sum(sizes[case]) for s in sizes[case]] for case in files}
    accelerator = Accelerator(cpu=True)
    results = {(case, path): [] for case in files for path in ("map-style", "streaming")}
    for _ in range(args.repeats):
        for case in files:
            cache = os.path.join(args.output_dir, f"cache-{case}")
            rate, blocks = time_map_style(recipe_args(files[case], tokenizer_dir, cache, weights[case], False),
                                          accelerator)
            results[(case, "map-style")].append(rate)
            streaming = recipe_args(files[case], tokenizer_dir, cache, weights[case], True)
            results[(case, "streaming")].append(time_streaming(streaming, tokenizer, 2 * blocks))
    lines = ["| data path | sources | tokens/s (median) | spread |", "|---|---|---|---|"]
    for (case, path), rates in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0] == "three")):
        lines.append(f"| {path} | {1 if case == 'one' else 3} | {statistics.median(rates):,.0f} | "
                     f"{min(rates):,.0f}-{max(rates):,.0f} |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump({"table": table, "repeats": args.repeats, "max_bytes": args.max_bytes, "block_size": BLOCK,
                   "batch": BATCH, "machine": platform.platform(), "cpus": os.cpu_count(),
                   "rates": {f"{c}/{p}": r for (c, p), r in results.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
