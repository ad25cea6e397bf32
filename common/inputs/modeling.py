"""Causal-LM presets, config/model building (from scratch or pretrained), gradient checkpointing."""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from accelerate.logging import get_logger
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, MixtralConfig, PretrainedConfig, PreTrainedModel

from common.errors import fail
from common.flags import check_common_flags
from common.inputs import from_pretrained_or_fail
from common.upstream import registered_zero3_config

logger = get_logger(__name__)

# Llama shapes. vocab_size is replaced by the tokenizer's size when a model is built from scratch.
LLAMA_PRESETS = {
    "tiny": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=1024),                      # ~3M with vocab 8k
    "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=8, max_position_embeddings=2048),                     # ~10M
    "125m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=12, max_position_embeddings=2048),
    "350m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=16, max_position_embeddings=2048),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, max_position_embeddings=2048),                         # TinyLlama-1.1B shape
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0),   # Llama-3-8B shape
}
# Mixtral-style sparse mixture of experts (top-2 of 4 experts per token).
MOE_PRESETS = {
    "moe-tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
                     output_router_logits=True, router_aux_loss_coef=0.02),
}
PRESETS = tuple(LLAMA_PRESETS) + tuple(MOE_PRESETS)


def load_config(args: argparse.Namespace) -> PretrainedConfig:
    """The model's config, cheaply (no weights), so that flags can be checked against it before any heavy work."""
    if args.model_name_or_path:
        config = from_pretrained_or_fail(AutoConfig.from_pretrained, args.model_name_or_path, "--model_name_or_path")
    elif args.config_name:
        config = from_pretrained_or_fail(AutoConfig.from_pretrained, args.config_name, "--config_name")
    else:
        preset = args.model_preset or "tiny"
        config = MixtralConfig(**MOE_PRESETS[preset]) if preset in MOE_PRESETS else LlamaConfig(**LLAMA_PRESETS[preset])
    check_model_folder(args)
    return config


# Any one of them lets transformers build a fast tokenizer (the others are converted).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                   "vocab.txt")

# Weight files transformers loads from a model folder (torch, safetensors, GGUF; sharded: their index).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")  # an index: its shards checked below


def check_model_folder(args: argparse.Namespace) -> None:
    """A local --model_name_or_path without weights or with a weight file cut short (a failed copy or download), or a
    local tokenizer folder without a tokenizer: one line naming the file or folder before any data is loaded
    (transformers said it only once the model loaded, after the data, in an OSError or safetensors traceback or
    "Couldn't instantiate the backend tokenizer")."""
    name = args.model_name_or_path
    if name and os.path.isdir(name):
        if not any(f.endswith(WEIGHT_SUFFIXES) for f in os.listdir(name)):
            fail(f"--model_name_or_path {name}: the folder holds a config but no weights (no *.safetensors or "
                 "pytorch_model*.bin); copy or download the model's weight files there")
        for path in safetensors_files(name):
            problem = safetensors_problem(path)
            if problem:
                fail(f"--model_name_or_path {name}: {path} {problem}; copy or download the model again")
    flag, folder = ("--tokenizer_name", args.tokenizer_name) if getattr(args, "tokenizer_name", None) else \
        ("--model_name_or_path", name)
    if folder and os.path.isdir(folder) and not any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        fail(f"{flag} {folder}: the folder holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the "
             "model's tokenizer there (tokenizer.save_pretrained) or pass --tokenizer_name")


