"""Tensor parallelism (accelerate_configs/tp.yaml) and 2-D FSDP2 x TP (fsdp2_tp.yaml) train as one process does, on CPU
processes over gloo (common/features/tensor_parallel.py: torch's DTensor API, the model's own base_model_tp_plan).

In fp32, with accumulation 2 and gradient clipping (max_grad_norm 1: the norms here are 2-4, so every step clips):
- TP = 2 on 2 processes (both read the same 8 sequences per step) reproduces 1 process x 4 x 2 accumulation steps,
  for pretraining and for SFT (padded batches of very uneven lengths): losses and gradient norms to LOSS_RTOL and
  GRAD_NORM_RTOL (test_distributed.py's and test_fsdp.py's tolerances), exported weights to TP_WEIGHT_RTOL, the final
  eval loss to EVAL_RTOL and eval tokens exactly (each example once, a ragged last batch cut right); the run's
  first lines and all_results.json give the mesh and the parameter elements one process holds (about half);
- FSDP2 (2) x TP (2) on 4 processes (2 sequences x 2 data-parallel groups x 2 accumulation steps) does too;
- a TP run SIGKILLed after its step-2 checkpoint, started again with `--resume_from_checkpoint auto`, ends with the
  uninterrupted run's weights (exactly) and metric rows;
- the export of a sharded model loads with `from_pretrained` on one process and gives the sharded model's logits;
- what it cannot serve stops with one line before the model is built.
A token count that counts the tp processes as data-parallel replicas, a loss scale that does, or data dealt out by
global rank each give other losses from step 1 on.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from conftest import ROOT, launcher, read_metrics, run_script
from forked_runs import start_launched
from test_distributed import LOSS_RTOL, init_model, train_args  # noqa: F401 (init_model: fixture)
from test_finetune_causal_lm import sft  # noqa: F401 (fixture)
from test_fsdp import GRAD_NORM_RTOL, compare_runs, cpu_1proc_launcher, exported_weights, finetune_args

# Clipped, and small: 80 documents (~125 blocks, a dozen steps per epoch), no sample; 7 evaluation blocks in batches
# of 2, which FSDP2 x TP's 2 data-parallel groups leave a remainder of (7 = 4 + 3: the last batch cut after 3 rows).
# AdamW's epsilon 1e-6, not the default 1e-8: an element whose gradient is below epsilon takes a step that fp32
# summation noise (~1e-10 absolute: TP reduces in other orders) moves by percents. At the default the runs below end
# 2.3e-5 (TP 2) and 2.8e-5 (FSDP2 x TP) from one process, all of it in such elements; at 1e-6, 7.6e-7 and 7.7e-7.
# A fault in the sharded maths (a reduction missed, a token counted twice, decay left out: 7e-3) moves far more.
CLIPPED = ("--max_grad_norm", "1.0", "--sample_max_new_tokens", "0", "--max_train_samples", "80",
           "--max_eval_samples", "7", "--per_device_eval_batch_size", "2", "--adam_epsilon", "1e-6")
TP_WEIGHT_RTOL = 1e-5  # per tensor, |a - b| / |b| (Frobenius), as WEIGHT_RTOL; 7.7e-7 measured


EVAL_RTOL = 1e-7  # what the trained weights' difference leaves (3.6e-8 measured): the evaluation adds nothing


def tp_launcher(config: str, num_processes: int) -> list[str]:
    return [*launcher(config, num_processes), "--mixed_precision", "no"]


def pretrain(corpus, init_model, out, per_device: int, config: str | None = None, processes: int = 1, *extra: str):
    args = [*train_args(corpus, init_model, out, per_device, *extra), *CLIPPED]
    return run_script("pretrain_llama.py", *args,
                      launcher=tp_launcher(config, processes) if config else cpu_1proc_launcher())


@pytest.fixture(scope="module")
def runs(corpus, init_model, tmp_path_factory):
    """1 process x 4 x 2 and TP = 2 (the same 8 sequences per step on both), checkpoints at steps 2 and 4."""
    d = tmp_path_factory.mktemp("tp")
    pretrain(corpus, init_model, d / "one", 4)
    pretrain(corpus, init_model, d / "tp2", 4, "tp.yaml", 2, "--checkpointing_steps", "2")
    return d


def results(out) -> dict:
    with open(os.path.join(out, "all_results.json")) as f:
        return json.load(f)


def same_evaluation(run, reference) -> str:
    """The final eval figures of a TP run are one process's: each example counted once, the last batch cut right."""
    got, want = results(run), results(reference)
    difference = abs(got["eval_loss"] - want["eval_loss"]) / want["eval_loss"]  # perplexity: its exp
    assert got["eval_tokens"] == want["eval_tokens"] and difference <= EVAL_RTOL, (got, want)
    return f"eval loss rel diff {difference:.1e}, eval tokens {got['eval_tokens']}"


