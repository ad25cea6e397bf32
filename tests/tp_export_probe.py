"""A tensor-parallel model (common/features/tensor_parallel.py) trained two steps, exported, and its export loaded
with `from_pretrained` by the main process alone: prints `PROBE {...}` with the relative difference of the logits.
Run by tests/test_tensor_parallel.py under `accelerate launch --config_file accelerate_configs/tp.yaml`."""

from __future__ import annotations

import importlib.util
import json
import sys

root, init_model, output_dir = sys.argv[1:4]
sys.path.insert(0, root)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from common.export import export_model  # noqa: E402
from common.features.tensor_parallel import (hide_parallelism_config_on_cpu, shard_model,  # noqa: E402
                                             tensor_parallel_prepared, use_tensor_parallel)
from common.lifecycle import finish  # noqa: E402
from common.runtime import build_accelerator  # noqa: E402

spec = importlib.util.spec_from_file_location("pretrain_llama", f"{root}/scripts/pretrain_llama.py")
pretrain = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pretrain)
hide_parallelism_config_on_cpu()
accelerator = build_accelerator(pretrain.parse_args(["--output_dir", output_dir, "--mixed_precision", "no"]))
use_tensor_parallel(accelerator)
model = shard_model(AutoModelForCausalLM.from_pretrained(init_model, dtype=torch.float32), accelerator)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)
tensor_parallel_prepared(accelerator, model)
ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
for _ in range(2):
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    optimizer.zero_grad()
with torch.no_grad():
    logits = model(input_ids=ids).logits
export_model(accelerator, model, AutoTokenizer.from_pretrained(init_model), output_dir)
if accelerator.is_main_process:
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(output_dir)(input_ids=ids).logits
    print("PROBE " + json.dumps({"relative_difference": ((exported - logits).norm() / logits.norm()).item(),
                                 "vocab_size": model.config.vocab_size,
                                 "lm_head": type(model.lm_head.weight).__name__}), flush=True)
finish(accelerator)
