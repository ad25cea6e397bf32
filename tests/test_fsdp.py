"""FSDP2 on CPU: `accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 --mixed_precision no`
really shards (torch's `fully_shard` over gloo) and trains exactly like one process.

Runs start from the saved tiny models of tests/test_distributed.py (pretraining) and tests/test_finetune_causal_lm.py
(SFT) and train 4 optimizer steps on a global batch of 8 sequences, in fp32: 1 process x 4 x 2 accumulation steps
(the plain cpu_1proc.yaml reference) or 2 FSDP2 processes x 2 x 2. Properties:
- 2 processes = 1 process: losses to LOSS_RTOL, exported weights to WEIGHT_RTOL (both measured ~1e-7 / ~4e-6), and
  the logged gradient norm to GRAD_NORM_RTOL: it is the fp32 norm of sharded gradients, summed in another order;
- the checkpoint is sharded: each rank writes its own torch.distributed.checkpoint file, about half of the bytes;
- a resumed run continues the uninterrupted one, on 2 processes and on 1 (same global batch, 2 -> 1): losses and
  weights to RESUME_RTOL (measured equal, weights ~2e-8); the newer checkpoint it passes over has a damaged shard
  (`--resume_from_checkpoint auto` names it), and the completion marker records every rank's shards;
- the export is gathered on every rank (accelerate's get_state_dict) and loads with `from_pretrained`;
- --gradient_checkpointing and --bf16 run under FSDP2 (bf16: losses within BF16_LOSS_RTOL of fp32);
- fsdp2_fp8.yaml hands accelerate an FSDP2 plugin it accepts next to torchao fp8 (fsdp2.yaml's
  cpu_ram_efficient_loading is refused there); with torchao installed, it also trains a step with Float8Linear layers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest
import torch
from conftest import ROOT, assert_each_damage_is_named, copy_checkpoints, damage, run_script, skip_line
from test_distributed import (  # noqa: F401 (init_model and reference are fixtures)
    ACCELERATE,
    LOSS_RTOL,
    WEIGHT_RTOL,
    exported_weights,
    init_model,
    reference,
    train_args,
    train_rows,
)
from test_finetune_causal_lm import sft  # noqa: F401 (fixture)

GRAD_NORM_RTOL = 1e-4  # measured <= 3e-7 here; fp32 rounding of a norm over shards can reach ~6e-5
RESUME_RTOL = 1e-6
BF16_LOSS_RTOL = 1e-2  # measured ~7e-4: bf16 rounding, not a bug
CONFIGS = os.path.join(ROOT, "accelerate_configs")


def fsdp_launcher(num_processes: int, config: str = "fsdp2.yaml") -> list[str]:
    """The command line of the README, plus a free port so that tests never collide."""
    return [ACCELERATE, "launch", "--config_file", os.path.join(CONFIGS, config), "--num_processes",
            str(num_processes), "--mixed_precision", "no", "--main_process_port", "0"]


def cpu_1proc_launcher() -> list[str]:
    return [ACCELERATE, "launch", "--config_file", os.path.join(CONFIGS, "cpu_1proc.yaml"), "--main_process_port", "0"]


def weight_difference(run_dir, reference_dir) -> float:
    """Largest per-tensor |a - b| / |b| (Frobenius) between two exports, each loaded with `from_pretrained`."""
    weights, reference_weights = exported_weights(run_dir), exported_weights(reference_dir)
    assert weights.keys() == reference_weights.keys()
    assert all(w.dtype == torch.float32 for w in weights.values())
    return max((torch.linalg.norm(w - reference_weights[k]) / torch.linalg.norm(reference_weights[k])).item()
               for k, w in weights.items())


def compare_runs(run_dir, reference_dir, steps, loss_rtol: float, grad_norm_rtol: float,
                 weight_rtol: float) -> str:
    """Assert the same losses and grad norms at `steps` and the same exported weights; report the differences."""
    run, ref = train_rows(run_dir), train_rows(reference_dir)
    assert sorted(run) == list(steps)
    loss_diff = max(abs(run[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in steps)
    norm_diff = max(abs(run[s]["grad_norm"] - ref[s]["grad_norm"]) / ref[s]["grad_norm"] for s in steps)
    weight_diff = weight_difference(run_dir, reference_dir)
    report = f"loss rel diff {loss_diff:.1e}, grad-norm rel diff {norm_diff:.1e}, weight rel diff {weight_diff:.1e}"
    assert loss_diff <= loss_rtol and norm_diff <= grad_norm_rtol and weight_diff <= weight_rtol, report
    return report


def assert_sharded_checkpoint(checkpoint) -> None:
    """Model and optimizer are torch.distributed.checkpoint folders with one file per rank, each about half."""
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        folder = checkpoint / part
        assert (folder / ".metadata").is_file(), part
        sizes = {f.name: f.stat().st_size for f in folder.glob("*.distcp")}
        assert sorted(sizes) == ["__0_0.distcp", "__1_0.distcp"], (part, sizes)  # each rank wrote its own
        assert all(0.35 < s / sum(sizes.values()) < 0.65 for s in sizes.values()), (part, sizes)  # not replicated
    assert not list(checkpoint.glob("pytorch_model*.bin")) and not list(checkpoint.glob("model*.safetensors"))


# ---- pretrain_llama.py -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fsdp_run(corpus, init_model, tmp_path_factory):
    """2 FSDP2 processes x 2 sequences x 2 accumulation steps, 4 steps, checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("fsdp") / "two_processes"
    run_script("pretrain_llama.py", *train_args(corpus, init_model, out, 2, "--checkpointing_steps", "2"),
               launcher=fsdp_launcher(2))
    return out


