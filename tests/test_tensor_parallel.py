"""Tensor parallelism (accelerate_configs/tp.yaml) and 2-D FSDP2 x TP (fsdp2_tp.yaml) train as one process does, on CPU
processes over gloo (common/features/tensor_parallel.py: torch's DTensor API, the model's own base_model_tp_plan).

In fp32, with accumulation 2 and gradient clipping (max_grad_norm 1: the norms here are 2-4, so every step clips):
- TP = 2 on 2 processes (both read the same 8 sequences per step) reproduces 1 process x 4 x 2 accumulation steps,
  for pretraining and for SFT (padded batches of very uneven lengths): losses and gradient norms to LOSS_RTOL and
  GRAD_NORM_RTOL, exported weights to WEIGHT_RTOL (test_distributed.py's and test_fsdp.py's tolerances); the run's
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
import subprocess
import time

import pytest
import torch
from conftest import ROOT, launcher, read_metrics, run_script
from test_distributed import LOSS_RTOL, WEIGHT_RTOL, init_model, train_args  # noqa: F401 (init_model: fixture)
from test_finetune_causal_lm import sft  # noqa: F401 (fixture)
from test_fsdp import GRAD_NORM_RTOL, compare_runs, cpu_1proc_launcher, exported_weights, finetune_args

CLIPPED = ("--max_grad_norm", "1.0", "--sample_max_new_tokens", "0")


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


def test_tp2_matches_one_process_and_says_how_it_is_sharded(runs):
    print(f"tp 2 vs 1 process: {compare_runs(runs / 'tp2', runs / 'one', (1, 2, 3, 4), LOSS_RTOL, GRAD_NORM_RTOL, WEIGHT_RTOL)}")
    tp, one = results(runs / "tp2"), results(runs / "one")
    assert tp["mesh"] == {"tp": 2} and tp["num_parameters"] == one["num_parameters"]
    assert 0.45 < tp["parameters_per_process"] / tp["num_parameters"] < 0.55  # norms and rotary stay whole: ~half
    checkpoint = runs / "tp2" / "checkpoints" / "step_2"
    assert sorted(p.name for p in (checkpoint / "pytorch_model_fsdp_0").glob("*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]  # each process wrote its own shards (DCP)


def test_sigkill_and_auto_resume_end_like_the_uninterrupted_run(runs, corpus, init_model):
    """The real launcher's processes SIGKILLed (the launcher reaps them and stops) once step 3's row is written after
    the step-2 checkpoint; the same command with `--resume_from_checkpoint auto` finishes the run."""
    out = runs / "killed"
    args = [*train_args(corpus, init_model, out, 4, "--checkpointing_steps", "2", "--resume_from_checkpoint", "auto"),
            *CLIPPED]
    cmd = [*tp_launcher("tp.yaml", 2), os.path.join(ROOT, "scripts", "pretrain_llama.py"), *args]
    with open(runs / "killed.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while not any(r.get("step") == 3 for r in rows(out)):
        assert proc.poll() is None and time.monotonic() < deadline, (runs / "killed.log").read_text()[-3000:]
        time.sleep(0.01)
    for pid in children(proc.pid):
        os.kill(pid, signal.SIGKILL)
    assert proc.wait() != 0
    assert not (out / "checkpoints" / "step_4").exists()
    run_script("pretrain_llama.py", *args, launcher=tp_launcher("tp.yaml", 2))
    assert [strip(r) for r in rows(out)] == [strip(r) for r in rows(runs / "tp2")]
    weights, uninterrupted = exported_weights(out), exported_weights(runs / "tp2")
    assert all(torch.equal(weights[k], uninterrupted[k]) for k in uninterrupted)


def children(pid: int) -> list[int]:
    """The processes `pid` started (from /proc: their parent's pid is the 4th field of /proc/<pid>/stat)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # not a process, or gone
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


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
    run_script("finetune_causal_lm.py", *finetune_args(sft, one, 4), "--max_grad_norm", "1.0",
               launcher=cpu_1proc_launcher())
    run_script("finetune_causal_lm.py", *finetune_args(sft, tp, 4), "--max_grad_norm", "1.0",
               launcher=tp_launcher("tp.yaml", 2))
    print(f"sft tp 2 vs 1 process: {compare_runs(tp, one, (1, 2, 3, 4), LOSS_RTOL, GRAD_NORM_RTOL, WEIGHT_RTOL)}")
    assert results(tp)["mesh"] == {"tp": 2} and results(tp)["padding_fraction"] > 0.3


def test_fsdp2_x_tp_on_four_processes_matches_one(runs, corpus, init_model):
    out = runs / "fsdp2_tp"
    pretrain(corpus, init_model, out, 2, "fsdp2_tp.yaml", 4)
    print(f"fsdp2 2 x tp 2 vs 1 process: "
          f"{compare_runs(out, runs / 'one', (1, 2, 3, 4), LOSS_RTOL, GRAD_NORM_RTOL, WEIGHT_RTOL)}")
    assert results(out)["mesh"] == {"dp_shard": 2, "tp": 2}
    assert 0.2 < results(out)["parameters_per_process"] / results(out)["num_parameters"] < 0.3
