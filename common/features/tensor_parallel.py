"""Tensor parallelism (`tp_size` in an accelerate config's `parallelism_config`), alone (accelerate_configs/tp.yaml)
or under FSDP2 (`dp_shard_size` x `tp_size`, accelerate_configs/fsdp2_tp.yaml): each decoder layer's projections are
split over the `tp` processes of a group, which see the same batches; the groups shard the rest FSDP2-style.

What is sharded how (torch's public DTensor API, the plan derived from the model's own `base_model_tp_plan`):
- q/k/v and gate/up projections column-wise (each process its share of the heads and of the MLP width), o and down
  projections row-wise (their outputs summed over the group); the embedding row-wise over the vocabulary, the LM head
  column-wise with its logits gathered (transformers' loss then runs unchanged on ordinary tensors);
- then `fully_shard` per decoder layer and on the root over the `dp_shard` dimension (size 1 under tp.yaml): every
  parameter ends a DTensor, norms included, so that `accelerator.clip_grad_norm_` and torch's distributed checkpoint
  (DCP) see one kind of tensor; checkpoints are sharded DCP folders, the export gathers full tensors.

accelerate 1.15's `prepare` cannot take such a model (docs/scaling.md): with FSDP2 its `_prepare_tp` imports
`transformers.integrations.tensor_parallel.ReplicateParallel`, which transformers 5.23 no longer has, and it refuses a
`ParallelismConfig` on a multi-process CPU run. So the model is sharded here before `prepare`, the state is FSDP2 for
the rest of the loop (`accumulate`, `backward`, `clip_grad_norm_`, `save_state`, `get_state_dict`), and
`shard_model` sets the parallelism config aside for `prepare` (which still deals the dataloaders out by data-parallel
rank: it reads the mesh's `tp` dimension) and `tensor_parallel_prepared` puts it back.
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig

from common.errors import fail
from common.upstream import use_fsdp_everywhere

logger = get_logger(__name__)
STYLES = ("colwise", "rowwise")  # the plan entries torch's ColwiseParallel / RowwiseParallel serve
SIZE_NAMES = ("dp_replicate", "dp_shard", "tp", "cp", "sp")


def launched_sizes() -> dict[str, int]:
    """The launcher's parallelism_config sizes (`accelerate launch` exports them), before any work; {} if none."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true" and \
            os.environ.get("TENSOR_PARALLEL_CONFIG_HIDDEN") != "true":
        return {}
    return {name: int(os.environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1") or 1) for name in SIZE_NAMES}


def tensor_parallel_size() -> int:
    return launched_sizes().get("tp", 1)


def check_tensor_parallel(args: argparse.Namespace, config) -> int:
    """One line before any work for what tensor parallelism cannot serve; returns tp_size (1: off)."""
    sizes, tp = launched_sizes(), tensor_parallel_size()
    if tp == 1:
        return 1
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if sizes["dp_shard"] * tp != world or sizes["dp_replicate"] > 1 or sizes["cp"] > 1 or sizes["sp"] > 1:
        fail(f"parallelism_config sizes {({k: v for k, v in sizes.items() if v > 1})} do not multiply to the {world} "
             "processes: tensor parallelism runs as dp_shard_size x tp_size = processes (accelerate_configs/tp.yaml, "
             "fsdp2_tp.yaml; pass --num_processes after --config_file)")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        fail(f"tp_size {tp} with DeepSpeed is not supported: use accelerate_configs/tp.yaml or fsdp2_tp.yaml")
    plan = getattr(config, "base_model_tp_plan", None) or {}
    others = sorted({style for style in plan.values() if style not in STYLES})
    if not plan or others:
        fail(f"tp_size {tp}: {type(config).__name__}'s tensor-parallel plan "
             f"{'uses ' + ', '.join(others) if others else 'is empty'} (mixture-of-experts layers included); only "
             f"plans of {' and '.join(STYLES)} layers (Llama-style models) are served")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name, None)
        if value is not None and value % tp:
            fail(f"tp_size {tp} does not divide the model's {name} ({value}): each process takes an equal share")
    refused = {"load_in_4bit": "QLoRA (--load_in_4bit)", "use_peft": "LoRA (--use_peft)",
               "torch_compile": "--torch_compile", "streaming": "--streaming", "use_liger_kernel": "Liger kernels",
               "chunked_cross_entropy": "--chunked_cross_entropy", "activation_offloading": "--activation_offloading",
               "selective_ac_option": "--selective_ac_option", "freeze_embeddings": "--freeze_embeddings",
               "freeze_layers": "--freeze_layers"}
    for flag, what in refused.items():
        if getattr(args, flag, None):
            fail(f"{what} is not supported with tensor parallelism (tp_size {tp}) yet; drop one of them")
    return tp


def refuse_tensor_parallel(recipe: str) -> None:
    """The recipes tensor parallelism is not wired into stop with one line."""
    if tensor_parallel_size() > 1:
        fail(f"tensor parallelism (tp_size {tensor_parallel_size()}) is wired into scripts/pretrain_llama.py and "
             f"scripts/finetune_causal_lm.py only, not {recipe}")


def hide_parallelism_config_on_cpu() -> None:
    """Before `build_accelerator`: without CUDA, accelerate 1.15 refuses a ParallelismConfig on a multi-process run
    (MULTI_CPU is not a "multi-device" type), so the Accelerator is built without it; `use_tensor_parallel` puts it
    back and attaches it."""
    if tensor_parallel_size() > 1 and not torch.cuda.is_available():
        os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = "false"
        os.environ["TENSOR_PARALLEL_CONFIG_HIDDEN"] = "true"


def use_tensor_parallel(accelerator: Accelerator) -> None:
    """After `build_accelerator` (and `use_fsdp2_on_cpu`): the accelerator gets its parallelism config and a
    (dp_shard, tp) mesh, and its state becomes FSDP2 (whose checkpoint, clipping and export paths serve DTensors)."""
    if tensor_parallel_size() == 1:
        return
    if os.environ.pop("TENSOR_PARALLEL_CONFIG_HIDDEN", None):
        os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"
    from torch.distributed.device_mesh import init_device_mesh

    quiet_tensor_parallel_warnings()
    pc = accelerator.parallelism_config or ParallelismConfig()
    mesh = init_device_mesh(accelerator.device.type, (pc.dp_shard_size, pc.tp_size), mesh_dim_names=("dp_shard", "tp"))
    accelerator.state.parallelism_config, accelerator.state.device_mesh = pc, mesh
    if getattr(accelerator.state, "fsdp_plugin", None) is None:  # tp.yaml has no FSDP section: checkpoints through DCP
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT",
                                                reshard_after_forward=True)
        if accelerator.state.mixed_precision != "no":
            plugin.set_mixed_precision(accelerator.state.mixed_precision)
        accelerator.state.fsdp_plugin = plugin
    use_fsdp_everywhere(accelerator)


VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"  # torch 2.13, fsdp/_fully_shard/_fsdp_state.py
REDISTRIBUTE_WARNING = "While redistributing from "  # torch 2.13, distributed/tensor/_redistribute.py's logger
REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


def quiet_tensor_parallel_warnings() -> None:
    """Two torch 2.13 warnings every process printed, about what does not happen here (tests/test_tensor_parallel.py
    fails once torch stops printing them, so these lines can go):
    - FSDP2's root returns the gathered logits as a view, and an in-place op on a view would drop its pre-backward
      hook: the recipes only read the model's outputs (the loss and logits are never changed in place);
    - DTensor redistributes over the (dp_shard, tp) mesh in two sequential collectives instead of one (the gradient
      norm's all-reduce, the export's all-gather): slower, not different (every rank runs the same two in the same
      order; the runs equal one process's, tests/test_tensor_parallel.py)."""
    warnings.filterwarnings("ignore", message=VIEW_WARNING, category=UserWarning)
    redistribute = logging.getLogger(REDISTRIBUTE_LOGGER)
    if not any(isinstance(f, TwoCollectivesFilter) for f in redistribute.filters):
        redistribute.addFilter(TwoCollectivesFilter())


class TwoCollectivesFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(REDISTRIBUTE_WARNING)


