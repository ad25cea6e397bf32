"""LoRA and QLoRA with peft (bitsandbytes for the 4-bit base): the model the fine-tuning scripts train with
--use_peft, what their checkpoints and exports hold, and the merge. docs/lora.md says why each step is there.

The training loop does not change: the prepared model is a `PeftModel` whose only trainable parameters are the adapter
(and, for a classifier, its new head), so the optimizer, clipping and accumulation see only those.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import warnings
from collections.abc import Callable

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list, is_peft_model
from safetensors.torch import load_file
from torch import nn

from common.errors import fail, fail_on_every_rank
from common.export import use_tokenizer_special_tokens, write_all_or_nothing
from common.inputs.modeling import outside_zero3
from common.output_dir import discard, fsync_path
from common.paths import LEFTOVER_PREFIX, MERGED_DIR
from common.upstream import prepared_models, save_state_pre_hooks

# peft 0.21.2's PeftModel reads transformers 5's deprecated `is_gradient_checkpointing`: a FutureWarning on every run
# that is not the user's to act on (tests/test_upstream.py fails once peft stops reading it).
GRADIENT_CHECKPOINTING_NOTICE = "`is_gradient_checkpointing` is deprecated"
warnings.filterwarnings("ignore", message=GRADIENT_CHECKPOINTING_NOTICE, category=FutureWarning)

ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer but the output head


def lora_config(args: argparse.Namespace, task_type: str):
    """The flags' peft LoraConfig (`task_type` CAUSAL_LM, or SEQ_CLS: peft then also trains a classifier's head)."""
    from peft import LoraConfig

    targets = ALL_LINEAR if args.lora_target_modules == [ALL_LINEAR] else list(args.lora_target_modules)
    return LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                      target_modules=targets, task_type=task_type, bias="none")


def check_adapter_targets(args: argparse.Namespace, config, model_class, task_type: str) -> None:
    """Before any heavy work: every --lora_target_modules name matches a module peft can adapt, on a weightless
    (meta-device) copy of the model. peft itself only refuses names when none of them matches."""
    if not args.use_peft:
        return
    from accelerate import init_empty_weights
    from peft import get_peft_model
    from peft.tuners.tuners_utils import check_target_module_exists

    with init_empty_weights():
        model = model_class.from_config(copy.deepcopy(config))
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
    names = [name for name, _ in model.named_modules()]
    lora = lora_config(args, task_type)
    if lora.target_modules != ALL_LINEAR:
        for target in lora.target_modules:
            if not any(check_target_module_exists(lora_config_for(lora, target), name) for name in names):
                fail(f"--lora_target_modules {target}: no module of {type(model).__name__} has that name; its linear "
                     f"modules are: {', '.join(linear)}")
    try:
        get_peft_model(model, lora)
    except (ValueError, TypeError) as e:
        fail(f"--lora_target_modules {' '.join(args.lora_target_modules)}: peft cannot adapt the modules matched "
             f"({str(e).splitlines()[0][:120]}); adapt linear ones: {', '.join(linear)}")


def lora_config_for(lora, target: str):
    single = copy.copy(lora)
    single.target_modules = {target}
    return single


def base_model_kwargs(args: argparse.Namespace, accelerator: Accelerator, task_type: str) -> dict:
    """`from_pretrained` arguments for the model to train.

    Full fine-tuning: fp32 weights (mixed precision autocasts them). With --use_peft the base is frozen and needs no
    fp32 master copy: it is loaded in the run's 16-bit precision (bf16 halves its memory; the adapter stays fp32),
    and with --load_in_4bit quantized by bitsandbytes, one whole copy per process (`device_map` its own device;
    "auto" would spread one copy over every GPU of the node, which DDP cannot train).
    """
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    if not args.load_in_4bit:
        return {"dtype": dtype}
    from peft.utils.constants import SEQ_CLS_HEAD_NAMES  # the heads peft trains in full for SEQ_CLS
    from transformers import BitsAndBytesConfig

    sharded = accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=args.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=args.use_bnb_nested_quant, bnb_4bit_compute_dtype=dtype,
        # FSDP and ZeRO-3 shard tensors of one dtype: the packed 4-bit bytes are stored as the model's dtype there
        bnb_4bit_quant_storage=dtype if sharded else torch.uint8,
        # a classifier's new head trains in full (transformers keeps only the LM head out of 4 bits by itself)
        llm_int8_skip_modules=SEQ_CLS_HEAD_NAMES if task_type == "SEQ_CLS" else None)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:  # transformers refuses a device_map under ZeRO-3
        return {"dtype": dtype, "quantization_config": quantization}
    return {"dtype": dtype, "quantization_config": quantization, "device_map": {"": str(accelerator.device)}}


def add_adapter(args: argparse.Namespace, accelerator: Accelerator, model, task_type: str):
    """Wrap the loaded base model (gradient checkpointing already set) with a fresh LoRA adapter: every base weight
    frozen, the adapter's B matrices zero (so the model starts as the base). Without --use_peft: the model itself.

    Called once per run, before `prepare`; a resumed run gets its trained adapter back from the checkpoint
    (`accelerator.load_state`), never a second wrap. Registers the checkpoint hooks below.
    """
    from peft import get_peft_model

    if args.load_in_4bit:
        keep_4bit_layout(model)
    model = get_peft_model(model, lora_config(args, task_type))
    base, name = model.get_base_model(), base_model_name(args.model_name_or_path)
    # adapter_config.json names the base by peft_config; the model card (README.md) by the base's name and config
    model.peft_config["default"].base_model_name_or_path = base.name_or_path = base.config.name_or_path = name
    if accelerator.native_amp:
        keep_adapter_inputs_16bit(model)
    if keep_only_trainable_weights not in save_state_pre_hooks(accelerator):  # once per accelerator
        accelerator.register_save_state_pre_hook(keep_only_trainable_weights)
        accelerator.register_load_state_pre_hook(load_trainable_weights)
    return model


def base_model_name(name: str) -> str:
    """What the exported adapter_config.json and model card (README.md, peft's `base_model`, from the base's config)
    name the base by: a local folder's absolute path (peft stores the name as given, and a relative one loads only
    from the directory the run was started in), a hub id as given."""
    return os.path.abspath(os.path.expanduser(name)) if os.path.isdir(os.path.expanduser(name)) else name


def keep_4bit_layout(model: nn.Module) -> None:
    """bitsandbytes 0.50.2, on CPUs with AVX512-BF16, repacks a 4-bit layer's weight in place at its first no-grad
    evaluation forward (its scales rounded to bf16) and re-quantizes it on `state_dict()`: measured here, the frozen
    base then changes (logits moved by ~1e-3) and a merge into it gives garbage. Training keeps the layout it loaded.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def keep_adapter_inputs_16bit(model: nn.Module) -> None:
    """Under autocast (accelerate's bf16/fp16 `native_amp`), no fp32 copy of an adapter's input: peft's LoRA linear
    casts its 16-bit input to the fp32 adapter's dtype, drops out in fp32, and autocast casts it back to 16 bits for
    the adapter's matmul, which computes the same 16-bit product either way; the copy and its dropout output were
    8 bytes per input feature alive in every adapter's forward and backward (docs/lora.md, precision). peft's own
    4-bit layers already skip the cast under autocast; this is peft's switch (`peft.helpers.disable_input_dtype_casting`
    sets it for a block) set for the run. Only under autocast: without it an fp32 adapter needs fp32 inputs."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False


def trainable_names(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def keep_only_trainable_weights(models: list, weights: list, output_dir: str) -> None:
    """`save_state` hook (one process and DDP): a checkpoint holds the adapter (and a classifier's head), not the
    frozen base, which every start loads from the pretrained model. DeepSpeed is told the same by
    common/checkpoint.py; FSDP2 writes the whole sharded model (accelerate 1.15's save_state has no adapter-only
    path)."""
    for i, model in enumerate(models[:len(weights)]):
        if is_peft_model(model):
            keep = trainable_names(model)
            weights[i] = {k: v for k, v in weights[i].items() if k in keep}


def load_trainable_weights(models: list, input_dir: str) -> None:
    """`load_state` hook, the inverse of `keep_only_trainable_weights`: every trainable tensor must be in the file."""
    for i, model in enumerate(list(models)):
        if not is_peft_model(model):
            continue
        path = os.path.join(input_dir, "model.safetensors" if i == 0 else f"model_{i}.safetensors")
        state = load_file(path, device="cpu")
        missing = trainable_names(model) - state.keys()
        unexpected = set(state) - {name for name, _ in model.named_parameters()}
        if missing or unexpected:
            fail(f"--resume_from_checkpoint {input_dir}: its adapter does not fit this model (missing "
                 f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
        model.load_state_dict(state, strict=False)
        models.remove(model)


def adapter_state_dict(accelerator: Accelerator, model) -> dict | None:
    """The complete trained adapter weights, by the prepared model's parameter names, for `save_pretrained`
    (collective under DeepSpeed and FSDP: every process calls it). None: the unwrapped model's own are complete.

    ZeRO-3 keeps only a slice of each parameter on a process, FSDP2 a DTensor shard: saving the module as it is gave
    users a 40-byte empty adapter (ZeRO-3) or one rank's slice (FSDP2). DeepSpeed's fp32 master copy is gathered
    (the weights the optimizer steps, in any precision), FSDP2's full state dict without the frozen parameters.
    """
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        from deepspeed.utils import safe_get_full_fp32_param

        state = {}
        for name, p in unwrapped.named_parameters():
            if p.requires_grad:  # in the same order on every process: the gathers are collective
                full = safe_get_full_fp32_param(p)  # None without a ZeRO optimizer: the module's tensor is whole
                state[name] = (p if full is None else full).detach().cpu()
        return state
    if accelerator.distributed_type == DistributedType.FSDP:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(unwrapped, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))
    return None


def merge_adapter(model_class, base_path: str, adapter_dir: str, **load_kwargs):
    """The adapter saved in `adapter_dir` merged into a fresh copy of the base in its own stored precision (bf16 for
    most hub models, fp32 for the tests' tiny ones), on this process alone: never into the trained 4-bit base
    (rounding the merged weights to 4 bits loses the adapter; on these CPUs it gave garbage)."""
    from peft import PeftModel

    with outside_zero3():
        base = model_class.from_pretrained(base_path, dtype="auto", **load_kwargs)
        return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()


def add_peft_args(parser: argparse.ArgumentParser) -> None:
    """LoRA / QLoRA with peft (TRL's flag names), for both fine-tuning scripts (docs/lora.md)."""
    g = parser.add_argument_group("LoRA / QLoRA (peft)")
    g.add_argument("--use_peft", action="store_true",
                   help="Train a LoRA adapter on the frozen base model instead of all its weights.")
    g.add_argument("--lora_r", type=int, default=16, help="LoRA rank.")
    g.add_argument("--lora_alpha", type=int, default=32, help="LoRA scale numerator: the update is scaled by alpha/r.")
    g.add_argument("--lora_dropout", type=float, default=0.05, help="Dropout on the adapter's input.")
    g.add_argument("--lora_target_modules", nargs="+", default=["all-linear"],
                   help="Names of the modules to adapt (a name matches a full module path or its end); all-linear: "
                        "every linear layer but the output head.")
    g.add_argument("--load_in_4bit", action="store_true",
                   help="QLoRA: the frozen base quantized to 4 bits (bitsandbytes); needs --use_peft.")
    g.add_argument("--bnb_4bit_quant_type", default="nf4", choices=("nf4", "fp4"), help="The 4-bit data type.")
    g.add_argument("--use_bnb_nested_quant", action="store_true",
                   help="Quantize the 4-bit blocks' scales too (double quantization: ~0.4 bit per weight less).")
    g.add_argument("--merge_adapter", action="store_true",
                   help="Also write output_dir/merged: the adapter merged into a full-precision copy of the base.")


def check_peft_flags(args: argparse.Namespace) -> None:
    """The LoRA / QLoRA group (`add_peft_args`); --lora_target_modules is checked against the model
    in `check_adapter_targets`."""
    if args.load_in_4bit and not args.use_peft:
        fail("--load_in_4bit needs --use_peft: a 4-bit base cannot be trained, QLoRA trains a LoRA adapter on it")
    if args.merge_adapter and not args.use_peft:
        fail("--merge_adapter needs --use_peft: without it the run trains the whole model, no adapter to merge")
    if not args.use_peft:
        return
    if args.lora_r < 1 or args.lora_alpha <= 0:
        fail(f"--lora_r must be >= 1 and --lora_alpha > 0 (got {args.lora_r} and {args.lora_alpha})")
    if not 0 <= args.lora_dropout < 1:
        fail(f"--lora_dropout must be in [0, 1) (got {args.lora_dropout})")
    if "all-linear" in args.lora_target_modules and len(args.lora_target_modules) > 1:
        fail("--lora_target_modules all-linear already takes every linear layer: give it alone or list names")
    for flag in ("freeze_embeddings", "freeze_layers"):
        if getattr(args, flag):
            fail(f"--{flag} does nothing with --use_peft: the whole base model is frozen, only the adapter trains")


def check_vocab_size(config, vocab_size: int) -> None:
    """New tokens' embeddings would stay untrained under a frozen base: the model's own tokenizer only."""
    if vocab_size > config.vocab_size:
        fail(f"the tokenizer has {vocab_size} tokens, the model {config.vocab_size}: with --use_peft the new tokens' "
             "embeddings would stay untrained (the base is frozen); use the model's own tokenizer")


def export_adapter(accelerator: Accelerator, model, tokenizer, output_dir: str,
                   explain_failed_write: Callable | None = None) -> bool:
    """`common.export.export_model` for a LoRA run: adapter_config.json + adapter_model.safetensors (for
    `PeftModel.from_pretrained`) and the tokenizer; True, as `export_model`. Collective."""
    accelerator.wait_for_everyone()
    state_dict = adapter_state_dict(accelerator, model)
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    write_all_or_nothing(accelerator, output_dir, tokenizer,
                         lambda folder: unwrapped.save_pretrained(folder, state_dict=state_dict),
                         explain_failed_write=explain_failed_write)
    return True


def export_and_merge(model_class, base_path: str) -> Callable:
    """--merge_adapter as one export: the adapter (`export_adapter`), then the merged model (`export_merged_model`),
    a failed write of either explained by the same `explain_failed_write`."""
    def export(accelerator: Accelerator, model, tokenizer, output_dir: str,
               explain_failed_write: Callable | None = None) -> bool:
        if not export_adapter(accelerator, model, tokenizer, output_dir, explain_failed_write):
            return False
        export_merged_model(accelerator, tokenizer, output_dir, model_class, base_path, explain_failed_write)
        return True
    return export


def export_merged_model(accelerator: Accelerator, tokenizer, output_dir: str, model_class, base_path: str,
                        explain_failed_write: Callable | None = None, **load_kwargs) -> None:
    """--merge_adapter: the adapter exported in `output_dir` merged into a full-precision copy of the base (see
    `merge_adapter`), written to `output_dir/merged`, loadable with the model class alone. All or nothing: written
    into `output_dir/.tmp-merged` (its files synced) and renamed into place once complete; a failed write is removed,
    and `explain_failed_write(exception, partial folder)` may name it in one line (a full disk) that stops every rank,
    as in `common.export.write_all_or_nothing`. The main process does it; the others wait."""
    problem = None
    if accelerator.is_main_process:
        partial, folder = os.path.join(output_dir, LEFTOVER_PREFIX + MERGED_DIR), os.path.join(output_dir, MERGED_DIR)
        shutil.rmtree(partial, ignore_errors=True)
        merged = merge_adapter(model_class, base_path, output_dir, **load_kwargs)
        use_tokenizer_special_tokens(merged, tokenizer)
        try:
            merged.save_pretrained(partial, safe_serialization=True)
            tokenizer.save_pretrained(partial)
            for name in os.listdir(partial):
                fsync_path(os.path.join(partial, name))
        except Exception as exc:
            problem = explain_failed_write(exc, partial) if explain_failed_write else None
            shutil.rmtree(partial, ignore_errors=True)
            if problem is None:
                raise
        else:
            if os.path.isdir(folder):  # an earlier export's, replaced only now that the new one is whole
                discard(folder)
            os.replace(partial, folder)
            fsync_path(output_dir)
    problem = broadcast_object_list([problem])[0]  # only the main process writes: its verdict holds for all
    if problem:
        fail_on_every_rank(accelerator, problem)
    accelerator.wait_for_everyone()


def frozen_base_left_out(accelerator: Accelerator, loading: bool) -> dict:
    """`save_state`/`load_state` arguments: DeepSpeed writes a LoRA run's frozen base into every checkpoint unless
    told not to; the base comes from the pretrained model at every start (other engines: `keep_only_trainable_weights`)."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED or not any(map(is_peft_model, prepared_models(accelerator))):
        return {}
    return {"load_module_strict": False} if loading else {"exclude_frozen_parameters": True}
