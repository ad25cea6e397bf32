"""The resume guard: what continuing a checkpoint correctly needs (`run.json` in every checkpoint), checked against the
resuming run's flags, data, tokenizer, model shape and process count before any heavy work."""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
from contextlib import contextmanager

import xxhash
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType
from torch.optim.lr_scheduler import LambdaLR

from common.errors import fail, fail_on_every_rank
from common.features.wsd import stable_phase_resume
from common.paths import COMPLETE_MARKER, RUN_RECORD, TOKENIZER_DIR
from common.upstream import prepared_optimizers_and_schedulers, set_last_lr

logger = get_logger(__name__)
# The flags of common/flags.py that decide which examples a run sees, cut how and in which order; each script adds
# its own (`data_flags`).
SHARED_DATA_FLAGS = ("dataset_name", "dataset_config_name", "text_column", "max_train_samples",
                     "validation_split_percentage", "max_seq_length", "group_by_length")
# The flags a resume takes from this run although the checkpoint's state held them too (`keep_this_runs_hyperparameters`
# puts them back after the restore): recorded to say, in one line, which ones a resume changes.
HYPERPARAMETERS = ("learning_rate", "lr_scheduler_type", "warmup_steps", "max_steps", "num_train_epochs",
                   "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
                   "lr_decay_ratio", "lr_decay_type", "min_lr_ratio",  # common/features/wsd.py
                   "muon_learning_rate", "muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_adjust_lr_fn")
# The LoRA settings a checkpoint was trained with (common/features/lora.py): a resume must keep them.
ADAPTER_FLAGS = ("use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "load_in_4bit",
                 "bnb_4bit_quant_type", "use_bnb_nested_quant")
# A local model folder's weight files (safetensors, or torch's legacy pickles), fingerprinted for `base_model`.
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")
# What a second data stage (--new_data_mixture, scripts/pretrain_llama.py) may change: the data, not how it is cut.
DATA_STAGE = ("train_file", "validation_file", "dataset_name", "dataset_config_name", "text_column",
              "max_train_samples", "validation_split_percentage", "steps_per_epoch", "mixture")
MODEL_SHAPE = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "num_local_experts", "num_experts_per_tok")


