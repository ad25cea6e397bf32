"""A DeepSpeed JSON and the script's flags must agree: a fixed JSON value that contradicts a flag stops the run.

accelerate fills a JSON's "auto" values from the script, but where the JSON holds a number it silently wins (since
accelerate 1.8 even over `gradient_accumulation_steps`, with only a logged warning), or fails deep inside DeepSpeed.
This check reads the JSON the launcher names, before anything expensive, and fails with one line instead; an "auto"
gradient_clipping takes --max_grad_norm (0: no clipping, as without DeepSpeed).
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

from common.errors import fail


def check_deepspeed_config(args: argparse.Namespace) -> dict | None:
    """Fail on a DeepSpeed JSON whose fixed values contradict the flags; return the JSON (None: no DeepSpeed JSON).

    Does nothing unless `accelerate launch` runs the script under DeepSpeed with a JSON file.
    """
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path == "none":
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as e:
        fail(f"DeepSpeed config {path}: {e.strerror}")
    except json.JSONDecodeError as e:
        fail(f"DeepSpeed config {path}: not valid JSON ({e})")

    precision = args.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    batch, ga = args.per_device_train_batch_size, args.gradient_accumulation_steps
    optimizer = config.get("optimizer", {}).get("params", {})
    expected = {  # JSON key -> (value the flags imply, the flags)
        "train_micro_batch_size_per_gpu": (batch, "--per_device_train_batch_size"),
        "gradient_accumulation_steps": (ga, "--gradient_accumulation_steps"),
        "train_batch_size": (batch * ga * world_size,
                             f"--per_device_train_batch_size x --gradient_accumulation_steps x {world_size} processes"),
        "gradient_clipping": (args.max_grad_norm, "--max_grad_norm"),
        "bf16.enabled": (precision in ("bf16", "fp8"), f"mixed precision {precision}"),
        "fp16.enabled": (precision == "fp16", f"mixed precision {precision}"),
        "optimizer.params.lr": (args.learning_rate, "--learning_rate"),
        "optimizer.params.weight_decay": (args.weight_decay, "--weight_decay"),
        "optimizer.params.betas": ([args.adam_beta1, args.adam_beta2], "--adam_beta1/--adam_beta2"),
        "optimizer.params.eps": (args.adam_epsilon, "--adam_epsilon"),
    }
    found = {"optimizer.params." + k: v for k, v in optimizer.items()}
    found.update({k: v for k, v in config.items() if not isinstance(v, dict)})
    found.update({f"{k}.enabled": config[k].get("enabled") for k in ("bf16", "fp16") if isinstance(config.get(k), dict)})
    clashes = []
    for key, (want, flags) in expected.items():
        value = found.get(key)
        if value is None or value == "auto":
            continue
        if not _same(value, want):
            clashes.append(f"{key}={json.dumps(value)} but {flags} gives {json.dumps(want)}")
    if clashes:
        fail(f"DeepSpeed config {path} contradicts the script's flags: {'; '.join(clashes)}. "
             'Set these to "auto" in the JSON (the flags then decide) or change the flags.')

    if "optimizer" in config and args.optim == "adafactor":
        fail(f"--optim adafactor: DeepSpeed config {path} defines its own optimizer "
             f"({config['optimizer'].get('type')}); use a JSON without an optimizer block")
    if config.get("gradient_clipping") == "auto":
        # accelerate fills an "auto" clipping with 1.0 whatever the flag says; its launcher's variable carries the flag
        os.environ["ACCELERATE_GRADIENT_CLIPPING"] = str(args.max_grad_norm)
    if "optimizer" in config and args.optim not in ("adamw_torch", "adamw_torch_fused", "muon"):  # muon: replaces it
        warnings.warn(f"--optim {args.optim} is not used: DeepSpeed config {path} defines the optimizer "
                      f"({config['optimizer'].get('type')}; with optimizer offload this is DeepSpeed's CPU Adam)")
    return config


def _same(value, want) -> bool:
    """JSON value vs flag value: numbers compare as floats (1 == 1.0), lists element-wise, booleans exactly."""
    try:
        if isinstance(want, list):
            return len(value) == len(want) and all(float(v) == float(w) for v, w in zip(value, want))
        return value is want if isinstance(want, bool) else float(value) == float(want)
    except (TypeError, ValueError):
        return False