def safetensors_files(folder: str) -> list[str]:
    """The weight files of a model folder: those its index names (a sharded model; one missing is named), else every
    *.safetensors file in it."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return sorted(glob.glob(os.path.join(glob.escape(folder), "*.safetensors")))
    try:
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        fail(f"--model_name_or_path {folder}: {index} is not a valid safetensors index ({type(e).__name__}: {e})")
    for shard in shards:
        if not os.path.isfile(os.path.join(folder, shard)):
            fail(f"--model_name_or_path {folder}: {shard}, named by {index}, is missing")
    return [os.path.join(folder, shard) for shard in shards]


def safetensors_problem(path: str) -> str | None:
    """What makes a safetensors file unreadable, from its header and size alone (8 bytes of header length, the JSON
    header, then the tensors' bytes at the offsets it gives): None when they agree."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little") if size >= 8 else None
        if length is None or 8 + length > size:
            return f"is cut short ({size:,} bytes: its header is incomplete)"
        try:
            header = json.loads(f.read(length))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            return "has a damaged header (not the JSON safetensors writes)"
    if 8 + length + end > size:
        return f"is cut short ({size:,} bytes, its header describes {8 + length + end:,})"
    return None


def add_finetuning_args(parser: argparse.ArgumentParser, truncates: bool = True) -> None:
    """The flags the fine-tuning scripts share: sequence length, length grouping, freezing. `truncates` False:
    GRPO's --max_seq_length, the context a prompt and its completion share."""
    g = parser.add_argument_group("fine-tuning")
    g.add_argument("--max_seq_length", type=int, default=None,
                   help="Truncate longer examples (None: the tokenizer's limit, capped by the script)." if truncates else
                   "Context of a prompt and its completion: a prompt longer than this minus --max_completion_length "
                   "stops the run, naming its row; the default task leaves it out (None: the tokenizer's limit, capped by the "
                   "model's positions).")
    g.add_argument("--group_by_length", action="store_true",
                   help="Batches of similar lengths (less padding); evaluation sorted by length.")
    g.add_argument("--freeze_embeddings", action="store_true", help="Do not train the embedding layer.")
    g.add_argument("--freeze_layers", type=int, default=0, help="Do not train the first N transformer layers.")


def check_finetuning_flags(args: argparse.Namespace) -> None:
    """Fine-tuning starts from pretrained weights; the shared and the fine-tuning flags."""
    check_common_flags(args)
    if not args.model_name_or_path:
        fail("fine-tuning needs --model_name_or_path (a local folder or a hub id)")
    if args.config_name:
        fail("--config_name builds a model from scratch; fine-tuning loads --model_name_or_path")
    if args.max_seq_length is not None and args.max_seq_length < 2:
        fail(f"--max_seq_length must be >= 2 (got {args.max_seq_length})")
    if args.freeze_layers < 0:
        fail(f"--freeze_layers must be >= 0 (got {args.freeze_layers})")


def load_finetuning_config(args: argparse.Namespace) -> PretrainedConfig:
    """The pretrained model's config, checked against the fine-tuning flags (layers to freeze, sequence length)."""
    config = from_pretrained_or_fail(AutoConfig.from_pretrained, args.model_name_or_path, "--model_name_or_path")
    check_model_folder(args)
    if args.freeze_layers and args.freeze_layers > config.num_hidden_layers:
        fail(f"--freeze_layers {args.freeze_layers}: the model has {config.num_hidden_layers} layers")
    max_positions = getattr(config, "max_position_embeddings", None)
    if args.max_seq_length and max_positions and args.max_seq_length > max_positions:
        fail(f"--max_seq_length {args.max_seq_length} is larger than the model's {max_positions} positions")
    return config


def check_block_size(config: PretrainedConfig, block_size: int) -> None:
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions is not None and block_size > max_positions:
        fail(f"--block_size {block_size} is larger than the model's max_position_embeddings ({max_positions})")


def build_causal_lm(args: argparse.Namespace, config: PretrainedConfig, vocab_size: int,
                    **load_kwargs) -> PreTrainedModel:
    """Pretrained weights when --model_name_or_path is given, else a fresh model from `config`; fp32 unless
    `load_kwargs` (`from_pretrained` arguments, see common/features/lora.py) say otherwise.

    Weights are loaded here, before any torch.compile, so compiled and exported models hold the same keys.
    """
    kwargs = {"attn_implementation": args.attn_implementation, "dtype": torch.float32, **load_kwargs}
    if args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, config=config, **kwargs)
        if vocab_size > model.get_input_embeddings().num_embeddings:
            model.resize_token_embeddings(vocab_size)
    else:
        config.vocab_size = vocab_size
        model = build_from_config(config, **kwargs)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model


def build_from_config(config: PretrainedConfig, **kwargs) -> PreTrainedModel:
    """A fresh model whose initial weights are those one process draws from the seed, under every engine.

    Under ZeRO-3, transformers builds the model partitioned inside `deepspeed.zero.Init` and rank 0 draws each module's
    weights, gathered, without the construction-time init a full build runs first: other random numbers (the same at
    any ZeRO-3 process count, not the model of 1 process, DDP, ZeRO-1/2 or FSDP2). So rank 0 also builds the model in
    full, as one process does, and broadcasts each parameter into the partitions (`GatheredParameters` with
    `modifier_rank=0`); the copy is freed at once, and every rank's generator continues from where one process's
    would. That copy takes 4 bytes per parameter on rank 0 (fp32, in CPU memory, as one process needs): a model over
    half of rank 0's free memory keeps the partitioned init, and one line says so.
    """
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return AutoModelForCausalLM.from_config(config, **kwargs)
    import deepspeed
    import psutil
    from accelerate import PartialState
    from accelerate.utils import RNGType, broadcast_object_list, synchronize_rng_state

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):  # its draws are replaced below: they must not move the generators
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    is_rank0 = PartialState().is_main_process  # global rank 0: the `modifier_rank` below
    element_size = torch.empty(0, dtype=kwargs.get("dtype", torch.float32)).element_size()  # the full build's
    full_bytes = element_size * sum(full_numel(p) for p in model.parameters())  # (partitions may be bf16)
    free_bytes = psutil.virtual_memory().available if is_rank0 else 0
    [free_bytes] = broadcast_object_list([free_bytes])  # rank 0's answer, the same decision on every rank
    if full_bytes > free_bytes // 2:  # logged by the main process only
        logger.warning(f"ZeRO-3: the model ({full_bytes / 2**30:.2f} GiB) is over half of rank 0's free memory "
                       f"({free_bytes / 2**30:.2f} GiB), so it is initialised partitioned: the same at any ZeRO-3 "
                       "process count but not the model other engines draw from this seed; to start every engine "
                       "from the same weights, save them once and pass --model_name_or_path")
        return model
    full = None
    if is_rank0:
        with outside_zero3():
            full = AutoModelForCausalLM.from_config(config, **kwargs)
    weights = dict(full.named_parameters()) if is_rank0 else {}
    for name, parameter in model.named_parameters():
        with deepspeed.zero.GatheredParameters(parameter, modifier_rank=0), torch.no_grad():
            if is_rank0:
                parameter.copy_(weights[name])
    del full, weights
    synchronize_rng_state(RNGType.TORCH)  # rank 0's generator, past the full build, on every rank
    return model