def shard_model(model, accelerator: Accelerator):
    """Tensor-parallel `model` over the mesh's `tp` dimension (the plan above), then FSDP2 over `dp_shard`; in place.
    Every process holds the same full model first (same seed, or the same checkpoint): each keeps its shards.

    The accelerator's parallelism config is set aside until `tensor_parallel_prepared`, so that `accelerator.prepare`
    skips its own TP step (the module's docstring); the mesh stays: the dataloaders are dealt out by data-parallel rank.
    """
    pc, mesh = accelerator.parallelism_config, accelerator.torch_device_mesh
    if pc is None or not pc.tp_enabled:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    style = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    prefix = f"{model.base_model_prefix}." if getattr(model, model.base_model_prefix, None) is not None else ""
    plan = {prefix + name: style[kind]() for name, kind in model.config.base_model_tp_plan.items()}
    plan[prefix + "embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    plugin = accelerator.state.fsdp_plugin
    plugin.set_auto_wrap_policy(model)  # while the layers' classes have their names (prepare asks for them again)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    parallelize_module(model.to(accelerator.device), mesh["tp"], plan)
    if tied:  # both split their weight along the vocabulary (Shard(0)): one parameter again, as before
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    kwargs = dict(mesh=mesh["dp_shard"], reshard_after_forward=plugin.reshard_after_forward,
                  mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy())
    for layer in model.get_decoder().layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    accelerator.tensor_parallel_config_set_aside, accelerator.state.parallelism_config = pc, None
    return model


def tensor_parallel_prepared(accelerator: Accelerator, model) -> None:
    """Right after `accelerator.prepare`: the parallelism config `shard_model` set aside is back on the state (the loss
    scale and the token count read the sizes from it), the accelerator's `gather_for_metrics` gathers over the
    data-parallel ranks (`gather_for_metrics_over_data_parallel`), and the run's first lines say how it is sharded."""
    if accelerator.state.parallelism_config is None and hasattr(accelerator, "tensor_parallel_config_set_aside"):
        accelerator.state.parallelism_config = accelerator.__dict__.pop("tensor_parallel_config_set_aside")
    if figures := sharding_figures(model, accelerator):
        logger.info(f"Tensor parallel: mesh {figures['mesh']}, {figures['parameters_per_process']:,} parameter "
                    "elements per process")
    gather = gather_for_metrics_over_data_parallel(accelerator)
    if gather:  # this accelerator's own: the evaluation (common/evaluation.py) calls it unchanged
        accelerator.gather_for_metrics = gather


def sharding_figures(model, accelerator: Accelerator) -> dict:
    """{"mesh": ..., "parameters_per_process": ...} of a tensor-parallel run ({} otherwise), for all_results.json."""
    pc = accelerator.parallelism_config
    if pc is None or not pc.tp_enabled:
        return {}
    from torch.distributed.tensor import DTensor

    mesh = {name: size for name, size in (("dp_shard", pc.dp_shard_size), ("tp", pc.tp_size)) if size > 1}
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    return {"mesh": mesh, "parameters_per_process": held}


def gather_for_metrics_over_data_parallel(accelerator: Accelerator):
    """`gather_for_metrics` under TP (None otherwise): accelerate's gathers from every process,
    so each example would count tp_size times and its last-batch cut (`GradientState.remainder`, counted in
    data-parallel batches) would keep the wrong rows. This gathers over the mesh's `dp_shard` dimension only (every
    tp rank then holds the same figures) and cuts the last batch as accelerate does."""
    pc = accelerator.parallelism_config
    if pc is None or not pc.tp_enabled:
        return None
    group, size = accelerator.torch_device_mesh["dp_shard"].get_group(), pc.dp_shard_size

    def gather(tensors: tuple[torch.Tensor, ...], use_gather_object: bool = False) -> tuple[torch.Tensor, ...]:
        gathered = []
        for tensor in tensors:
            parts = [torch.empty_like(tensor) for _ in range(size)]
            torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
            gathered.append(torch.cat(parts))
        state = accelerator.gradient_state
        cut = state.remainder if state.end_of_dataloader and state.remainder > 0 else None
        return tuple(t[:cut] for t in gathered)
    return gather