def test_two_processes_match_one_and_the_checkpoint_is_sharded(fsdp_run, reference):
    report = compare_runs(fsdp_run, reference, (1, 2, 3, 4), LOSS_RTOL, GRAD_NORM_RTOL, WEIGHT_RTOL)
    print(f"fsdp2 2 processes vs 1: {report}")
    assert_sharded_checkpoint(fsdp_run / "checkpoints" / "step_2")
    with open(fsdp_run / "all_results.json") as f:
        assert json.load(f)["num_processes"] == 2


def test_every_rank_file_is_recorded_and_each_damage_is_named(fsdp_run, tmp_path):
    """The completion marker lists both ranks' shards of the model and of the optimizer; a rank-1 shard truncated,
    missing or with a flipped byte fails verification, naming it."""
    checkpoint = fsdp_run / "checkpoints" / "step_2"
    with open(checkpoint / "checkpoint_complete.json") as f:
        recorded = json.load(f)["files"]
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert {f"{part}/__0_0.distcp", f"{part}/__1_0.distcp", f"{part}/.metadata"} <= set(recorded)
    assert_each_damage_is_named(checkpoint, "optimizer_0/__1_0.distcp", tmp_path)


@pytest.mark.parametrize("num_processes,damaged", [(2, ("optimizer_0/__1_0.distcp", "truncated")),
                                                   (1, ("pytorch_model_fsdp_0/__0_0.distcp", "flipped"))])
def test_resume_continues_the_run(num_processes, damaged, corpus, init_model, fsdp_run, tmp_path):
    """From the 2-process step-2 checkpoint, on 2 processes or on 1 (4 sequences per process: same global batch).
    The newer step-4 checkpoint has a damaged shard: `--resume_from_checkpoint auto` names it and passes over it."""
    out = tmp_path / f"resumed_on_{num_processes}"
    copy_checkpoints(fsdp_run, out, 2, 4)
    problem = damage(out / "checkpoints" / "step_4", *damaged)
    proc = run_script("pretrain_llama.py", *train_args(corpus, init_model, out, 4 // num_processes,
                                                       "--resume_from_checkpoint", "auto"),
                      launcher=fsdp_launcher(num_processes))
    assert [line.split("WARNING common.checkpoint: ")[1] for line in proc.stderr.splitlines()
            if "Skipping checkpoint" in line] == [skip_line(out / "checkpoints" / "step_4", problem)]
    print(f"resumed on {num_processes} process(es) vs uninterrupted: "
          f"{compare_runs(out, fsdp_run, (3, 4), RESUME_RTOL, GRAD_NORM_RTOL, RESUME_RTOL)}")


def test_gradient_checkpointing_and_bf16_run_under_fsdp2(corpus, init_model, reference, tmp_path):
    out = tmp_path / "gc_bf16"
    run_script("pretrain_llama.py", *train_args(corpus, init_model, out, 2, "--gradient_checkpointing", "--bf16",
                                                "--max_steps", "2"), launcher=fsdp_launcher(2))
    run, ref = train_rows(out), train_rows(reference)
    assert sorted(run) == [1, 2]
    for step in (1, 2):
        assert math.isfinite(run[step]["grad_norm"])
        assert run[step]["loss"] == pytest.approx(ref[step]["loss"], rel=BF16_LOSS_RTOL)
    with open(out / "config.json") as f:
        assert json.load(f)["use_cache"] is True  # checkpointing passes use_cache=False to the forward, not the config
    weights = exported_weights(out)
    assert all(w.dtype == torch.float32 and torch.isfinite(w).all() for w in weights.values())  # fp32 master weights


# ---- finetune_causal_lm.py ---------------------------------------------------------------------------------------

