"""Resumable checkpoints (accelerate `save_state`, at optimizer-step boundaries), the guard that keeps a resume
consistent with its checkpoint, and the Hugging Face export.

Crash safety: a checkpoint is written under a temporary name (`checkpoints/.tmp-step_N`), marked complete once every
process has finished writing, and published by renaming the folder, so a kill at any moment leaves either a complete
`checkpoints/step_N` or a `.tmp-` leftover that no resume ever picks and the next start removes.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import re
import shutil

from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType

from common.divergence import refuse_nonfinite_weights
from common.errors import fail, fail_on_every_rank
from common.steps import TrainingProgress

logger = get_logger(__name__)
CHECKPOINT_DIR = "checkpoints"
COMPLETE_MARKER = "checkpoint_complete.json"  # written last, inside the folder: the checkpoint is whole
LEFTOVER_PREFIX = ".tmp-"  # interrupted saves, prunes and overwrites: never resumed, removed at the next start
METRICS_FILE = "metrics.jsonl"  # its row count is recorded at each save: a resume keeps exactly those rows
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
RUN_RECORD = "run.json"  # what continuing the checkpoint correctly needs (RunRecord.fields)
TOKENIZER_DIR = "tokenizer"  # the tokenizer the checkpoint was trained with
# Flags that decide which examples a run sees, cut how and in which order: a resume must keep them.
DATA_FLAGS = ("block_size", "max_seq_length", "max_train_samples", "validation_split_percentage", "dataset_name",
              "dataset_config_name", "text_column", "text_pair_column", "label_column", "prompt_column",
              "completion_column", "messages_column", "group_by_length", "tokenizer_vocab_size")
MODEL_SHAPE = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "num_local_experts", "num_experts_per_tok")


class RunRecord:
    """What continuing a checkpoint correctly needs: the script, the global batch, the data (file fingerprints and the
    flags that cut and order it), the seed, the model's shape, and, once the data is loaded, the tokenizer and the
    optimizer steps per epoch.

    Every checkpoint gets these fields (`run.json`) and the tokenizer; a run that resumes one must agree, or it stops
    with one line naming the difference. The process count, per-device batch and accumulation may change if the
    global batch stays: each optimizer step then covers the same examples (the shuffle does not depend on them).
    Created before any heavy work, it checks the flags of a resume right away.
    """

    def __init__(self, args, script: str, num_processes: int, config) -> None:
        batch, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
        self.fields = {
            "script": script,
            "global_batch": {"sequences": batch * accumulation * num_processes, "per_device": batch,
                             "accumulation": accumulation, "processes": num_processes},
            "seed": args.seed,
            "train_file": file_fingerprint(args.train_file),
            "validation_file": file_fingerprint(getattr(args, "validation_file", None)),
            **{name: getattr(args, name) for name in DATA_FLAGS if hasattr(args, name)},
            "model": {key: getattr(config, key) for key in MODEL_SHAPE if getattr(config, key, None) is not None},
        }
        if args.tokenizer_name or args.model_name_or_path:  # the vocabulary size only counts for a trained tokenizer
            self.fields.pop("tokenizer_vocab_size", None)
        if getattr(args, "validation_file", None):  # the split share only counts when validation is cut from train
            self.fields.pop("validation_split_percentage", None)
        self.tokenizer = None
        if args.resume_from_checkpoint:
            check_run_record(args.resume_from_checkpoint, self.fields)

    def add_data(self, tokenizer, steps_per_epoch: int) -> None:
        """What is known once the data is loaded: the tokenizer (saved with each checkpoint) and the epoch length."""
        self.tokenizer = tokenizer
        self.fields.update(tokenizer=tokenizer_fingerprint(tokenizer), steps_per_epoch=steps_per_epoch)

    def write(self, path: str) -> None:
        """Into a checkpoint folder (main process): run.json and the tokenizer."""
        with open(os.path.join(path, RUN_RECORD), "w", encoding="utf-8") as f:
            json.dump(self.fields, f, indent=1)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(os.path.join(path, TOKENIZER_DIR))


def file_fingerprint(path: str | None) -> dict | None:
    """Size and SHA-256 of the first and last MiB: the same file after a copy or a move (a requeued job may stage
    its data elsewhere), another file almost surely; cheap for any size."""
    if not path:
        return None
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        if size > 1 << 20:
            f.seek(max(1 << 20, size - (1 << 20)))
            digest.update(f.read())
    return {"name": os.path.basename(path), "bytes": size, "sha256_head_tail": digest.hexdigest()[:16]}


def tokenizer_fingerprint(tokenizer) -> str:
    """Vocabulary, merges, normalisation, special tokens and chat template (not the per-call padding/truncation)."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec.pop("truncation", None)
    spec.pop("padding", None)
    ids = {name: getattr(tokenizer, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    blob = json.dumps([spec, ids, tokenizer.chat_template], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def is_checkpoint(path: str) -> bool:
    """A folder written by `save_checkpoint` (or by accelerate's `save_state`, which leaves per-process RNG files)."""
    return os.path.isfile(os.path.join(path, RUN_RECORD)) or bool(glob.glob(os.path.join(path, "random_states_*.pkl")))


def check_run_record(path: str, fields: dict) -> None:
    """Stop with one line at the first field of this run that contradicts the checkpoint's run.json."""
    record = os.path.join(path, RUN_RECORD)
    if not os.path.isfile(record):
        logger.warning(f"{path} has no {RUN_RECORD}: resuming without checking that the data and batch agree")
        return
    try:
        with open(record, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"--resume_from_checkpoint {path}: cannot read {record} ({e})")
    grouped = fields.get("group_by_length")
    for key, value in fields.items():
        if key in saved and _differs(key, saved[key], value, grouped):
            fail(f"--resume_from_checkpoint {path}: {_difference(key, saved[key], value, path)}")


def _differs(key: str, saved, current, grouped: bool) -> bool:
    if key == "global_batch":  # length-grouped batches are cut from the order by per-device batch size
        fields = ("sequences", "per_device") if grouped else ("sequences",)
        return any(saved[f] != current[f] for f in fields)
    if key in ("train_file", "validation_file") and saved and current:
        return (saved["bytes"], saved["sha256_head_tail"]) != (current["bytes"], current["sha256_head_tail"])
    return saved != current


def _difference(key: str, saved, current, path: str) -> str:
    """The one-line explanation of a field that differs."""
    if key == "global_batch":
        def batch(g):
            return (f"{g['sequences']} ({g['per_device']} x {g['accumulation']} x {g['processes']} "
                    f"process{'es' if g['processes'] > 1 else ''})")
        if saved["sequences"] == current["sequences"]:
            return (f"with --group_by_length the order depends on the per-device batch: the checkpoint was trained "
                    f"with {saved['per_device']}, this run has {current['per_device']}")
        return (f"the checkpoint was trained with global batch {batch(saved)}, this run has {batch(current)}; keep "
                "per-device batch x accumulation x processes equal to the checkpoint's")
    if key in ("train_file", "validation_file"):
        def data(d):
            return f"{d['name']} ({d['bytes']:,} bytes)" if d else "the default data"
        return f"the checkpoint was trained on --{key} {data(saved)}, this run has {data(current)}"
    if key == "tokenizer":
        return (f"this run's tokenizer differs from the one the checkpoint was trained with (saved in "
                f"{os.path.join(path, TOKENIZER_DIR)})")
    if key == "steps_per_epoch":
        return (f"an epoch of the checkpoint's run has {saved} optimizer steps, this run's has {current}: the data or "
                "the way per-device batch x accumulation cuts it differs")
    if key == "model":
        diffs = [f"{k} {saved.get(k)} vs {current.get(k)}" for k in sorted(set(saved) | set(current))
                 if saved.get(k) != current.get(k)]
        return f"the checkpoint holds another model ({', '.join(diffs)}, checkpoint vs this run)"
    if key == "script":
        return f"the checkpoint was written by {saved}, not by {current}"
    return f"the checkpoint was trained with --{key} {saved}, this run has --{key} {current}"


def resume(accelerator: Accelerator, path: str | None, progress: TrainingProgress, run: RunRecord) -> None:
    """Restore model, optimizer, scheduler, RNG and `progress` from a checkpoint folder (nothing when `path` is None).

    `--resume_from_checkpoint latest` was resolved to a folder while the flags were checked. The run must agree with
    the checkpoint's record (one line otherwise).
    """
    if path:
        check_run_record(path, run.fields)
        accelerator.load_state(path)
        # accelerate restores its micro-step counter, which sets the sync points of `accumulate`, from the checkpoint
        # (and only on ranks that wrote one): count it afresh in this run's accumulation steps, on every rank.
        accelerator.step = progress.step * accelerator.gradient_accumulation_steps
        logger.info(f"Resumed from {path} at optimizer step {progress.step}")


def complete_checkpoints(output_dir: str) -> list[str]:
    """The published checkpoints `checkpoints/step_N` that hold the completion marker, oldest first."""
    root = os.path.join(output_dir, CHECKPOINT_DIR)
    found = [d for d in os.listdir(root) if re.fullmatch(r"step_\d+", d)
             and os.path.isfile(os.path.join(root, d, COMPLETE_MARKER))] if os.path.isdir(root) else []
    return [os.path.join(root, d) for d in sorted(found, key=lambda d: int(d.split("_")[1]))]


def metrics_rows_at(output_dir: str, step: int) -> int | None:
    """How many metrics.jsonl rows had been written when checkpoint step_N was saved (None: unknown)."""
    marker = os.path.join(output_dir, CHECKPOINT_DIR, f"step_{step}", COMPLETE_MARKER)
    if not os.path.isfile(marker):
        return None
    with open(marker, encoding="utf-8") as f:
        return json.load(f).get("metrics_rows")


def save_checkpoint(accelerator: Accelerator, output_dir: str, step: int, save_total_limit: int | None,
                    run: RunRecord | None = None) -> str:
    """Save the full training state (model, optimizer, scheduler, RNG, progress) and the run's record on all ranks,
    publish it as `checkpoints/step_N`, then prune the oldest complete ones beyond `save_total_limit`.

    Collective under DeepSpeed/FSDP: every process must call it. A full disk stops the run with one line, the partial
    save removed and the previous checkpoints untouched.
    """
    root = os.path.join(output_dir, CHECKPOINT_DIR)
    path, partial = os.path.join(root, f"step_{step}"), os.path.join(root, f"{LEFTOVER_PREFIX}step_{step}")
    refuse_nonfinite_weights(accelerator, accelerator._models, f"checkpoint {path}")
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(partial)
    except Exception as exc:
        if not disk_refuses_writes(exc, partial):
            raise
        shutil.rmtree(partial, ignore_errors=True)
        fail(disk_full_message(output_dir, step))
    accelerator.wait_for_everyone()  # every rank has written its part
    if accelerator.is_main_process:
        if run is not None:  # the scripts always record their run
            run.write(partial)
        publish(partial, path, {"step": step, "metrics_rows": count_rows(os.path.join(output_dir, METRICS_FILE))})
        for old in complete_checkpoints(output_dir)[:-save_total_limit] if save_total_limit else []:
            discard(old)
    accelerator.wait_for_everyone()
    logger.info(f"Saved checkpoint {path}")
    return path


def publish(partial: str, path: str, marker: dict) -> None:
    """Flush the finished save to disk, mark it complete, and rename it into place (atomic on POSIX filesystems).

    The fsyncs make the marker mean "complete" even if the node loses power right after.
    """
    for folder, _, files in os.walk(partial):
        for name in files:
            fsync_path(os.path.join(folder, name))
    with open(os.path.join(partial, COMPLETE_MARKER), "w", encoding="utf-8") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(path):  # the same step saved by an earlier attempt: replaced whole, never merged
        discard(path)
    os.replace(partial, path)
    fsync_path(os.path.dirname(path))


def discard(path: str) -> None:
    """Remove a folder so that a kill midway never leaves it half-deleted under its own name."""
    aside = os.path.join(os.path.dirname(path), f"{LEFTOVER_PREFIX}discarded-{os.path.basename(path)}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def remove_leftovers(output_dir: str) -> None:
    """Delete what interrupted saves, prunes, overwrites and metrics trims left (`.tmp-*`); main process, under the
    output folder's lock (no live run is writing them)."""
    for folder in (output_dir, os.path.join(output_dir, CHECKPOINT_DIR)):
        for name in os.listdir(folder) if os.path.isdir(folder) else []:
            if name.startswith(LEFTOVER_PREFIX):
                leftover = os.path.join(folder, name)
                shutil.rmtree(leftover, ignore_errors=True) if os.path.isdir(leftover) else os.remove(leftover)


def resolve_resume_path(output_dir: str, value: str | None) -> str | None:
    """`latest` -> the newest complete checkpoint under output_dir, else a one-line error; `auto` -> the same, else
    None (start fresh: a requeued job runs the same command line whether or not a checkpoint exists); a path ->
    itself."""
    if value not in ("latest", "auto"):
        return value or None
    found = complete_checkpoints(output_dir)
    if found:
        return found[-1]
    if value == "latest":
        fail(f"--resume_from_checkpoint latest: no checkpoint under {os.path.join(output_dir, CHECKPOINT_DIR)} "
             "(--resume_from_checkpoint auto starts fresh when there is none)")
    return None


def disk_refuses_writes(exc: BaseException, folder: str) -> bool:
    """Did a save fail because the disk is full (or the quota or file-size limit reached)?

    safetensors and Python report the errno; torch.save does not ("unexpected pos ..."), so the disk is also asked
    directly with a small write next to the partial save.
    """
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return True
        exc = exc.__cause__ or exc.__context__
    probe = os.path.join(folder, f"{LEFTOVER_PREFIX}probe")
    try:
        with open(probe, "wb") as f:
            f.write(bytes(2**20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as probe_error:
        return probe_error.errno in DISK_FULL_ERRNOS
    finally:
        if os.path.exists(probe):
            os.remove(probe)
    return False


def disk_full_message(output_dir: str, step: int) -> str:
    previous = complete_checkpoints(output_dir)
    free_mib = shutil.disk_usage(output_dir).free / 2**20
    return (f"disk full: checkpoint step_{step} could not be written to {os.path.join(output_dir, CHECKPOINT_DIR)} "
            f"(filesystem {mount_point(output_dir)}, {free_mib:.0f} MiB free after removing the partial save); "
            f"{previous[-1] + ' is intact' if previous else 'there is no earlier checkpoint'}: free some space, then "
            "rerun with --resume_from_checkpoint auto")


def mount_point(path: str) -> str:
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def count_rows(path: str) -> int:
    """Complete lines in a text file (0 when it does not exist)."""
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8") as f:
        return sum(line.endswith("\n") for line in f)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def zero_partition_count(checkpoint_dir: str) -> int | None:
    """Processes a DeepSpeed ZeRO checkpoint written by `save_state` was partitioned over (None: not a ZeRO one).

    accelerate saves the engine under the tag `pytorch_model`; each data-parallel rank writes one
    `zero_pp_rank_<r>_mp_rank_<m>_optim_states.pt` there. Counting names is cheap (no tensor is read).
    """
    engine_dir = os.path.join(checkpoint_dir, "pytorch_model")
    if not os.path.isdir(engine_dir):
        return None
    ranks = {m.group(1) for m in (re.fullmatch(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt", f)
                                  for f in os.listdir(engine_dir)) if m}
    return len(ranks) or None


def check_resume_process_count(accelerator: Accelerator, checkpoint_dir: str | None) -> None:
    """Refuse, in one line and before any heavy work, a ZeRO checkpoint resumed at another process count.

    DeepSpeed cannot re-partition ZeRO optimizer states; it would raise only after the data and the model are built.
    (Its universal-checkpoint conversion does not fit accelerate's checkpoint layout: not offered here.) FSDP2's
    sharded checkpoints are torch.distributed.checkpoint folders and load at any process count, so they pass.
    """
    if not checkpoint_dir or accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    saved = zero_partition_count(checkpoint_dir)
    if saved is not None and saved != accelerator.num_processes:
        fail_on_every_rank(accelerator, f"--resume_from_checkpoint {checkpoint_dir} holds DeepSpeed ZeRO states "
                           f"partitioned over {saved} processes but this run has {accelerator.num_processes}, and "
                           f"DeepSpeed cannot re-partition them: resume with --num_processes {saved}, or train with "
                           "accelerate_configs/fsdp2.yaml, whose checkpoints resume at any process count")


def export_model(accelerator: Accelerator, model, tokenizer, output_dir: str) -> None:
    """Write a `from_pretrained`-loadable folder (safetensors + config + tokenizer).

    Called on every process: under ZeRO-3/FSDP, gathering the full state dict is collective. The compiled wrapper is
    dropped so the keys carry no `_orig_mod.` prefix. config.json and generation_config.json name the tokenizer's
    special tokens.
    """
    refuse_nonfinite_weights(accelerator, [model], f"the model to {output_dir}")
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    if tokenizer is not None:
        use_tokenizer_special_tokens(unwrapped, tokenizer)
    # Sharded models need the collective gather; elsewhere the unwrapped module's own state dict is complete
    # (`get_state_dict` would keep the compiled wrapper's `_orig_mod.` prefix).
    sharded = accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)
    state_dict = accelerator.get_state_dict(model) if sharded else None
    keep_used_weight_conversions(unwrapped)
    unwrapped.save_pretrained(output_dir, is_main_process=accelerator.is_main_process, state_dict=state_dict,
                              save_function=accelerator.save, safe_serialization=True)
    if accelerator.is_main_process and tokenizer is not None:
        tokenizer.save_pretrained(output_dir)
    accelerator.wait_for_everyone()


def keep_used_weight_conversions(model) -> None:
    """Let `save_pretrained` undo only the key conversions that loading the model applied.

    transformers (5.23) reverts a model's recorded key conversions when saving. Its ZeRO-3 loading path records every
    conversion known for the model type, used or not (the other path keeps the used ones), so a ZeRO-3 export of BERT
    had the legacy names `LayerNorm.gamma/beta` instead of the checkpoint's `LayerNorm.weight/bias`.
    """
    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        model._weight_conversions = [conversion for conversion in conversions if conversion.was_used()]


def use_tokenizer_special_tokens(model, tokenizer) -> None:
    """Give the model's config and generation config the tokenizer's BOS / EOS / PAD ids.

    A model built from a preset carries LlamaConfig's defaults (BOS 1, EOS 2), other tokens of a tokenizer trained here
    (its end-of-text is 0): generation would stop at the wrong token and run past the real end. A list of EOS ids
    that holds the tokenizer's (chat models stop at several tokens) is kept.
    """
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name)
        if value is None:
            continue
        for config in (model.config, getattr(model, "generation_config", None)):
            if config is not None and not (isinstance(getattr(config, name, None), list)
                                           and value in getattr(config, name)):
                setattr(config, name, value)