def load_pretrained(from_pretrained, name: str, **kwargs) -> PreTrainedModel:
    """`from_pretrained(name, **kwargs)`, with one log line instead of transformers' LOAD REPORT table (terminal
    escape codes in a log) for the weights the checkpoint lacks (a new head) or holds in another shape or unused."""
    loader = logging.getLogger("transformers.modeling_utils")  # a level change there turns on another notice

    def no_report(record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()
    loader.addFilter(no_report)
    try:
        model, loading = from_pretrained(name, output_loading_info=True, **kwargs)
    finally:
        loader.removeFilter(no_report)
    for kind, what in (("missing_keys", "new, initialised here"), ("mismatched_keys", "of another shape there, "
                       "initialised here"), ("unexpected_keys", "unused")):
        keys = [key if isinstance(key, str) else key[0] for key in loading.get(kind) or ()]
        if keys:
            logger.info(f"{len(keys)} weights not in {name} ({what}): {', '.join(sorted(keys)[:6])}"
                        + (", ..." if len(keys) > 6 else ""))
    return model


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Non-reentrant activation checkpointing: safe under DDP (the reentrant kind marks parameters ready twice).

    The training forward passes `use_cache=False`; the config keeps its value, so an export still generates with a
    cache.
    """
    model.activation_checkpointing_enable({"use_reentrant": False})


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


def full_numel(parameter: torch.Tensor) -> int:
    """Elements of the whole parameter, also when this process holds only a part of it.

    Under ZeRO-3 (models built inside `deepspeed.zero.Init`) a parameter's tensor is an empty placeholder and its
    full size is `ds_numel`; an FSDP2 DTensor's `numel()` is already the global size. A bitsandbytes 4-bit weight
    packs two values per byte of its storage type.
    """
    count = getattr(parameter, "ds_numel", None) or parameter.numel()
    return count * 2 * parameter.element_size() if type(parameter).__name__ == "Params4bit" else count


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts, of the whole model under ZeRO-3 and FSDP too."""
    total = sum(full_numel(p) for p in model.parameters())
    trainable = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
    return trainable, total


@contextmanager
def outside_zero3() -> Iterator[None]:
    """transformers works inside as if no ZeRO-3 run were alive: for work done by one process alone.

    While its global DeepSpeed config says stage 3 (accelerate keeps it registered for the whole run), transformers
    builds every model partitioned inside `deepspeed.zero.Init`, and `generate()` steps in lockstep with the other
    processes (`synced_gpus`): collectives that processes not doing the same work never join, so the run hangs.
    accelerate's `zero3_init_context_manager(enable=False)` does not help: in accelerate 1.15 it registers the same
    stage-3 config again. So the config is unregistered for the block and registered again after it.
    """
    from transformers.integrations import deepspeed as hf_deepspeed

    config = registered_zero3_config()
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if config is not None:
            hf_deepspeed.set_hf_deepspeed_config(config)


def freeze_parameters(model: PreTrainedModel, embeddings: bool, num_layers: int) -> None:
    """Stop training the embeddings and/or the first `num_layers` transformer blocks (they keep their weights exactly).

    Works for encoders (BERT's `embeddings` module: words, positions, token types, norm) and decoders (the input
    embedding; an output head tied to it freezes with it). Blocks are the model's `ModuleList` of
    `num_hidden_layers` entries (BERT `encoder.layer`, Llama `layers`, ...).
    """
    base = model.base_model
    if embeddings:
        embeddings_module = getattr(base, "embeddings", None)
        (model.get_input_embeddings() if embeddings_module is None else embeddings_module).requires_grad_(False)
    if num_layers:
        blocks = next((m for m in base.modules()
                       if isinstance(m, nn.ModuleList) and len(m) == model.config.num_hidden_layers), None)
        if blocks is None:
            fail(f"--freeze_layers: no list of {model.config.num_hidden_layers} layers found in "
                 f"{type(model).__name__}")
        for block in blocks[:num_layers]:
            block.requires_grad_(False)
