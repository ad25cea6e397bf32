"""The shipped launch configs give the same training as one process: DDP and DeepSpeed ZeRO-1/2/3 (+ CPU offload).

Every run starts from the same saved tiny model (ZeRO-3 builds models partitioned, with its own random init, so a
shared starting point is what makes runs comparable) and trains 4 optimizer steps on a global batch of 8 sequences:
1 process x 4 sequences x 2 accumulation steps, or 2 processes x 2 x 2. All in fp32 (`--mixed_precision no`):
DeepSpeed's bf16 keeps bf16 weights with fp32 master copies, which autocast does not, so bf16 runs differ by bf16
rounding (~1e-2) and would hide real bugs. In fp32 the only difference is summation order: losses agree to
LOSS_RTOL, exported weights to WEIGHT_RTOL.

Properties, per config:
- the logged losses and gradient norms equal the single-process run's: the gradient is the mean over all
  processes' tokens (an unsynchronised or mis-scaled rank gives other losses from step 2 on);
- the model exported by rank 0 (loaded with `from_pretrained`) equals the single-process export: every rank and
  every ZeRO partition took the same steps;
- `--max_grad_norm 0` (no clipping) holds under DeepSpeed too: accelerate would otherwise fill the JSON's "auto"
  gradient_clipping with 1.0, and these gradient norms (~2-3) would be clipped;
- a large weight decay makes the decayed/not-decayed parameter split visible in the weights (ZeRO-3 builds
  parameters as empty 1-D tensors, which once put every matrix in the no-decay group).
DeepSpeed JIT-builds two C++ ops on first use (~30 s and ~50-90 s on 2 cores); TORCH_EXTENSIONS_DIR keeps them in a
per-user cache so later runs reuse them.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from conftest import ROOT, read_metrics, run_script

LOSS_RTOL = 1e-5     # measured: identical to ~1e-7 relative
# Per tensor, |a - b| / |b| (Frobenius). Measured <= 5e-6: Adam divides by sqrt(v), so an element whose gradient is
# near zero turns summation-order noise into a visible step (max 2e-5 absolute seen). A missing weight-decay term
# gives ~7e-3, an unsynchronised rank far more.
WEIGHT_RTOL = 1e-4
CONFIGS = os.path.join(ROOT, "accelerate_configs")
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(
    os.path.expanduser("~"), ".cache", "torch_extensions", f"py{sys.version_info[0]}{sys.version_info[1]}_cpu"))


def launcher(config: str, num_processes: int = 2) -> list[str]:
    return [ACCELERATE, "launch", "--config_file", os.path.join(CONFIGS, config), "--num_processes",
            str(num_processes), "--main_process_port", "0"]


@pytest.fixture(scope="module")
def init_model(corpus, tmp_path_factory) -> str:
    """A tiny Llama and its tokenizer, saved: the common starting point of every run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.data import train_bpe_tokenizer
    from common.modeling import LLAMA_PRESETS

    path = str(tmp_path_factory.mktemp("init"))
    with open(corpus["train"]) as f:
        tokenizer = train_bpe_tokenizer([json.loads(line)["text"] for line in f], vocab_size=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_PRESETS["tiny"], vocab_size=len(tokenizer)))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def train_args(corpus, init_model: str, output_dir, per_device_batch: int, *extra: str) -> list[str]:
    return ["--model_name_or_path", init_model, "--train_file", corpus["train"], "--validation_file",
            corpus["validation"], "--block_size", "64", "--cache_dir", str(output_dir) + "-cache",
            "--output_dir", str(output_dir), "--max_steps", "4", "--logging_steps", "1",
            "--per_device_train_batch_size", str(per_device_batch), "--gradient_accumulation_steps", "2",
            "--mixed_precision", "no", "--max_grad_norm", "0", "--learning_rate", "3e-3", "--weight_decay", "1.0",
            "--sample_max_new_tokens", "0", *extra]


def train_rows(output_dir) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(str(output_dir)) if "loss" in r}


def exported_weights(output_dir) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(output_dir)).state_dict()


