"""FSDP2 on a machine without CUDA (the tests' 2 CPU processes standing in for 2 GPUs): accelerate 1.15 builds an
FSDP launch's CPU Accelerator (`cpu=True`, gloo) as plain DDP, without a word. Here it is made to shard after all: an
FSDP plugin from the launcher's FSDP_* variables, with the run's precision, and the state marked FSDP
(common/upstream.py), so that `prepare`, `save_state` and `get_state_dict` take the FSDP paths, as on GPUs.
FSDP1 needs CUDA: refused in one line. On a GPU machine this does nothing.
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin

from common.errors import fail, fail_on_every_rank
from common.upstream import use_fsdp_everywhere


def launched_with_fsdp() -> bool:
    """`accelerate launch` with an FSDP config (or --use_fsdp) exports ACCELERATE_USE_FSDP=true."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def use_fsdp2_on_cpu(accelerator: Accelerator) -> None:
    """Right after `build_accelerator`: an FSDP launch without CUDA shards with FSDP2 (see the module's docstring)."""
    if torch.cuda.is_available() or not launched_with_fsdp():
        return
    if os.environ.get("FSDP_VERSION", "1") != "2":
        fail("FSDP on CPU needs FSDP2 (fsdp_version: 2, as in accelerate_configs/fsdp2.yaml); FSDP1 needs CUDA")
    plugin = FullyShardedDataParallelPlugin()
    precision = accelerator.state.mixed_precision
    if precision != "no":
        plugin.set_mixed_precision(precision)
    if precision == "fp8" and plugin.cpu_ram_efficient_loading:
        # accelerate refuses this pair on GPUs (its check ran while the state was still MULTI_CPU): same answer here
        fail_on_every_rank(accelerator, "fp8 (torchao) with FSDP2 cannot use cpu_ram_efficient_loading; use "
                           "accelerate_configs/fsdp2_fp8.yaml")
    accelerator.state.fsdp_plugin = plugin
    use_fsdp_everywhere(accelerator)