class RunRecord:
    """What continuing a checkpoint correctly needs: the script, the global batch, the data (file fingerprints and the
    flags that cut and order it), the seed, the model's shape and pretrained weights, and, once the data is loaded,
    the tokenizer and the optimizer steps per epoch.

    Every checkpoint gets these fields (`run.json`) and the tokenizer; a run that resumes one must agree, or it stops
    with one line naming the difference. The process count, per-device batch and accumulation may change if the
    global batch stays: each optimizer step then covers the same examples (the shuffle does not depend on them).
    The optimizer (--optim) must stay too: its state only fits the optimizer that wrote it. The learning rate,
    schedule and optimizer settings (HYPERPARAMETERS) may change: the resume applies them from the checkpoint's step
    on, and says so in one line.
    Created before any heavy work, it checks the flags (and a ZeRO checkpoint's process count) of a resume right away.
    """

    def __init__(self, args: argparse.Namespace, script: str, accelerator: Accelerator, config,
                 data_flags: tuple[str, ...], resume_from: str | None) -> None:
        batch, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
        pc = getattr(accelerator, "parallelism_config", None)  # the tp processes of a group train on the same sequences
        num_processes = accelerator.num_processes // (pc.tp_size if pc else 1)
        self.fields = {
            "script": script,
            "global_batch": {"sequences": batch * accumulation * num_processes, "per_device": batch,
                             "accumulation": accumulation, "processes": num_processes},
            "seed": args.seed,
            "train_file": file_fingerprint(args.train_file),
            "validation_file": file_fingerprint(args.validation_file),
            **{name: getattr(args, name) for name in SHARED_DATA_FLAGS + data_flags if hasattr(args, name)},
            **{name: getattr(args, name) for name in ADAPTER_FLAGS if hasattr(args, name)},  # the LoRA settings
            "model": {key: getattr(config, key) for key in MODEL_SHAPE if getattr(config, key, None) is not None},
            "base_model": base_model_fingerprint(getattr(args, "model_name_or_path", None), config),
            "optim": "adamw_torch" if args.optim == "adamw_torch_fused" else args.optim,  # fused or not: one state
        }
        self.hyperparameters = {name: getattr(args, name) for name in HYPERPARAMETERS if hasattr(args, name)}
        self.mixed_precision = accelerator.mixed_precision
        if args.validation_file:  # the split share only counts when validation is cut from train
            self.fields.pop("validation_split_percentage", None)
        self.tokenizer, self.second_stage = None, getattr(args, "new_data_mixture", False)
        if resume_from:
            check_resume_process_count(accelerator, resume_from)
            check_run_record(resume_from, self.checked_fields())
            check_run_length(resume_from, args.max_steps)
            report_new_hyperparameters(resume_from, self.hyperparameters)
            report_new_precision(resume_from, self.mixed_precision)

    def add_data(self, tokenizer, steps_per_epoch: int | None, **data) -> None:
        """What is known once the data is loaded: the tokenizer (saved with each checkpoint), the epoch length and
        what the script adds (pretraining: the mixture)."""
        self.tokenizer = tokenizer
        self.fields.update(tokenizer=tokenizer_fingerprint(tokenizer), steps_per_epoch=steps_per_epoch, **data)

    def check(self, path: str) -> None:
        """Before a resume loads `path`: stop with one line at the first field this run contradicts (a second data
        stage, --new_data_mixture, may change the data: the flags and fields of DATA_STAGE)."""
        check_run_record(path, self.checked_fields())

    def checked_fields(self) -> dict:
        return {k: v for k, v in self.fields.items() if not (self.second_stage and k in DATA_STAGE)}

    @staticmethod
    def keep(accelerator: Accelerator):
        """Around the restore (`CheckpointExtras.keep`): the flags' hyperparameters survive it."""
        return keep_this_runs_hyperparameters(accelerator)

    def write(self, path: str) -> None:
        """Into a checkpoint folder (main process): run.json and the tokenizer."""
        with open(os.path.join(path, RUN_RECORD), "w", encoding="utf-8") as f:
            json.dump({**self.fields, "hyperparameters": self.hyperparameters, "mixed_precision": self.mixed_precision},
                      f, indent=1)
        self.tokenizer.save_pretrained(os.path.join(path, TOKENIZER_DIR))


def file_fingerprint(path: str | None) -> dict | None:
    """Size and SHA-256 of the first and last MiB: the same file after a copy or a move (a requeued job may stage
    its data elsewhere), another file almost surely; cheap for any size."""
    if not path:
        return None
    if isinstance(path, list):  # one file per source of a mixture
        return [file_fingerprint(p) for p in path] if len(path) > 1 else file_fingerprint(path[0])
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        if size > 1 << 20:
            f.seek(max(1 << 20, size - (1 << 20)))
            digest.update(f.read())
    return {"name": os.path.basename(path), "bytes": size, "sha256_head_tail": digest.hexdigest()[:16]}


def base_model_fingerprint(name: str | None, config) -> dict | None:
    """The pretrained weights a run starts from (None: built from the seed): for a local folder every weight file's
    size and an xxh3-64 checksum of its whole content (a copy elsewhere matches; another model, of the same shape or
    with one value edited anywhere, does not), for a hub id the revision its config came from. A LoRA resume loads its
    base afresh: it must be the one the adapter was trained on. xxh3-64 hashes ~20 GB/s (common/features/checksums.py):
    reading the files costs more, and the model load that follows finds them in the page cache. `weights` (the size
    and the first and last MiB) is what checkpoints written before the full checksum hold; it is compared with them."""
    if not name:
        return None
    if not os.path.isdir(name):
        return {"name": name, "revision": getattr(config, "_commit_hash", None)}
    weights, checksums = {}, {}
    for path in sorted({p for pattern in WEIGHT_FILES for p in glob.glob(os.path.join(glob.escape(name), pattern))}):
        fingerprint = file_fingerprint(path)
        weights[fingerprint["name"]] = [fingerprint["bytes"], fingerprint["sha256_head_tail"]]
        checksums[fingerprint["name"]] = [fingerprint["bytes"], whole_file_checksum(path)]
    return {"name": name, "weights": weights, "weights_xxh3_64": checksums}


