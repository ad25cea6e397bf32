"""torch.compile, once: each repeated block (decoder layer) compiled in place and reused by every layer, with shapes
that do not recompile at every new length (docs/techniques.md#torchcompile)."""

from __future__ import annotations

import argparse
import json
import logging
import os

import torch
from accelerate.logging import get_logger

from common.errors import fail

logger = get_logger(__name__)


def add_compile_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("torch.compile")
    g.add_argument("--torch_compile", action="store_true",
                   help="torch.compile each repeated block (decoder layer) once, reused by every layer (regional).")
    g.add_argument("--torch_compile_whole_model", action="store_true",
                   help="With --torch_compile: one graph for the whole model. For a model without repeated blocks, "
                        "or a long run on fixed shapes whose fusion across layers repays a cold compile that grows "
                        "with the number of layers (minutes for 1B+ models).")
    g.add_argument("--torch_compile_backend", default="inductor",
                   help="torch.compile backend (aot_eager and eager only trace: for debugging).")
    g.add_argument("--torch_compile_mode", choices=("default", "reduce-overhead", "max-autotune"),
                   help="torch.compile mode (None: torch's default).")


def check_compile_flags(args: argparse.Namespace) -> None:
    if (args.torch_compile_whole_model or args.torch_compile_mode) and not args.torch_compile:
        fail("--torch_compile_whole_model and --torch_compile_mode need --torch_compile")
    if args.torch_compile and deepspeed_zero_stage() == 3:
        fail("--torch_compile under DeepSpeed ZeRO-3: its parameter-gathering hooks cut every layer's graph (measured: "
             "55 graph breaks in 8 steps of a 2-layer model, torch's recompile limit passed); use ZeRO-2 or FSDP2 "
             "(accelerate_configs/fsdp2.yaml) with --torch_compile, or leave it off")


def deepspeed_zero_stage() -> int | None:
    """The ZeRO stage `accelerate launch` runs the script under: its config's zero_stage or the DeepSpeed JSON's."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    if os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        return int(os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"])
    try:
        with open(os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", ""), encoding="utf-8") as f:
            return int(json.load(f).get("zero_optimization", {}).get("stage", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return None  # no readable JSON: common/features/deepspeed_check.py names the problem


def compile_model(model: torch.nn.Module, whole_model: bool, backend: str, mode: str | None,
                  lengths_vary: bool = False) -> None:
    """Compile in place, before `accelerator.prepare` (nn.Module.compile: the state dict keeps its keys, and hooks
    that DDP, DeepSpeed or FSDP2 add later still run, as accelerate's own DeepSpeed and FSDP2 paths rely on).

    Regional (the default), as torch's regional-compilation recipe: each block of the repeated blocks (a ModuleList of
    one class) is compiled, so one compilation serves every layer and a cold start takes seconds; the embedding,
    final norm and head stay eager (one kernel each). accelerate's `compile_regions` compiles those too, through one
    wrapper whose cache they share: with evaluation and a one-row batch its entries passed torch's recompile limit
    (8), after which it ran eagerly, silently (measured, accelerate 1.15, torch 2.13).

    Shapes: torch's automatic dynamic shapes (`dynamic=None`, not accelerate's launcher default, which exports
    ACCELERATE_DYNAMO_USE_DYNAMIC=False: with it every new sequence length compiled again). A dimension is compiled
    static; the first time it changes it is compiled once more as a symbol, which every later length reuses.
    `lengths_vary` (padded batches: SFT, DPO, classification): symbolic from the first graph (`dynamic=True`), which
    saves that static graph in each state a layer runs in (training, evaluation, DPO's reference): a LoRA DPO run
    has three, and twice three passed torch's recompile limit of 8 once a batch of another size came.
    """
    if whole_model:
        model.compile(backend=backend, mode=mode)
        return
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1
             and len({type(block) for block in m}) == 1]
    inner = {id(m) for blocks in lists for block in blocks for m in block.modules()}  # e.g. experts inside a layer
    blocks = [block for blocks in lists if id(blocks) not in inner for block in blocks]
    if not blocks:
        fail(f"--torch_compile: {type(model).__name__} has no repeated blocks to compile one at a time; add "
             "--torch_compile_whole_model")
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and not any(p.requires_grad for p in embeddings.parameters()) and \
            any(p.requires_grad for block in blocks for p in block.parameters()):
        # A frozen embedding (LoRA, --freeze_embeddings) hands the first block an input that needs no gradient, the
        # others one that does: dynamo guards on it and compiles every graph twice. One kind of input for all.
        embeddings.register_forward_hook(_needs_grad_where_grad_is_on)
    for block in blocks:
        block.compile(backend=backend, mode=mode, dynamic=True if lengths_vary else None)
    warn_if_compiled_code_falls_back()


def _needs_grad_where_grad_is_on(module, inputs, output: torch.Tensor) -> None:
    # Without gradients (evaluation, a reference pass) no block's input needs one: undone after transformers' and
    # peft's own hook (set with checkpointing), which asks for it always. Registered last, this hook runs last.
    output.requires_grad_(torch.is_grad_enabled())


_fallbacks: list[str] = []  # torch's warnings that a compiled function passed its recompile limit


class _FallbackWarning(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "hit config." in message and "recompile_limit" in message:
            _fallbacks.append(message)
            logger.warning("--torch_compile: a compiled layer passed torch's recompile limit and runs EAGERLY (slower) "
                           "from now on; all_results.json counts it (compile_fallbacks). torch said: "
                           + " | ".join(line.strip() for line in message.splitlines()[:3]))


def warn_if_compiled_code_falls_back() -> None:
    """dynamo says it only once, in torch's log, when a function's graphs pass its recompile limit (8) and the
    function then runs eagerly for good: repeat it in the run's log, and count it for all_results.json."""
    dynamo_log = logging.getLogger("torch._dynamo.convert_frame")
    if not any(isinstance(h, _FallbackWarning) for h in dynamo_log.handlers):
        dynamo_log.addHandler(_FallbackWarning())


def compile_counts() -> dict[str, int]:
    """Graphs torch.compile built in this process and the graph breaks it met, for all_results.json (torch 2.13:
    dynamo's `counters`, private: no public count; tests/test_compile.py reads them through here)."""
    from torch._dynamo.utils import counters

    return {"compiled_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()), "compile_fallbacks": len(_fallbacks)}