def assert_same_training(run_dir, reference_dir, steps=(1, 2, 3, 4)) -> str:
    """Same losses and gradient norms at `steps`, same exported weights; returns the largest differences."""
    run, ref = train_rows(run_dir), train_rows(reference_dir)
    assert sorted(run) == sorted(steps)
    for step in steps:
        assert run[step]["loss"] == pytest.approx(ref[step]["loss"], rel=LOSS_RTOL), f"loss at step {step}"
        assert run[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=LOSS_RTOL), f"grad norm {step}"
    weights, ref_weights = exported_weights(run_dir), exported_weights(reference_dir)
    assert weights.keys() == ref_weights.keys()
    errors = {name: (torch.linalg.norm(value - ref_weights[name]) / torch.linalg.norm(ref_weights[name])).item()
              for name, value in weights.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= WEIGHT_RTOL, f"{worst}: relative difference {errors[worst]:.1e}"
    loss_diff = max(abs(run[s]["loss"] - ref[s]["loss"]) for s in steps)
    return f"max |loss difference| {loss_diff:.1e}, max relative weight difference {errors[worst]:.1e}"


@pytest.fixture(scope="module")
def reference(corpus, init_model, tmp_path_factory):
    """One process (cpu_1proc.yaml), 4 sequences x 2 accumulation steps: the run every config must reproduce."""
    out = tmp_path_factory.mktemp("runs") / "reference"
    run_script("pretrain_llama.py", *train_args(corpus, init_model, out, 4), launcher=launcher("cpu_1proc.yaml", 1))
    return out


@pytest.mark.parametrize("config", ["cpu_2proc.yaml", "deepspeed_zero1.yaml", "deepspeed_zero2.yaml",
                                    "deepspeed_zero2_offload.yaml", "deepspeed_zero3_offload.yaml"])
def test_two_processes_match_one(config, corpus, init_model, reference, tmp_path):
    out = tmp_path / config.removesuffix(".yaml")
    run_script("pretrain_llama.py", *train_args(corpus, init_model, out, 2), launcher=launcher(config))
    print(f"{config}: {assert_same_training(out, reference)}")


def test_zero3_matches_one_process_and_resumes(corpus, init_model, reference, tmp_path):
    """ZeRO-3 over 2 processes: same training; the export (gathered 16-bit weights) loads and matches; a run
    resumed from its step-2 checkpoint continues exactly as the uninterrupted one."""
    full, resumed = tmp_path / "zero3", tmp_path / "zero3-resumed"
    run_script("pretrain_llama.py", *train_args(corpus, init_model, full, 2, "--checkpointing_steps", "2"),
               launcher=launcher("deepspeed_zero3.yaml"))
    print(f"deepspeed_zero3.yaml: {assert_same_training(full, reference)}")
    checkpoint = full / "checkpoints" / "step_2"
    assert (checkpoint / "pytorch_model").is_dir()  # DeepSpeed's partitioned model + optimizer states
    run_script("pretrain_llama.py", *train_args(corpus, init_model, resumed, 2, "--resume_from_checkpoint",
                                                str(checkpoint)), launcher=launcher("deepspeed_zero3.yaml"))
    print(f"deepspeed_zero3.yaml resumed at step 2: {assert_same_training(resumed, full, steps=(3, 4))}")


def test_contradicting_deepspeed_json_fails_in_one_line(corpus, init_model, tmp_path):
    with open(os.path.join(ROOT, "ds_configs", "zero2.json")) as f:
        ds_config = json.load(f)
    ds_config.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1)
    (tmp_path / "ds.json").write_text(json.dumps(ds_config))
    (tmp_path / "accelerate.yaml").write_text(
        f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {tmp_path / 'ds.json'}\n"
        "num_machines: 1\nnum_processes: 1\n")
    proc = run_script("pretrain_llama.py", *train_args(corpus, init_model, tmp_path / "out", 2), check=False,
                      launcher=[ACCELERATE, "launch", "--config_file", str(tmp_path / "accelerate.yaml"),
                                "--main_process_port", "0"])
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "train_micro_batch_size_per_gpu=4 but --per_device_train_batch_size gives 2" in errors[0]
    assert "gradient_accumulation_steps=1 but --gradient_accumulation_steps gives 2" in errors[0]
    assert "pretrain_llama.py\", line" not in proc.stderr  # no traceback from the script (the launcher adds its own)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_zero_checkpoint_at_another_process_count_fails_in_one_line(corpus, init_model, tmp_path):
    """DeepSpeed cannot re-partition ZeRO states: a ZeRO-2 checkpoint written by 2 processes, resumed on 1 (same global
    batch), stops with one line before the data and the model are built (DeepSpeed alone raises its exception only
    after them, at load time)."""
    saved = tmp_path / "zero2"
    one_step = ("--max_steps", "1", "--checkpointing_steps", "1")
    run_script("pretrain_llama.py", *train_args(corpus, init_model, saved, 2, *one_step),
               launcher=launcher("deepspeed_zero2.yaml"))
    checkpoint = saved / "checkpoints" / "step_1"
    assert sorted(p.name for p in (checkpoint / "pytorch_model").glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    resumed = tmp_path / "resumed"
    proc = run_script("pretrain_llama.py", *train_args(corpus, init_model, resumed, 4, "--resume_from_checkpoint",
                                                       str(checkpoint)),
                      launcher=launcher("deepspeed_zero2.yaml", 1), check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: --resume_from_checkpoint {checkpoint} holds DeepSpeed ZeRO states partitioned over 2 "
                      "processes but this run has 1, and DeepSpeed cannot re-partition them: resume with "
                      "--num_processes 2, or train with accelerate_configs/fsdp2.yaml, whose checkpoints resume at "
                      "any process count"], proc.stderr[-3000:]
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr  # the script's status; the launcher returns 1
    assert "ZeRORuntimeException" not in proc.stderr and not (resumed / "metrics.jsonl").exists()
