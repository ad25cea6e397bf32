"""The parts of a vision-language model: its vision encoder, the projector into the language model, and the language
model, found by the names transformers gives them (LLaVA, Gemma 3, Qwen2/2.5/3-VL, Idefics3/SmolVLM, ...)."""

from __future__ import annotations

import copy

from torch import nn

from common.errors import fail

VISION_TOWERS = ("vision_tower", "visual", "vision_model")  # LLaVA / Gemma 3, Qwen-VL, Idefics3 / SmolVLM
PROJECTORS = ("multi_modal_projector", "connector", "merger", "mm_projector")  # Qwen-VL's merger sits in `visual`
LANGUAGE_MODELS = ("language_model", "text_model")


def named_part(model: nn.Module, names: tuple[str, ...]) -> tuple[str, nn.Module] | None:
    """The first (shallowest) module whose own name is one of `names`, with its full name."""
    found = [(name, module) for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in names]
    return min(found, key=lambda item: item[0].count("."), default=None)


def freeze_vision_parts(model: nn.Module, vision_tower: bool, projector: bool) -> None:
    """--freeze_vision_tower: the vision encoder's weights stop training (its projector, even when it sits inside the
    encoder as Qwen-VL's merger does, keeps training); --freeze_projector: the projector's."""
    tower, head = named_part(model, VISION_TOWERS), named_part(model, PROJECTORS)
    for flag, wanted, part in (("--freeze_vision_tower", vision_tower, tower), ("--freeze_projector", projector, head)):
        if wanted and part is None:
            fail(f"{flag}: no module of {type(model).__name__} is named {' or '.join(VISION_TOWERS if part is tower else PROJECTORS)}")
    if vision_tower:
        kept = {id(p) for p in head[1].parameters()} if head else set()
        for parameter in tower[1].parameters():
            if id(parameter) not in kept:
                parameter.requires_grad_(False)
    if projector:
        head[1].requires_grad_(False)


def language_model_linears(config) -> list[str]:
    """The full names of the language model's linear layers (not the output head) on a weightless copy of the model:
    LoRA's targets when --lora_target_modules is left at all-linear, so the vision encoder and projector stay out."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForImageTextToText

    with init_empty_weights():
        model = AutoModelForImageTextToText.from_config(copy.deepcopy(config))
    part = named_part(model, LANGUAGE_MODELS)
    if part is None:
        fail(f"--use_peft: no module of {type(model).__name__} is named {' or '.join(LANGUAGE_MODELS)}; name the "
             "language model's layers with --lora_target_modules")
    return [f"{part[0]}.{name}" for name, module in part[1].named_modules() if isinstance(module, nn.Linear)]


def fill_deepspeed_sizes(accelerator, config) -> None:
    """DeepSpeed's `auto` bucket sizes from the language model's width, as accelerate computes them from
    `config.hidden_size`, which a VLM's config lacks (its text config has it): accelerate 1.15 stops without them."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None or hasattr(config, "hidden_size"):
        return
    hidden = config.get_text_config().hidden_size
    zero = plugin.deepspeed_config.get("zero_optimization", {})
    sizes = {"reduce_bucket_size": hidden * hidden, "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
             "stage3_param_persistence_threshold": 10 * hidden}
    zero.update({key: value for key, value in sizes.items() if zero.get(key) == "auto"})


def block_classes(model: nn.Module) -> list[str]:
    """The class names of the model's stacks of blocks: each ModuleList of one class that is not inside another one
    (the vision encoder's blocks and the language model's decoder layers; not, say, the experts inside a layer)."""
    names, stacks = [], []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1 and \
                not any(name.startswith(stack + ".") for stack in stacks):
            stacks.append(name)
            names += [type(module[0]).__name__] if type(module[0]).__name__ not in names else []
    return names


def shard_vision_and_decoder_blocks(accelerator, model: nn.Module) -> None:
    """FSDP2 with transformer-based wrapping: the vision blocks and the decoder layers are the shard units, whatever
    classes the accelerate config names (a LlamaDecoderLayer would leave the vision encoder to the root unit; LLaVA's
    _no_split_modules, taken when the config names none, lists CLIPTextEmbeddings, which it does not hold)."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is not None and getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy) is \
            transformer_auto_wrap_policy:
        plugin.transformer_cls_names_to_wrap = block_classes(model)


def shard_units(model: nn.Module) -> dict[str, int]:
    """How many modules of each class FSDP2 made shard units (fully_shard renames a class C to FSDPC)."""
    from torch.distributed.fsdp import FSDPModule

    units: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            name = type(module).__name__.removeprefix("FSDP")
            units[name] = units.get(name, 0) + 1
    return units


def fit_engines(accelerator, model: nn.Module) -> None:
    """Before `prepare`: what DeepSpeed and FSDP2 would take from a text model, taken from the VLM's parts; and DDP
    told that some parameters never get a gradient (LLaVA's features come from the encoder's second-to-last layer by
    default: its last layer and norm are never used)."""
    from accelerate.utils import DistributedDataParallelKwargs

    fill_deepspeed_sizes(accelerator, model.config)
    shard_vision_and_decoder_blocks(accelerator, model)
    accelerator.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=True)