def finetune_args(sft: dict, out, per_device_batch: int, *extra: str) -> list[str]:
    return ["--model_name_or_path", sft["model"], "--train_file", sft["train"], "--validation_file", sft["validation"],
            "--output_dir", str(out), "--max_steps", "4", "--learning_rate", "1e-3", "--logging_steps", "1",
            "--seed", "0", "--mixed_precision", "no", "--max_grad_norm", "0", "--gradient_accumulation_steps", "2",
            "--per_device_train_batch_size", str(per_device_batch), *extra]


def test_finetune_two_processes_match_one_and_resume_on_one(sft, tmp_path):  # noqa: F811 (sft is a fixture)
    reference_dir, two, resumed = tmp_path / "one_process", tmp_path / "two_processes", tmp_path / "resumed_on_1"
    run_script("finetune_causal_lm.py", *finetune_args(sft, reference_dir, 4), launcher=cpu_1proc_launcher())
    # packed (the packing check runs on the sharded model) against one unpacked process: the same examples per step
    run_script("finetune_causal_lm.py", *finetune_args(sft, two, 2, "--checkpointing_steps", "2", "--packing"),
               launcher=fsdp_launcher(2))
    print(f"sft fsdp2 2 processes vs 1: "
          f"{compare_runs(two, reference_dir, (1, 2, 3, 4), LOSS_RTOL, GRAD_NORM_RTOL, WEIGHT_RTOL)}")
    assert_sharded_checkpoint(two / "checkpoints" / "step_2")
    run_script("finetune_causal_lm.py", *finetune_args(sft, resumed, 4, "--packing", "--resume_from_checkpoint",
                                                       str(two / "checkpoints" / "step_2")), launcher=fsdp_launcher(1))
    print(f"sft resumed on 1 process vs uninterrupted: "
          f"{compare_runs(resumed, two, (3, 4), RESUME_RTOL, GRAD_NORM_RTOL, RESUME_RTOL)}")


# ---- fp8 + FSDP2 -------------------------------------------------------------------------------------------------

def launched_environment(config: str, *launch_flags: str) -> dict[str, str]:
    """The variables `accelerate launch --config_file <config>` exports to each process (nothing is started)."""
    import accelerate.utils.launch as launch_utils
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", os.path.join(CONFIGS, config), *launch_flags,
                                               "script.py"])
    args, _, _ = _validate_launch_command(args)
    available = launch_utils.is_fp8_available
    launch_utils.is_fp8_available = lambda: True  # the launcher only checks that torchao is importable
    try:
        env = launch_utils.prepare_multi_gpu_env(args)
    finally:
        launch_utils.is_fp8_available = available
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}


def fsdp_plugin_from_environment(env: dict[str, str], monkeypatch):
    """The FSDP plugin accelerate (and common.runtime on CPU) builds from those variables in each process."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return FullyShardedDataParallelPlugin()


def test_fsdp2_fp8_config_is_one_accelerate_accepts(monkeypatch):
    """accelerate refuses torchao fp8 with FSDP2 when cpu_ram_efficient_loading is on (fsdp2.yaml); fsdp2_fp8.yaml
    turns it off and keeps the rest of fsdp2.yaml."""
    env = launched_environment("fsdp2_fp8.yaml")
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["ACCELERATE_MIXED_PRECISION"] == "fp8"
    # read by accelerate's AORecipeKwargs (which imports torchao, so it is not built here)
    assert env["ACCELERATE_FP8_BACKEND"] == "AO" and env["ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER"] == "True"
    assert env["ACCELERATE_FP8_PAD_INNER_DIM"] == "True"
    plugin = fsdp_plugin_from_environment(env, monkeypatch)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.transformer_cls_names_to_wrap is None  # the model's _no_split_modules: any architecture
    assert plugin.cpu_ram_efficient_loading is False  # what accelerate's torchao + FSDP2 check requires
    plain_fsdp2 = fsdp_plugin_from_environment(launched_environment("fsdp2.yaml", "--mixed_precision", "fp8"),
                                               monkeypatch)
    assert plain_fsdp2.cpu_ram_efficient_loading is True  # the combination accelerate refuses


@pytest.mark.parametrize("config", ["fsdp2.yaml", "fsdp2_tp.yaml", "fsdp2_fp8.yaml"])
def test_fsdp2_configs_shard_any_architecture_by_its_decoder_layers(config, monkeypatch):
    """The FSDP2 configs name no layer class, so accelerate shards by the model's `_no_split_modules`: one unit per
    decoder layer of a Llama, a Mixtral (the MoE presets) and a Qwen2 model. Naming LlamaDecoderLayer (as these
    files once did) refused the MoE presets and every other architecture at `prepare`."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2Config

    plugin = fsdp_plugin_from_environment(launched_environment(config), monkeypatch)
    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, vocab_size=64)
    for config_class in (LlamaConfig, MixtralConfig, Qwen2Config):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config_class(**small))
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
        units = [type(m).__name__ for m in model.modules() if policy(m)]
        assert units == [config_class.__name__.replace("Config", "DecoderLayer")] * 2, units