def test_tp2_matches_one_process_and_says_how_it_is_sharded(runs):
    report = compare_runs(runs / "tp2", runs / "one", (1, 2, 3, 4), LOSS_RTOL, GRAD_NORM_RTOL, TP_WEIGHT_RTOL)
    print(f"tp 2 vs 1 process: {report}, {same_evaluation(runs / 'tp2', runs / 'one')}")
    tp, one = results(runs / "tp2"), results(runs / "one")
    assert tp["mesh"] == {"tp": 2} and tp["num_parameters"] == one["num_parameters"]
    assert 0.45 < tp["parameters_per_process"] / tp["num_parameters"] < 0.55  # norms and rotary stay whole: ~half
    checkpoint = runs / "tp2" / "checkpoints" / "step_2"
    assert sorted(p.name for p in (checkpoint / "pytorch_model_fsdp_0").glob("*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]  # each process wrote its own shards (DCP)


def test_sigkill_and_auto_resume_end_like_the_uninterrupted_run(runs, corpus, init_model):
    """Both processes SIGKILLed once step 3's row is written after the step-2 checkpoint; the same command with
    `--resume_from_checkpoint auto` finishes the run."""
    out = runs / "killed"
    args = [*train_args(corpus, init_model, out, 4, "--checkpointing_steps", "2", "--resume_from_checkpoint", "auto"),
            *CLIPPED]
    cmd = [*tp_launcher("tp.yaml", 2), os.path.join(ROOT, "scripts", "pretrain_llama.py"), *args]
    processes = start_launched(cmd, ROOT, str(runs / "killed.log"))  # forked as launch_forked does, not waited for
    deadline = time.monotonic() + 300
    while not any(r.get("step") == 3 for r in rows(out)):
        assert all(p.poll() is None for p in processes) and time.monotonic() < deadline, \
            (runs / "killed.log").read_text()[-3000:]
        time.sleep(0.01)
    for process in processes:
        os.kill(process.pid, signal.SIGKILL)
    assert all(process.wait() == -signal.SIGKILL for process in processes)
    assert not (out / "checkpoints" / "step_4").exists()
    run_script("pretrain_llama.py", *args, launcher=tp_launcher("tp.yaml", 2))
    assert [strip(r) for r in rows(out)] == [strip(r) for r in rows(runs / "tp2")]
    weights, uninterrupted = exported_weights(out), exported_weights(runs / "tp2")
    assert all(torch.equal(weights[k], uninterrupted[k]) for k in uninterrupted)


def test_a_tp_checkpoint_resumes_without_tp_and_an_unsharded_engine_is_one_line(runs, corpus, init_model):
    """DCP reshards: the TP = 2 step-2 checkpoint resumed by FSDP2 on 2 processes (tp_size 1, 2 x 2 x 2 sequences)
    continues the run; plain one-process training cannot load sharded states and says so in one line."""
    from conftest import copy_checkpoints

    out, plain = runs / "resumed_fsdp2", runs / "resumed_plain"
    for folder in (out, plain):
        copy_checkpoints(runs / "tp2", folder, 2)
    pretrain(corpus, init_model, out, 2, "fsdp2.yaml", 2, "--resume_from_checkpoint", "auto")
    print(f"tp 2 checkpoint resumed by fsdp2 on 2 processes: "
          f"{compare_runs(out, runs / 'tp2', (3, 4), LOSS_RTOL, GRAD_NORM_RTOL, TP_WEIGHT_RTOL)}")
    args = [*train_args(corpus, init_model, plain, 8, "--resume_from_checkpoint", "auto"), *CLIPPED]
    proc = run_script("pretrain_llama.py", *args, launcher=cpu_1proc_launcher(), check=False, launcher_output=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert "holds sharded (FSDP2 or tensor-parallel) torch.distributed.checkpoint states" in errors[0]


def rows(out) -> list[dict]:
    try:
        return read_metrics(str(out))
    except (OSError, json.JSONDecodeError):  # not there yet, or a row being written
        return []


def strip(row: dict) -> dict:
    """A metrics row without what depends on the machine's speed and memory."""
    return {k: v for k, v in row.items() if k not in ("time", "tokens_per_second", "peak_memory_bytes")}


def test_sft_tp2_matches_one_process_on_padded_batches(sft, tmp_path):  # noqa: F811 (sft is a fixture)
    one, tp = tmp_path / "one", tmp_path / "tp2"
    run_script("finetune_causal_lm.py", *finetune_args(sft, one, 4), "--max_grad_norm", "1.0", "--adam_epsilon",
               "1e-6", launcher=cpu_1proc_launcher())
    run_script("finetune_causal_lm.py", *finetune_args(sft, tp, 4), "--max_grad_norm", "1.0", "--adam_epsilon",
               "1e-6", launcher=tp_launcher("tp.yaml", 2))
    print(f"sft tp 2 vs 1 process: {compare_runs(tp, one, (1, 2, 3, 4), LOSS_RTOL, GRAD_NORM_RTOL, TP_WEIGHT_RTOL)}, "
          f"{same_evaluation(tp, one)}")
    assert results(tp)["mesh"] == {"tp": 2} and results(tp)["padding_fraction"] > 0.3


def test_fsdp2_x_tp_on_four_processes_matches_one(runs, corpus, init_model):
    out = runs / "fsdp2_tp"
    pretrain(corpus, init_model, out, 2, "fsdp2_tp.yaml", 4)
    print(f"fsdp2 2 x tp 2 vs 1 process: "
          f"{compare_runs(out, runs / 'one', (1, 2, 3, 4), LOSS_RTOL, GRAD_NORM_RTOL, TP_WEIGHT_RTOL)}, "
          f"{same_evaluation(out, runs / 'one')}")
    assert results(out)["mesh"] == {"dp_shard": 2, "tp": 2}
    assert 0.2 < results(out)["parameters_per_process"] / results(out)["num_parameters"] < 0.3


def test_the_export_loads_on_one_process_with_the_sharded_models_logits(init_model, tmp_path):
    """tests/tp_export_probe.py: trained 2 steps under TP = 2 (a vocabulary of 361: the embedding and LM head split
    unevenly), exported; the main process alone loads the export and compares the logits with the sharded model's."""
    proc = run_script(os.path.join(ROOT, "tests", "tp_export_probe.py"), ROOT, init_model, str(tmp_path / "out"),
                      launcher=tp_launcher("tp.yaml", 2))
    probe = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("PROBE "))[6:])
    print(f"export of a tp 2 model on one process: {probe}")
    assert probe["lm_head"] == "DTensor" and probe["vocab_size"] % 2 == 1
    assert probe["relative_difference"] <= 1e-5


def refusal(monkeypatch, capsys, config, world: int = 2, tp: int = 2, dp_shard: int = 1, **flags) -> str:
    """The one line `check_tensor_parallel` stops with (exit status 2), under a launcher's environment."""
    import argparse

    from common.features.tensor_parallel import check_tensor_parallel

    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", str(tp))
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", str(dp_shard))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit) as stop:
        check_tensor_parallel(argparse.Namespace(**flags), config)
    assert stop.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1
    return lines[0]


def test_what_tensor_parallelism_cannot_serve_is_one_line(monkeypatch, capsys):
    from transformers import LlamaConfig, MixtralConfig

    from common.inputs.modeling import LLAMA_PRESETS, MOE_PRESETS

    tiny = LlamaConfig(**LLAMA_PRESETS["tiny"])  # 4 heads, 4 key/value heads, MLP width 512
    assert "does not divide the model's num_attention_heads (4)" in refusal(monkeypatch, capsys, tiny, 3, 3)
    assert "num_key_value_heads (2)" in refusal(monkeypatch, capsys, LlamaConfig(**{**LLAMA_PRESETS["tiny"],
                                                                                 "num_key_value_heads": 2}), 4, 4)
    assert "intermediate_size (513)" in refusal(monkeypatch, capsys, LlamaConfig(**{**LLAMA_PRESETS["tiny"],
                                                                                 "intermediate_size": 513}))
    assert "do not multiply to the 3 processes" in refusal(monkeypatch, capsys, tiny, world=3)
    assert "do not multiply to the 8 processes" in refusal(monkeypatch, capsys, tiny, world=8, dp_shard=2)
    moe = MixtralConfig(**MOE_PRESETS["moe-tiny"])
    assert "uses moe_tp_experts, packed_colwise" in refusal(monkeypatch, capsys, moe)
    assert "QLoRA (--load_in_4bit) is not supported" in refusal(monkeypatch, capsys, tiny, use_peft=True,
                                                                 load_in_4bit=True)
    assert "LoRA (--use_peft) is not supported" in refusal(monkeypatch, capsys, tiny, use_peft=True)
    assert "--torch_compile is not supported" in refusal(monkeypatch, capsys, tiny, torch_compile=True)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert "with DeepSpeed is not supported" in refusal(monkeypatch, capsys, tiny)
    from common.features.tensor_parallel import refuse_tensor_parallel

    with pytest.raises(SystemExit):
        refuse_tensor_parallel("finetune_dpo.py")
    assert "wired into scripts/pretrain_llama.py and scripts/finetune_causal_lm.py only, not finetune_dpo.py" in \
        capsys.readouterr().err


def test_the_upstream_lines_that_force_the_torch_path_still_hold():
    """docs/scaling.md: accelerate's FSDP2 x TP `prepare` imports a class transformers no longer has, and accelerate
    counts no CPU run as multi-device (so it refuses a ParallelismConfig there). When either changes, try accelerate's
    own path again and drop what common/features/tensor_parallel.py does in its place."""
    import inspect

    from accelerate import Accelerator

    assert "from transformers.integrations.tensor_parallel import ReplicateParallel" in \
        inspect.getsource(Accelerator._prepare_tp)
    with pytest.raises(ImportError):
        from transformers.integrations.tensor_parallel import ReplicateParallel  # noqa: F401
    assert "MULTI_CPU" not in inspect.getsource(Accelerator.multi_device.fget)


def test_torch_still_prints_the_two_warnings_tensor_parallel_runs_silence():
    """Under tp.yaml / fsdp2_tp.yaml every process printed FSDP2's view-tensor warning and DTensor's two-collectives
    warning (common/features/tensor_parallel.py says why neither applies). They are silenced, and nothing else:
    once torch stops printing them this fails, and `quiet_tensor_parallel_warnings` can go."""
    import inspect
    import logging
    import re
    import warnings

    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    from torch.distributed.tensor import _redistribute

    from common.features.tensor_parallel import (REDISTRIBUTE_LOGGER, REDISTRIBUTE_WARNING, VIEW_WARNING,
                                                 quiet_tensor_parallel_warnings)

    printed = ("FSDP2-wrapped module (FSDPLlamaForCausalLM) returned a view tensor. An in-place op on this view (e.g., "
               "`x += y`) will silently drop the pre-backward hook")
    assert "returned a view tensor" in inspect.getsource(FSDPState._register_pre_backward_hook)
    assert re.match(VIEW_WARNING, printed)
    assert f'"{REDISTRIBUTE_WARNING}%s to %s, %d sequential' in inspect.getsource(_redistribute)
    assert _redistribute.logger.name == REDISTRIBUTE_LOGGER
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_tensor_parallel_warnings()
        warnings.warn(printed, UserWarning)
        warnings.warn("FSDP2 something else", UserWarning)
    assert [str(w.message) for w in caught] == ["FSDP2 something else"]
    logger = logging.getLogger(REDISTRIBUTE_LOGGER)
    record = lambda msg: logging.LogRecord(REDISTRIBUTE_LOGGER, logging.WARNING, "", 0, msg, (), None)  # noqa: E731
    assert not logger.filter(record(REDISTRIBUTE_WARNING + "%s to %s, %d sequential %s operations"))
    assert logger.filter(record("another warning"))
