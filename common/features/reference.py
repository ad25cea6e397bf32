"""The frozen reference's optional parts: the copy placed on DeepSpeed and FSDP2 as the policy is (DPO and GRPO), and
DPO's --precompute_ref_log_probs, its values computed once after `prepare` and kept in a cache entry.

The entry is a folder of common/inputs/cache.py (written whole or not at all, every file checksummed; a damaged one
is rebuilt, with one line in the log), keyed by what the values depend on, by content: the base model's weights as
the resume guard fingerprints them (each weight file's xxh3-64; a hub id's resolved revision), its config, the
reference's settings (4-bit base, attention kernel, chunked head), the tokenized pairs themselves and the precision.
A base rewritten in place with its mtime kept, a hub id whose branch moved, or other pairs give another key: the
stale entry is never read. The entry's manifest records its key and the rows its values cover, so another entry
moved or copied under this key's folder name (another base's, the other split's) is rebuilt as a damaged one is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from functools import partial

import pyarrow as pa
import torch
import xxhash
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, broadcast_object_list
from tqdm.auto import tqdm

from common.features.resume_guard import base_model_fingerprint
from common.inputs.cache import cached_folder, entry_problem

logger = get_logger(__name__)
VALUES = "reference_logps.pt"  # per pair row: (chosen, rejected), indexed by the row's position in its file
SETTINGS = ("use_peft", "load_in_4bit", "bnb_4bit_quant_type", "use_bnb_nested_quant", "attn_implementation",
            "chunked_cross_entropy")  # those a run has (a copy without LoRA has none of LoRA's)


def shard_reference(accelerator, reference: torch.nn.Module):
    """The frozen reference placed as the policy is: under DeepSpeed an engine for inference (ZeRO-3 keeps its
    parameters partitioned, gathered layer by layer in its forward; other stages a whole copy per process, no
    optimizer), under FSDP2 `fully_shard` per decoder layer, on the device."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        import deepspeed

        stage = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "bf16": {"enabled": accelerator.mixed_precision == "bf16"},
                  "fp16": {"enabled": accelerator.mixed_precision == "fp16"},
                  "zero_optimization": {"stage": 3 if stage == 3 else 0}}
        engine, *_ = deepspeed.initialize(model=reference, config=config)
        engine.eval()
        return engine
    from torch.distributed.fsdp import fully_shard

    for layer in getattr(getattr(reference, "model", None), "layers", []):
        fully_shard(layer)
    return fully_shard(reference)


def precompute_reference(args: argparse.Namespace, accelerator, config, forward, data, collators) -> None:
    """--precompute_ref_log_probs: for each split, the reference's values from the cache entry, else from one pass
    of `forward` (batch -> each row's summed response log-probability) then written to the entry; into the split's
    collator. The main process reads the entry and hands the values to the others (a per-node --cache_dir agrees)."""
    settings = [getattr(args, name, None) for name in SETTINGS]
    base = base_model_fingerprint(args.model_name_or_path, config)
    if base and "weights_xxh3_64" in base:  # a local folder: its content, wherever it lies
        base = base["weights_xxh3_64"]
    model = [base, config.to_dict(), settings, accelerator.mixed_precision]
    for split in ("train", "validation"):
        dataset = data[split].remove_columns("length")
        key = json.dumps([model, pairs_checksum(dataset)], sort_keys=True, default=str)
        path = os.path.join(args.cache_dir, f"dpo-reference-{hashlib.sha256(key.encode()).hexdigest()[:16]}")
        rows = max(dataset["index"]) + 1  # the values' rows: one per row of the split's file up to its last pair
        values = read_values(path, key, rows) if accelerator.is_main_process else None
        values = broadcast_object_list([values])[0] if accelerator.num_processes > 1 else values
        if values is None:
            values = compute_values(args, accelerator, forward, dataset, collators[split], split)
            if accelerator.is_main_process:
                cached_folder(path, partial(write_values, values), f"the reference's {split} log-probabilities",
                              key, rows)
        collators[split].reference_logps = values
    accelerator.wait_for_everyone()


def compute_values(args: argparse.Namespace, accelerator, forward, dataset, collate, split: str) -> torch.Tensor:
    """One pass over the split, each process a share of the pairs in lockstep (ZeRO-3 and FSDP2 gather weights
    together): every process runs as many batches as the largest share, a smaller share filled up with repeats of
    pair 0 that are left out of the result (a process may have no pair of its own)."""
    rank, count = accelerator.process_index, accelerator.num_processes
    mine = list(range(rank, len(dataset), count))
    share = -(-len(dataset) // count)
    own = [1.0] * len(mine) + [0.0] * (share - len(mine))
    mine += [0] * (share - len(mine))
    originals = dataset["index"]  # each pair's row before pairs were dropped: what the collator looks up
    rows = []
    for start in tqdm(range(0, share, args.per_device_eval_batch_size), desc=f"Reference log-probs ({split})",
                      disable=not accelerator.is_local_main_process):
        indices = mine[start:start + args.per_device_eval_batch_size]
        batch = {k: v.to(accelerator.device) for k, v in collate([dataset[i] for i in indices]).items()}
        with torch.no_grad():
            logps = forward(batch).float().double()
        keys = torch.tensor([originals[i] for i in indices], device=logps.device, dtype=torch.float64)
        kept = torch.tensor(own[start:start + len(indices)], device=logps.device, dtype=torch.float64)
        rows.append(torch.stack([keys, kept, *logps.chunk(2)], 1))
    gathered = accelerator.gather(torch.cat(rows)).cpu()
    gathered = gathered[gathered[:, 1] == 1]
    values = torch.zeros(max(originals) + 1, 2)
    values[gathered[:, 0].long()] = gathered[:, 2:].float()
    return values


def pairs_checksum(dataset) -> str:
    """xxh3-64 of the tokenized pairs (every column's values and each row's length), read from Arrow in batches."""
    digest = xxhash.xxh3_64()
    for table in dataset.with_format("arrow").iter(batch_size=10_000):
        for name in sorted(table.column_names):
            column = table.column(name).combine_chunks()
            if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
                digest.update(column.value_lengths().to_numpy(zero_copy_only=False).tobytes())
                column = column.flatten()
            digest.update(name.encode() + column.to_numpy(zero_copy_only=False).tobytes())
    return digest.hexdigest()


def read_values(path: str, key: str, rows: int) -> torch.Tensor | None:
    """The entry's values when it is whole and this key's (its manifest holds and records `key` and `rows`); None
    when missing, damaged or another entry's (then rebuilt)."""
    if entry_problem(path, key, rows) is not None:
        return None
    try:
        return torch.load(os.path.join(path, VALUES), weights_only=True)  # a tensor: nothing to unpickle
    except OSError:  # set aside by another run since the check
        return None


def write_values(values: torch.Tensor, folder: str) -> None:
    with open(os.path.join(folder, VALUES), "wb") as f:
        torch.save(values, f)
        f.flush()
        os.fsync(f.fileno())
