"""LoRA and QLoRA under every engine, 2 CPU processes: DDP, DeepSpeed ZeRO-2 and ZeRO-3, FSDP2.

Each run trains 4 optimizer steps on a global batch of 8 sequences in fp32 without clipping (as tests/test_fsdp.py):
one plain process x 4 x 2 accumulation steps (the reference) or 2 processes x 2 x 2. Properties:
- 2 processes = 1 process: the exported adapter equals the one-process run's to WEIGHT_TOL (measured <= 7e-7), for
  LoRA (DDP, ZeRO-2, ZeRO-3, FSDP2) and QLoRA (DDP, ZeRO-3, FSDP2: bitsandbytes 0.50.2 and accelerate 1.15 allow
  all three on CPU, the 4-bit base stored as fp32 under the two sharded engines);
- the saved adapter is complete: every tensor, none empty (ZeRO-3 saving the module as it is gave users a 40-byte
  file, FSDP2 one rank's slice);
- a DeepSpeed checkpoint holds the adapter, not the frozen base; FSDP2's holds the sharded model (accelerate's
  save_state has no adapter-only path), reported by size;
- resuming the step-2 checkpoint on the same engine ends at the uninterrupted run's adapter, bit for bit, with the
  default --lora_dropout (the runs compared with one process have dropout off: see NO_DROPOUT).
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import launcher, run_script, train_losses
from safetensors.torch import load_file
from test_fsdp import fsdp_launcher
from test_lora import LORA, data, data_args  # noqa: F401 (data is a fixture)

WEIGHT_TOL = 1e-5
TRAINING = ("--max_steps", "4", "--learning_rate", "1e-3", "--logging_steps", "1", "--seed", "0",
            "--gradient_accumulation_steps", "2", "--mixed_precision", "no", "--max_grad_norm", "0")
ENGINES = {"ddp": lambda: launcher("cpu_2proc.yaml"), "zero2": lambda: launcher("deepspeed_zero2.yaml"),
           "zero3": lambda: launcher("deepspeed_zero3.yaml"), "fsdp2": lambda: fsdp_launcher(2)}
QLORA = ("--load_in_4bit",)
# 2 processes cannot draw one process's dropout masks (each rank draws its own, for its half of the batch), so the
# runs compared across process counts train without dropout; the resume test keeps the default.
NO_DROPOUT = ("--lora_dropout", "0")


def finetune(data: dict, name: str, engine: str | None, *extra: str, dropout: bool = False) -> str:  # noqa: F811
    out = os.path.join(data["dir"], name)
    run_script("finetune_causal_lm.py", *data_args(data, out), *LORA, *(() if dropout else NO_DROPOUT), *TRAINING,
               "--per_device_train_batch_size", "4" if engine is None else "2", *extra,
               launcher=ENGINES[engine]() if engine else None)
    return out


def adapter(out: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(out, "adapter_model.safetensors"))


def compare(out: str, reference: str) -> float:
    """Same tensors, none empty, and their largest difference from the reference's."""
    got, expected = adapter(out), adapter(reference)
    assert got.keys() == expected.keys() and len(got) == 28
    assert all(got[k].shape == expected[k].shape and got[k].numel() > 0 for k in got)
    return max((got[k] - expected[k]).abs().max().item() for k in got)


@pytest.fixture(scope="module")
def references(data) -> dict[str, str]:  # noqa: F811
    return {"lora": finetune(data, "one_process_lora", None),
            "qlora": finetune(data, "one_process_qlora", None, *QLORA)}


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_ddp_matches_one_process(kind, data, references):  # noqa: F811
    out = finetune(data, f"ddp_{kind}", "ddp", *(QLORA if kind == "qlora" else ()))
    difference = compare(out, references[kind])
    print(f"{kind} DDP vs one process: adapter max difference {difference:.1e}")
    assert difference < WEIGHT_TOL
    assert train_losses(out) == pytest.approx(train_losses(references[kind]), abs=1e-5)


def checkpoint_contents(checkpoint: str, engine: str) -> str:
    """Assert what the checkpoint holds of the model; describe it."""
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(checkpoint) for f in files)
    if engine == "fsdp2":
        model_bytes = sum(os.path.getsize(os.path.join(checkpoint, "pytorch_model_fsdp_0", f))
                          for f in os.listdir(os.path.join(checkpoint, "pytorch_model_fsdp_0")))
        return f"{size:,} bytes, of which the sharded model (base included) {model_bytes:,}"
    engine_dir = os.path.join(checkpoint, "pytorch_model")
    states = [f for f in os.listdir(engine_dir) if f.endswith("model_states.pt")]
    for name in states:
        saved = torch.load(os.path.join(engine_dir, name), map_location="cpu", weights_only=False)
        assert len(saved["module"]) == 28 and all(".lora_" in k for k in saved["module"]), name
        assert saved["frozen_param_fragments"] is None and saved["frozen_param_shapes"] is None, name
    return f"{size:,} bytes, model states: adapter only"


@pytest.mark.parametrize("engine", ["zero2", "zero3", "fsdp2"])
def test_sharded_engine_saves_the_whole_adapter_and_resumes_exactly(engine, data, references):  # noqa: F811
    out = finetune(data, engine, engine)
    difference = compare(out, references["lora"])
    print(f"LoRA {engine} vs one process: adapter max difference {difference:.1e}")
    assert difference < WEIGHT_TOL
    # The resume, with dropout on: against the uninterrupted run on the same engine.
    full = finetune(data, f"{engine}_dropout", engine, "--checkpointing_steps", "2", dropout=True)
    checkpoint = os.path.join(full, "checkpoints", "step_2")
    print(f"LoRA {engine} checkpoint: {checkpoint_contents(checkpoint, engine)}")
    resumed = finetune(data, f"{engine}_resumed", engine, "--resume_from_checkpoint", checkpoint, dropout=True)
    assert compare(resumed, full) == 0.0
    assert train_losses(resumed) == {s: v for s, v in train_losses(full).items() if s > 2}


@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_qlora_under_a_sharded_engine_matches_one_process(engine, data, references):  # noqa: F811
    out = finetune(data, f"{engine}_qlora", engine, *QLORA)
    difference = compare(out, references["qlora"])
    lora_difference = compare(references["qlora"], references["lora"])
    print(f"QLoRA {engine} vs one process: adapter max difference {difference:.1e} (QLoRA vs LoRA: "
          f"{lora_difference:.1e})")
    assert difference < WEIGHT_TOL < lora_difference  # the base really was 4-bit