def whole_file_checksum(path: str) -> str:
    digest = xxhash.xxh3_64()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(4 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """Vocabulary, merges, normalisation, special tokens and chat template (not the per-call padding/truncation)."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec.pop("truncation", None)
    spec.pop("padding", None)
    ids = {name: getattr(tokenizer, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    blob = json.dumps([spec, ids, tokenizer.chat_template], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


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
            batches = saved.get("global_batch"), fields.get("global_batch")
            fail(f"--resume_from_checkpoint {path}: {_difference(key, saved[key], value, path, batches)}")


def saved_record(path: str) -> dict:
    """A checkpoint's run.json ({} if it has none or it does not parse: check_run_record has said so)."""
    try:
        with open(os.path.join(path, RUN_RECORD), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def checkpoint_step(path: str) -> int | None:
    """The optimizer step a checkpoint was saved at (None: unknown)."""
    try:
        with open(os.path.join(path, COMPLETE_MARKER), encoding="utf-8") as f:
            step = json.load(f).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def check_run_length(path: str, max_steps: int) -> None:
    """A checkpoint beyond this run's --max_steps would end the run at once with more steps than asked: one line."""
    step = checkpoint_step(path)
    if step is not None and 0 < max_steps < step:
        fail(f"--resume_from_checkpoint {path}: the checkpoint is at optimizer step {step}, beyond this run's "
             f"--max_steps {max_steps}: resume with --max_steps {step} or more")


def report_new_hyperparameters(path: str, current: dict) -> None:
    """One line naming the hyperparameters this resume changes (they apply from the checkpoint's step on)."""
    saved = saved_record(path).get("hyperparameters", {})
    changed = [f"--{name} {current[name]} (was {saved[name]})" for name in current
               if name in saved and saved[name] != current[name]]
    stretched = stable_phase_resume(saved, current, checkpoint_step(path))  # a longer or branched stable phase
    if changed and stretched:
        logger.info(stretched)
    elif changed:
        logger.warning(f"Resuming {path} with new hyperparameters: {', '.join(changed)}; the learning-rate schedule "
                       "is this run's from the checkpoint's step on, the optimizer's moments are the checkpoint's")


def report_new_precision(path: str, current: str) -> None:
    """One line when this resume trains in another precision than the checkpoint (accepted: the weights and the
    optimizer's state are restored as saved, the forward and backward passes change)."""
    saved = saved_record(path).get("mixed_precision")
    if saved and saved != current:
        def name(precision):
            return "fp32" if precision == "no" else f"{precision} mixed precision"
        logger.warning(f"Resuming {path} in {name(current)}; the checkpoint was trained in {name(saved)}: the run "
                       f"goes on from the checkpoint's state, but its losses will not continue the {name(saved)} run's "
                       "exactly")


def _differs(key: str, saved, current, grouped: bool) -> bool:
    if key == "global_batch":  # length-grouped batches are cut from the order by per-device batch size
        fields = ("sequences", "per_device") if grouped else ("sequences",)
        return any(saved[f] != current[f] for f in fields)
    if key in ("train_file", "validation_file") and saved and current:  # a mixture's: one per source
        def content(files):
            return [(f["bytes"], f["sha256_head_tail"]) for f in (files if isinstance(files, list) else [files])]
        return content(saved) != content(current)
    if key == "optim":  # a record written before fused and unfused AdamW were counted as one state names either
        return saved != current and not {saved, current} <= {"adamw_torch", "adamw_torch_fused"}
    if key == "base_model" and saved and current:  # the path may change; a folder and a hub id cannot be compared
        return any(saved.get(k) != current.get(k) for k in ("weights", "weights_xxh3_64", "revision")
                   if saved.get(k) and current.get(k))
    return saved != current


def base_difference(saved: dict | None, current: dict | None) -> str:
    """What differs between two bases: the weight files by name, size or bytes (the check is byte for byte: the same
    weights saved again in another layout differ too), or the hub revision."""
    if not (saved and current):
        return "whose weights differ"
    for key in ("weights_xxh3_64", "weights"):
        old, new = saved.get(key), current.get(key)
        if old and new and old != new:
            files = [file_difference(name, old, new) for name in sorted(set(old) | set(new))
                     if old.get(name) != new.get(name)]
            return (f"whose weight files differ byte for byte ({'; '.join(files)}; the same weights saved again "
                    "differ too)")
    if saved.get("revision") != current.get("revision"):
        return f"whose hub revision differs ({current.get('revision')}, not {saved.get('revision')})"
    return "whose weights differ"


def file_difference(name: str, old: dict, new: dict) -> str:
    """How weight file `name` differs between two bases' records (name -> [bytes, checksum])."""
    if name not in new:
        return f"{name} is missing"
    if name not in old:
        return f"{name} is not in the checkpoint's base"
    if new[name][0] != old[name][0]:
        return f"{name} has {new[name][0]:,} bytes, not {old[name][0]:,}"
    return f"{name} holds other bytes (same size)"


def _difference(key: str, saved, current, path: str, batches: tuple = (None, None)) -> str:
    """The one-line explanation of a field that differs (`batches`: the checkpoint's and this run's global batch)."""
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
            if isinstance(d, list):
                return " ".join(data(one) for one in d)
            return f"{d['name']} ({d['bytes']:,} bytes)" if d else "the default data"
        return (f"the checkpoint was trained on --{key} {data(saved)}, this run has {data(current)}"
                + ("; to continue a pretraining checkpoint on other data (a second stage), add --new_data_mixture"
                   if key == "train_file" else ""))
    if key == "mixture":
        def sources(m):
            return ", ".join(f"{s['source']} {s['weight']}" for s in m) + f" ({m[0]['stopping']})"
        return (f"the checkpoint was trained on the mixture {sources(saved)}, this run has {sources(current)}; to "
                "continue it with another mixture (a second stage), add --new_data_mixture")
    if key == "tokenizer":
        return (f"this run's tokenizer differs from the one the checkpoint was trained with (saved in "
                f"{os.path.join(path, TOKENIZER_DIR)})")
    if key == "steps_per_epoch":
        before, now = batches
        if before and now and before["accumulation"] != now["accumulation"]:
            # A trailing partial accumulation window is dropped: the epoch's last, partial global batch makes a step
            # or not depending on the accumulation steps alone (per-device batch x processes does not change it).
            return (f"an epoch of the checkpoint's run has {saved} optimizer steps, this run's has {current}: the "
                    f"epoch does not end on a whole global batch, and whether its last, partial one makes a step "
                    f"depends on the accumulation steps ({before['accumulation']} in the checkpoint, "
                    f"{now['accumulation']} now); resume with --gradient_accumulation_steps {before['accumulation']} "
                    f"(the per-device batch and the process count may change if the global batch stays "
                    f"{before['sequences']})")
        return (f"an epoch of the checkpoint's run has {saved} optimizer steps, this run's has {current}: the data or "
                "the way per-device batch x accumulation cuts it differs")
    if key == "model":
        diffs = [f"{k} {saved.get(k)} vs {current.get(k)}" for k in sorted(set(saved) | set(current))
                 if saved.get(k) != current.get(k)]
        return f"the checkpoint holds another model ({', '.join(diffs)}, checkpoint vs this run)"
    if key == "base_model":
        def base(b):
            return f"--model_name_or_path {b['name']}" if b else "a model built from the seed"
        return (f"the checkpoint was trained from {base(saved)}, this run from {base(current)}, "
                f"{base_difference(saved, current)}; resume with the checkpoint's base model")
    if key == "script":
        return f"the checkpoint was written by {saved}, not by {current}"
    if key == "optim":
        return (f"the checkpoint was trained with --optim {saved}, this run has --optim {current}; its optimizer state "
                f"only fits {saved}: resume with --optim {saved}")
    return f"the checkpoint was trained with --{key} {saved}, this run has --{key} {current}"


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
    """Refuse, in one line and before any heavy work, a ZeRO checkpoint resumed at another process count, and a
    sharded DCP checkpoint (FSDP2, TP) resumed by an engine that loads only whole states.

    DeepSpeed cannot re-partition ZeRO optimizer states; it would raise only after the data and the model are built.
    (Its universal-checkpoint conversion does not fit accelerate's checkpoint layout: not offered here.) FSDP2's
    sharded checkpoints are torch.distributed.checkpoint folders and load at any process count, so they pass.
    """
    if checkpoint_dir and accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED) \
            and os.path.isdir(os.path.join(checkpoint_dir, "pytorch_model_fsdp_0")):
        fail_on_every_rank(accelerator, f"--resume_from_checkpoint {checkpoint_dir} holds sharded (FSDP2 or tensor-"
                           "parallel) torch.distributed.checkpoint states, which this run's engine cannot load: resume "
                           "under accelerate_configs/fsdp2.yaml, tp.yaml or fsdp2_tp.yaml (any process count)")
    if not checkpoint_dir or accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    saved = zero_partition_count(checkpoint_dir)
    if saved is not None and saved != accelerator.num_processes:
        fail_on_every_rank(accelerator, f"--resume_from_checkpoint {checkpoint_dir} holds DeepSpeed ZeRO states "
                           f"partitioned over {saved} processes but this run has {accelerator.num_processes}, and "
                           f"DeepSpeed cannot re-partition them: resume with --num_processes {saved}, or train with "
                           "accelerate_configs/fsdp2.yaml, whose checkpoints resume at any process count")


# Optimizer settings that `load_state_dict` restores from a checkpoint along with the moments; a resume puts back the
# values this run's flags gave (--weight_decay, --adam_beta1/2, --adam_epsilon; initial_lr is --learning_rate).
FLAG_SETTINGS = ("weight_decay", "betas", "eps", "initial_lr", "momentum", "nesterov", "ns_steps", "adjust_lr_fn")


@contextmanager
def keep_this_runs_hyperparameters(accelerator):
    """Around `accelerator.load_state`: what the flags set survives the restore; the state is the checkpoint's. A
    checkpoint restores the optimizer's moments and step and the schedule's step, but also its settings: each
    parameter group's weight decay, betas and eps, the schedule's peak learning rate (`base_lrs`) and, under
    DeepSpeed ZeRO-1/2, the gradient clipping. Left so, a resume with a new --learning_rate or --weight_decay would
    train with the old values without a word. Here they are taken before the restore (the optimizer and schedule were
    just built from the flags) and put back after it, and each group's current learning rate is recomputed from this
    run's schedule at the checkpoint's step: the schedule's shape (type, warmup, length) is always this run's, since
    a checkpoint does not hold it. Unchanged flags give the same values, bit for bit.
    """
    optimizers, schedulers = prepared_optimizers_and_schedulers(accelerator)
    settings = [[{k: group[k] for k in FLAG_SETTINGS if k in group} for group in o.param_groups] for o in optimizers]
    clipping = [getattr(o, "clip_grad", None) for o in optimizers]  # DeepSpeed ZeRO-1/2 restore it
    peaks = [list(s.base_lrs) if isinstance(s, LambdaLR) else None for s in schedulers]
    yield
    for optimizer, groups, clip in zip(optimizers, settings, clipping):
        for group, values in zip(optimizer.param_groups, groups):
            group.update(values)
        if clip is not None:
            optimizer.clip_grad = clip
    for scheduler, peak in zip(schedulers, peaks):
        if peak is not None:  # this run's schedule at the checkpoint's step, from this run's peak
            scheduler.base_lrs = peak
            lrs = [base * lmbda(scheduler.last_epoch) for lmbda, base in zip(scheduler.lr_lambdas, peak)]
            for group, lr in zip(scheduler.optimizer.param_groups, lrs):
                group["lr"] = lr
            set_last_lr(scheduler, lrs)