FP8_PROBE = """
import importlib.util, json, sys
root, init_model, output_dir = sys.argv[1:4]
sys.path.insert(0, root)
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from common.lifecycle import finish
from common.features.fsdp_on_cpu import use_fsdp2_on_cpu
from common.runtime import build_accelerator
spec = importlib.util.spec_from_file_location("pretrain_llama", f"{root}/scripts/pretrain_llama.py")
pretrain = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pretrain)
accelerator = build_accelerator(pretrain.parse_args(["--output_dir", output_dir]))
use_fsdp2_on_cpu(accelerator)
model = AutoModelForCausalLM.from_pretrained(init_model, dtype=torch.float32)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
kinds = [type(m).__name__ for m in model.modules()]
ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
losses = []
for _ in range(2):
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
from transformers import AutoTokenizer
from common.export import export_model
export_model(accelerator, model, AutoTokenizer.from_pretrained(init_model), output_dir)
if accelerator.is_main_process:
    print("PROBE " + json.dumps({"type": str(accelerator.distributed_type), "precision": accelerator.mixed_precision,
                                 "float8_layers": kinds.count("Float8Linear"), "losses": losses,
                                 "sharded": all(isinstance(p, DTensor) for p in model.parameters())}))
del model, optimizer
finish(accelerator)
"""


def run_fp8_probe(config: str, processes: int, init_model: str, tmp_path) -> tuple[list[str], dict]:
    """FP8_PROBE under `accelerate launch --config_file <config>`: the launcher's command and the probe's report;
    the probe also exports the trained model to tmp_path/out with common.export."""
    (tmp_path / "probe.py").write_text(FP8_PROBE)
    launcher = [ACCELERATE, "launch", "--config_file", os.path.join(CONFIGS, config), "--num_processes",
                str(processes), "--main_process_port", "0"]
    proc = subprocess.run([*launcher, str(tmp_path / "probe.py"), ROOT, init_model, str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    probe = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("PROBE "))[6:])
    print(f"{config}, {processes} process(es): {probe}")
    assert probe["precision"] == "fp8" and probe["float8_layers"] > 0
    assert all(math.isfinite(x) for x in probe["losses"])
    return launcher, probe


def assert_fp8_export_loads(init_model: str, output_dir) -> None:
    """The export holds every weight as a plain tensor (no fp8 wrapper), trained away from the start, and runs."""
    from transformers import AutoModelForCausalLM

    exported, info = AutoModelForCausalLM.from_pretrained(output_dir, output_loading_info=True)
    assert not any(info.values()), info
    start = AutoModelForCausalLM.from_pretrained(init_model).state_dict()
    weights = exported.state_dict()
    assert weights.keys() == start.keys()
    assert not torch.equal(weights["model.layers.0.mlp.up_proj.weight"], start["model.layers.0.mlp.up_proj.weight"])
    ids = torch.arange(8)[None] % exported.config.vocab_size
    assert torch.isfinite(exported(input_ids=ids).logits).all()


def test_fp8_one_process_trains_and_exports_with_torchao(init_model, tmp_path):
    """fp8.yaml (torchao float8 in one process) trains two steps with Float8Linear layers and its export loads: on an
    H200 the export once failed ("invalid python storage") while enable_fsdp_float8_all_gather wrapped each weight."""
    pytest.importorskip("torchao")
    _, probe = run_fp8_probe("fp8.yaml", 1, init_model, tmp_path)
    assert probe["type"] == "DistributedType.NO"
    assert_fp8_export_loads(init_model, tmp_path / "out")


def test_fsdp2_fp8_trains_two_steps_with_torchao(init_model, tmp_path):
    """With torchao installed (it is not in requirements.txt), fsdp2_fp8.yaml on 2 CPU processes gives the FSDP2
    state, sharded DTensor parameters and Float8Linear layers, takes two optimizer steps with finite losses, and its
    gathered export loads."""
    pytest.importorskip("torchao")
    launcher, probe = run_fp8_probe("fsdp2_fp8.yaml", 2, init_model, tmp_path)
    assert probe["type"] == "DistributedType.FSDP" and probe["sharded"]
    assert_fp8_export_loads(init_model, tmp_path / "out")
    # fsdp2.yaml (cpu_ram_efficient_loading on) with fp8: one line, as accelerate answers on GPUs
    proc = subprocess.run([*launcher[:3], os.path.join(CONFIGS, "fsdp2.yaml"), *launcher[4:], "--mixed_precision",
                           "fp8", str(tmp_path / "probe.py"), ROOT, init_model, str(tmp_path / "out2")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: fp8 (torchao) with FSDP2 cannot use cpu_ram_efficient_loading; use "
                      "accelerate_configs/fsdp2_fp8.yaml"], proc.stderr[-4000:]  # one line, from the main process
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr
