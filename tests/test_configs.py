"""Every shipped config parses the way accelerate and DeepSpeed will read it; the DS-JSON-vs-flags check; the memory
estimator's accounting. In-process and fast (no training)."""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

DS_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "ds_configs", "*.json")))
YAMLS = sorted(glob.glob(os.path.join(ROOT, "accelerate_configs", "*.yaml")))
ESTIMATE_MEMORY = os.path.join(ROOT, "tools", "estimate_memory.py")
FLAG_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")


@pytest.fixture(autouse=True)
def clean_accelerate_env(monkeypatch):
    """No launcher variables from the outer shell leak into these in-process checks."""
    for key in list(os.environ):
        if key.startswith("ACCELERATE_") or key == "WORLD_SIZE":
            monkeypatch.delenv(key)


def load_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def test_expected_files_exist():
    names = {os.path.basename(p) for p in DS_CONFIGS + YAMLS}
    assert {"zero1.json", "zero2.json", "zero2_offload.json", "zero3.json", "zero3_offload.json",
            "zero3_nvme_offload.json", "single_gpu.yaml", "multi_gpu.yaml", "multi_node.yaml", "fsdp2.yaml",
            "deepspeed_zero1.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml", "deepspeed_zero2_offload.yaml",
            "deepspeed_zero3_offload.yaml", "fp8.yaml", "cpu_1proc.yaml", "cpu_2proc.yaml"} <= names
    assert os.path.isfile(os.path.join(ROOT, "accelerate_configs", "slurm_multi_node.sbatch"))


@pytest.mark.parametrize("path", DS_CONFIGS, ids=os.path.basename)
def test_deepspeed_json_is_all_auto_and_valid(path):
    """Flags stay the single source of truth ("auto" everywhere), and DeepSpeed's own config class accepts the
    JSON once accelerate has filled the "auto" values (as it does at `prepare`)."""
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.runtime.config import DeepSpeedConfig

    config = load_json(path)
    name = os.path.basename(path)
    zero = config["zero_optimization"]
    assert zero["stage"] == int(name[4])
    assert all(config[key] == "auto" for key in FLAG_KEYS)
    assert config["bf16"]["enabled"] == config["fp16"]["enabled"] == "auto"
    if zero["stage"] == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True  # else the final export cannot gather
    if "offload" in name:
        assert zero["offload_optimizer"]["device"] in ("cpu", "nvme")
        optimizer = config["optimizer"]  # DeepSpeed's CPU Adam; accelerate fills lr and weight_decay only
        assert optimizer["type"] == "AdamW"
        assert optimizer["params"]["lr"] == optimizer["params"]["weight_decay"] == "auto"
        assert all(optimizer["params"][k] != "auto" for k in ("betas", "eps"))
        if zero["stage"] == 3:
            assert zero["offload_param"]["device"] == zero["offload_optimizer"]["device"]
    else:
        assert "optimizer" not in config  # the script's optimizer (incl. 8-bit) is used

    plugin = DeepSpeedPlugin(hf_ds_config=path)
    assert plugin.zero_stage == zero["stage"]
    plugin.deepspeed_config_process(must_match=False, **{
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "train_batch_size": 8, "bf16.enabled": True, "fp16.enabled": False, "optimizer.params.lr": 1e-3,
        "optimizer.params.weight_decay": 0.1, "zero_optimization.reduce_bucket_size": 4096,
        "zero_optimization.stage3_prefetch_bucket_size": 4096,
        "zero_optimization.stage3_param_persistence_threshold": 640})
    assert "auto" not in json.dumps(plugin.deepspeed_config)
    ds = DeepSpeedConfig(plugin.deepspeed_config)
    assert ds.zero_optimization_stage == zero["stage"]
    assert ds.train_batch_size == 8 and ds.gradient_accumulation_steps == 2 and ds.bfloat16_config.enabled


@pytest.mark.parametrize("path", YAMLS, ids=os.path.basename)
def test_accelerate_yaml_loads(path, monkeypatch):
    """accelerate's own loader reads it; DeepSpeed ones point at an existing JSON and carry no setting that
    accelerate refuses next to a JSON (mixed_precision, accumulation, clipping, stage, offload)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DeepSpeedPlugin, DistributedType

    config = load_config_from_file(path)
    name = os.path.basename(path)
    assert config.num_processes >= 1 and config.num_machines >= 1
    if name.startswith("deepspeed_"):
        assert config.distributed_type == DistributedType.DEEPSPEED
        json_path = os.path.join(ROOT, config.deepspeed_config["deepspeed_config_file"])
        assert os.path.isfile(json_path)
        assert config.mixed_precision is None
        # What `accelerate launch` hands the script, and the check accelerate then runs on it:
        monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", ",".join(config.deepspeed_config).lower())
        assert DeepSpeedPlugin(hf_ds_config=json_path).zero_stage == load_json(json_path)["zero_optimization"]["stage"]
    elif name == "fsdp2.yaml":
        assert config.distributed_type == DistributedType.FSDP
        fsdp = config.fsdp_config
        assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_reshard_after_forward"] is True
        assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp  # the model's _no_split_modules: any architecture
        assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT" and fsdp["fsdp_cpu_ram_efficient_loading"]
    elif name == "fsdp2_fp8.yaml":  # fsdp2.yaml with torchao fp8, which accelerate refuses with cpu_ram_efficient_loading
        assert config.distributed_type == DistributedType.FSDP and config.mixed_precision == "fp8"
        assert config.fp8_config["backend"] == "AO" and config.fsdp_config["fsdp_version"] == 2
        assert config.fsdp_config["fsdp_cpu_ram_efficient_loading"] is False
    elif name in ("tp.yaml", "fsdp2_tp.yaml"):  # accelerate's parallelism_config keys; sizes x = the process count
        sizes = config.parallelism_config
        assert sizes["parallelism_config_tp_size"] == 2 and config.mixed_precision == "bf16"
        assert sizes.get("parallelism_config_dp_shard_size", 1) * 2 == config.num_processes
        assert config.distributed_type == (DistributedType.FSDP if name == "fsdp2_tp.yaml" else DistributedType.MULTI_GPU)
        if name == "fsdp2_tp.yaml":
            assert config.fsdp_config["fsdp_version"] == 2
            assert config.fsdp_config["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    elif name == "fp8.yaml":
        assert config.mixed_precision == "fp8" and config.fp8_config["backend"] == "AO"
    elif name == "default.yaml":  # the Quick start's: one process wherever it runs, the script's flags pick precision
        assert config.distributed_type == DistributedType.NO and config.num_processes == 1
        assert config.mixed_precision == "no" and not config.use_cpu and config.dynamo_config == {}
    elif name.startswith("cpu_"):
        assert config.mixed_precision == "no" and config.num_processes == int(name[4])
    else:
        assert config.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU)
        assert config.mixed_precision == "bf16"


@pytest.mark.parametrize("name", ["cpu_2proc.yaml", "tp.yaml", "fsdp2_tp.yaml"])
def test_the_cpu_cores_warning_gives_advice_the_config_can_take(name, monkeypatch):
    """More processes than cores: a config whose parallelism_config fixes the count (tp 2 x dp_shard 2 = 4) was told
    to pass `--num_processes 2`, which it refuses; it is told what it needs instead. Others get the count to pass."""
    from accelerate.commands.config.config_args import load_config_from_file

    from common.features import cpu_threads

    config = load_config_from_file(os.path.join(ROOT, "accelerate_configs", name))
    monkeypatch.setattr(cpu_threads.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cpu_threads.torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0})  # one core
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(config.num_processes))
    monkeypatch.setenv("LOCAL_RANK", "0")
    for key, size in (config.parallelism_config or {}).items():  # as `accelerate launch` hands them over
        monkeypatch.setenv(key.upper(), str(size))
    with pytest.warns(UserWarning) as warned:
        cpu_threads.use_all_cores()
    message = str(warned[0].message)
    if config.parallelism_config:
        assert "--num_processes" not in message and f"needs {config.num_processes};" in message, message
        assert ("dp_shard 2 x tp 2" if name == "fsdp2_tp.yaml" else "(tp 2)") in message, message
    else:
        assert "pass --num_processes 1 (or fewer)" in message, message


def test_slurm_script_is_valid_bash():
    subprocess.run(["bash", "-n", os.path.join(ROOT, "accelerate_configs", "slurm_multi_node.sbatch")], check=True)


# ---- a DeepSpeed JSON against the script's flags --------------------------------------------------------------------

def flags(**overrides) -> argparse.Namespace:
    values = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=1.0,
                  mixed_precision=None, learning_rate=5e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                  adam_epsilon=1e-8, optim="adamw_torch")
    return argparse.Namespace(**{**values, **overrides})


def launched_with(monkeypatch, tmp_path, ds_config: dict, world_size: int = 1) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    return str(path)


@pytest.mark.parametrize("path", DS_CONFIGS, ids=os.path.basename)
def test_shipped_json_agrees_with_any_flags(path, monkeypatch, tmp_path):
    from common.features.deepspeed_check import check_deepspeed_config

    launched_with(monkeypatch, tmp_path, load_json(path), world_size=8)
    check_deepspeed_config(flags(per_device_train_batch_size=7, gradient_accumulation_steps=3, max_grad_norm=0.3,
                                 mixed_precision="bf16", learning_rate=1e-2, weight_decay=0.0))


@pytest.mark.parametrize("change, flag_overrides, expected", [
    ({"train_micro_batch_size_per_gpu": 4}, {}, "train_micro_batch_size_per_gpu=4 but --per_device_train_batch_size"),
    ({"gradient_accumulation_steps": 1}, {}, "gradient_accumulation_steps=1 but --gradient_accumulation_steps gives 2"),
    ({"train_batch_size": 16}, {}, "train_batch_size=16 but --per_device_train_batch_size x "
                                   "--gradient_accumulation_steps x 2 processes gives 8"),
    ({"gradient_clipping": 1.0}, {"max_grad_norm": 0.5}, "gradient_clipping=1.0 but --max_grad_norm gives 0.5"),
    ({"bf16": {"enabled": True}}, {"mixed_precision": "no"}, "bf16.enabled=true but mixed precision no"),
    ({"fp16": {"enabled": False}}, {"mixed_precision": "fp16"}, "fp16.enabled=false but mixed precision fp16"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.999]}}}, {}, "optimizer.params.betas=[0.9, 0.999]"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, {}, "optimizer.params.lr=0.001 but --learning_rate"),
])
def test_contradicting_json_fails_in_one_line(change, flag_overrides, expected, monkeypatch, tmp_path, capsys):
    from common.features.deepspeed_check import check_deepspeed_config

    path = launched_with(monkeypatch, tmp_path, {**load_json(DS_CONFIGS[0]), **change}, world_size=2)
    with pytest.raises(SystemExit) as exit_info:
        check_deepspeed_config(flags(**flag_overrides))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: DeepSpeed config {path} contradicts")
    assert expected in err and '"auto"' in err


def test_auto_gradient_clipping_takes_the_flag(monkeypatch, tmp_path):
    """accelerate alone would fill an "auto" gradient_clipping with 1.0 whatever --max_grad_norm says."""
    from accelerate.utils import DeepSpeedPlugin

    from common.features.deepspeed_check import check_deepspeed_config

    path = launched_with(monkeypatch, tmp_path, load_json(os.path.join(ROOT, "ds_configs", "zero2.json")))
    monkeypatch.delenv("ACCELERATE_GRADIENT_CLIPPING", raising=False)  # restored after the test
    check_deepspeed_config(flags(max_grad_norm=0.0))
    assert DeepSpeedPlugin(hf_ds_config=path).deepspeed_config["gradient_clipping"] == 0.0


def test_json_optimizer_with_adafactor_fails(monkeypatch, tmp_path, capsys):
    from common.features.deepspeed_check import check_deepspeed_config

    launched_with(monkeypatch, tmp_path, load_json(os.path.join(ROOT, "ds_configs", "zero2_offload.json")))
    with pytest.warns(UserWarning, match="DeepSpeed's CPU Adam"):
        check_deepspeed_config(flags(optim="adamw_8bit"))  # documented: offload replaces it, said so at start
    with pytest.raises(SystemExit):
        check_deepspeed_config(flags(optim="adafactor"))
    assert "defines its own optimizer" in capsys.readouterr().err


def test_no_deepspeed_no_check(tmp_path):
    from common.features.deepspeed_check import check_deepspeed_config

    check_deepspeed_config(flags(per_device_train_batch_size=123))  # no launcher variables: nothing to compare


# ---- memory estimator -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def estimator():
    from tools import estimate_memory

    return estimate_memory


def by_config(options) -> dict:
    return {o.config + (" " + o.flags if o.flags else ""): o for o in options}


@pytest.mark.parametrize("num_gpus", [1, 2, 8, 64])
def test_zero_partitioning_follows_the_paper(estimator, num_gpus):
    psi = 7_000_000_000
    shape = estimator.ModelShape(params=psi, largest_unit=0)
    o = by_config(estimator.options(shape, num_gpus, min(num_gpus, 8)))
    assert o["deepspeed_zero3.yaml"].states == pytest.approx(16 * psi / num_gpus)  # Ψ·(2+2+12)/N
    assert o["deepspeed_zero2.yaml"].states == pytest.approx(2 * psi + 14 * psi / num_gpus)
    assert o["deepspeed_zero1.yaml"].states == pytest.approx(4 * psi + 12 * psi / num_gpus)
    assert o["fsdp2.yaml"].states == pytest.approx(o["deepspeed_zero3.yaml"].states)
    ddp = next(v for k, v in o.items() if k in ("single_gpu.yaml", "multi_gpu.yaml", "multi_node.yaml"))
    assert ddp.states >= 16 * psi  # nothing partitioned
    # each stage partitions more; with one GPU the stages only differ by their bf16 vs fp32 copies
    order = [ddp, o["deepspeed_zero1.yaml"], o["deepspeed_zero2.yaml"], o["deepspeed_zero3.yaml"]]
    assert all(a.states >= b.states for a, b in zip(order, order[1:]))
    if num_gpus > 1:
        assert all(a.states > b.states for a, b in zip(order, order[1:]))
    # 8-bit AdamW: 6 bytes less per parameter for DDP (m and v in 1 byte), 4 for ZeRO's partitioned states
    eight_bit = next(v for k, v in o.items() if k.endswith("adamw_8bit") and "zero" not in k)
    assert ddp.states - eight_bit.states == pytest.approx(6 * psi)
    assert o["deepspeed_zero2.yaml"].states - o["deepspeed_zero2.yaml --optim adamw_8bit"].states == \
        pytest.approx(6 * psi / num_gpus)


@pytest.mark.parametrize("num_gpus", [1, 4])
def test_offload_moves_bytes_to_the_host(estimator, num_gpus):
    psi = 3_000_000_000
    o = by_config(estimator.options(estimator.ModelShape(params=psi, largest_unit=10_000_000), num_gpus, num_gpus))
    z2, z2_off = o["deepspeed_zero2.yaml"], o["deepspeed_zero2_offload.yaml"]
    z3, z3_off = o["deepspeed_zero3.yaml"], o["deepspeed_zero3_offload.yaml"]
    assert z2_off.states < z2.states and z3_off.states < z3.states
    # host peak: the larger of building the fp32 models (4 bytes/param per process) and the offloaded states
    assert z2_off.host >= max(z2.host, 16 * psi) and z3_off.host > z3.host
    if num_gpus == 1:
        assert z2_off.host > z2.host
    assert z3_off.states == 4 * 10_000_000          # only the layer being computed stays on the GPU
    assert z3_off.host == pytest.approx(18 * psi)   # one node: fp32 master, m, v, grads + bf16 weights
    # more nodes share the host side
    two_nodes = by_config(estimator.options(estimator.ModelShape(params=psi, largest_unit=0), 16, 8))
    assert two_nodes["deepspeed_zero3_offload.yaml"].host == pytest.approx(18 * psi / 2)


def test_activations(estimator):
    shape = estimator.ModelShape(params=10**9, largest_unit=0, layers=24, hidden=2048, heads=16, vocab=32000)
    s, b, h, L, a, V = 2048, 4, 2048, 24, 16, 32000
    plain = estimator.activation_bytes(shape, s, b, checkpointing=False, sdpa=False)
    assert plain == pytest.approx(L * s * b * h * (34 + 5 * a * s / h) + s * b * V * 12)
    sdpa = estimator.activation_bytes(shape, s, b, checkpointing=False, sdpa=True)
    assert sdpa == pytest.approx(L * s * b * h * 34 + s * b * V * 12)
    ckpt = estimator.activation_bytes(shape, s, b, checkpointing=True, sdpa=True)
    assert ckpt < sdpa < plain
    assert estimator.activation_bytes(shape, s, 2 * b, True) == pytest.approx(2 * ckpt)  # linear in the batch


def test_preset_shape_counts_the_real_model(estimator):
    """The meta-device count equals the parameters a built model has."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from common.inputs.modeling import LLAMA_PRESETS

    args = estimator.parse_args(["--model_preset", "tiny", "--vocab_size", "512"])
    shape = estimator.model_shape(args)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_PRESETS["tiny"], vocab_size=512),
                                             dtype=torch.float32)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.layers == 4 and shape.hidden == 128 and shape.vocab == 512
    assert shape.largest_unit == max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)


def test_cli_prints_a_markdown_table_and_a_pick(estimator):
    proc = subprocess.run([sys.executable, ESTIMATE_MEMORY, "--params", "70e9",
                           "--num_gpus", "16", "--gpu_memory_gb", "80"], capture_output=True, text=True, check=True)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 10  # header + one per option (tp.yaml only within one node: 16 GPUs are two)
    verdicts = {row.split(" | ")[0][2:]: row.rstrip(" |").rsplit("| ", 1)[1] for row in rows[1:]}
    assert verdicts["multi_node.yaml"] == "no" and verdicts["deepspeed_zero3.yaml"] == "yes"  # 1120 GB vs 70 GB
    assert "Fastest that fits: `accelerate launch --config_file accelerate_configs/fsdp2.yaml" in proc.stdout
    # more GPU memory never makes an option stop fitting
    small = estimator.report(estimator.parse_args(["--params", "7e9", "--gpu_memory_gb", "24"]))
    large = estimator.report(estimator.parse_args(["--params", "7e9", "--gpu_memory_gb", "80"]))
    fits = [[row.endswith("| yes |") for row in text.splitlines() if row.startswith("| ")] for text in (small, large)]
    assert all(b or not a for a, b in zip(*fits)) and sum(fits[1]) > sum(fits[0])


def test_cli_bad_input_is_one_line():
    proc = subprocess.run([sys.executable, ESTIMATE_MEMORY, "--num_gpus", "2"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr == "error: give --params, --model_preset or --config_name\n"


@pytest.mark.parametrize("flag", ["--params", "--gpu_memory_gb", "--host_memory_gb"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_memory_size_that_is_not_a_number_is_one_line(estimator, capsys, flag, value):
    """argparse's float() takes nan and inf: --params nan was a traceback, --gpu_memory_gb nan a table where nothing
    fits; both are one line now, before any estimate."""
    argv = ["--model_preset", "tiny"] if flag != "--params" else []
    with pytest.raises(SystemExit) as stopped:
        estimator.parse_args(argv + [f"{flag}={value}"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"error: {flag} must be a finite number (got {float(value)})\n"


def test_chunked_cross_entropy_counts_one_chunk_of_the_logits(estimator):
    """1B preset, 8 x 2,048 tokens, vocabulary 128,256: the full logits (12 bytes per token per vocabulary entry at
    the loss's backward) are 25 GB; one chunk of 1,024 tokens 0.5 GB of fp32 logits and an fp32 copy of the head's
    weight and three buffers of its size (F.linear_cross_entropy's), or 1.6 GB as checkpointed chunks (an older
    torch); the rest of the activations is the same."""
    from common.features import chunked_loss

    args = estimator.parse_args(["--model_preset", "1b", "--vocab_size", "128256", "--micro_batch_size", "8"])
    shape = estimator.model_shape(args)
    full, chunk = (estimator.logits_bytes(shape, 2048, 8, chunked) for chunked in (False, True))
    assert full == 2048 * 8 * 128256 * 12
    on_cpu = estimator.logits_bytes(shape, 2048, 8, True, device="cpu")
    if chunked_loss.OPTIONS is None:
        assert chunk == on_cpu == 1024 * 128256 * 12
    else:  # a chunk's fp32 logits; on CUDA the trained head's bf16 gradient of its cast weight, on a CPU four fp32 copies
        assert (chunk, on_cpu) == (1024 * 128256 * 4 + 2 * 128256 * 2048, 1024 * 128256 * 4 + 16 * 128256 * 2048)
    plain, chunked = (estimator.activation_bytes(shape, 2048, 8, False, chunked=c) for c in (False, True))
    assert plain - chunked == pytest.approx(full - chunk)
    report = estimator.report(estimator.parse_args(["--model_preset", "1b", "--vocab_size", "128256",
                                                    "--micro_batch_size", "8", "--chunked_cross_entropy"]))
    logits, buffers = 1024 * 128256 * 4, chunk - 1024 * 128256 * 4
    said = (f"{full / 1e9:.2f} GB in full; with --chunked_cross_entropy {logits / 1e9:.3f} GB for one chunk of 1,024 "
            f"tokens, plus {buffers / 1e9:.2f} GB of buffers of the trained head's weight; the table counts one chunk")
    assert said in report
