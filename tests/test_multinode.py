"""Two machines on one host: `accelerate launch --num_machines 2 --machine_rank 0|1 --main_process_ip 127.0.0.1`,
one CPU process each, the same command line on both but for the rank. This is how a multi-node job starts (one
launcher per node; `slurm_multi_node.sbatch` does it under Slurm, see tests/test_slurm.py), with the rendezvous, the
process group and the collectives going through TCP between the two launchers' processes.

Every run starts from the saved tiny model of tests/test_distributed.py and trains 4 optimizer steps on a global batch
of 8 sequences: 2 machines x 1 process x 2 sequences x 2 accumulation steps, against its one-process reference
(1 x 4 x 2), in fp32. Properties:
- DDP (the shipped multi_node.yaml, with `--mixed_precision no`), DeepSpeed ZeRO-3 and FSDP2 (their shipped files,
  with `--num_machines 2`): the losses, gradient norms and exported weights of the one-process run, to the tolerances
  of the 2-process tests (test_distributed.py, test_fsdp.py); the end of run (export, sample) completes on both.
- One machine's launcher killed (SIGKILL) mid-run: its trainer hears of it (PR_SET_PDEATHSIG) and both machines stop
  after the same optimizer step with one checkpoint at it; the other machine's launcher ends within --ddp_timeout,
  with a non-zero status and the one line naming the checkpoint; the same command on both machines with
  `--resume_from_checkpoint auto` then ends at the uninterrupted run (the same two DDP ranks, on one machine):
  every step once in metrics.jsonl, losses and exported weights within TOL.
- One machine frozen (SIGSTOP on its launcher and trainer: a hung node, or one cut off the network): the other
  machine's trainer fails in its pending collective after --ddp_timeout, not later, with torch's one line naming the
  timeout, and its launcher exits non-zero; the newest complete checkpoint is the last step both machines finished.

HSDP (replicate across machines x shard within) is not tested: accelerate 1.15 expresses it for FSDP2 only through
ParallelismConfig, which refuses CPU processes (DistributedType.MULTI_CPU) inside Accelerator() itself.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time

import pytest
from conftest import ACCELERATE, CONFIGS, SCRIPTS, launcher, read_metrics, run_script
from safetensors.torch import load_file
from test_distributed import (  # noqa: F401 (init_model and reference are fixtures)
    LOSS_RTOL,
    WEIGHT_RTOL,
    assert_default_end_of_run,
    assert_same_training,
    init_model,
    reference,
    train_args,
)
from test_fsdp import GRAD_NORM_RTOL, compare_runs
from test_preemption import (LANDS_WITHIN, TOL, alive, assert_same_checkpoint, command_lines_naming, kill_all,
                             landed_after, last_logged_step, trainer_pids)

# Config file and the launch flags that make it fp32 (the files for GPUs say bf16).
CONFIGS_UNDER_TEST = {"multi_node.yaml": ("--mixed_precision", "no"),
                      "deepspeed_zero3.yaml": (),
                      "fsdp2.yaml": ("--mixed_precision", "no")}
# --ddp_timeout of the lost-machine runs: a frozen machine's partner waits that long (kept short); a killed launcher's
# partner must end well within it (generous: a busy 2-core machine took up to 17 s to finish the step and the save).
DDP_TIMEOUT, KILLED_DDP_TIMEOUT = 10, 120
# The lost-machine runs: 8 steps (room for a busy machine between the step seen and the one the loss lands in), the
# loss dealt once both machines have finished step STOP_AT.
LOST_MAX_STEPS, STOP_AT = 8, 2


def free_port() -> int:
    """A port nothing listens on now: the rendezvous port both machines are given (port 0 works for one machine
    only, where the launcher picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TwoMachines:
    """The two launchers of one run, each `accelerate launch ... --machine_rank R` in its own session, output in
    `<out>-<attempt>-machine<R>.log`."""

    def __init__(self, config: str, args: list[str], out, launch_flags=()):
        port = free_port()
        self.out = str(out)
        attempt = 1
        while os.path.exists(f"{out}-{attempt}-machine0.log"):
            attempt += 1
        self.logs = [f"{out}-{attempt}-machine{rank}.log" for rank in (0, 1)]
        self.launchers = []
        for rank, log in enumerate(self.logs):
            cmd = [ACCELERATE, "launch", "--config_file", os.path.join(CONFIGS, config), "--num_machines", "2",
                   "--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
                   "--main_process_port", str(port), *launch_flags, os.path.join(SCRIPTS, "pretrain_llama.py"),
                   *args]
            with open(log, "w") as f:
                self.launchers.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                                       start_new_session=True))

    def trainer(self, rank: int) -> int | None:
        """The training process that machine `rank`'s launcher (torchrun's agent, in-process) started: not one of
        the launcher's short-lived forks, which carry its command line until they exec."""
        pid = self.launchers[rank].pid
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                children = [int(child) for child in f.read().split()]
        except OSError:
            return None
        trainers = [child for child in children if child in trainer_pids(self.out)]
        return trainers[0] if trainers else None

    def wait(self, timeout: float = 600) -> list[int]:
        try:
            return [launcher.wait(timeout=timeout) for launcher in self.launchers]
        finally:
            self.kill()

    def kill(self) -> None:
        """Leave nothing running (after a failure; a no-op after a clean end)."""
        pids = {p.pid for p in self.launchers if p.poll() is None}
        pids |= set(processes_writing_to(self.out))
        kill_all(pids)
        for launcher in self.launchers:
            launcher.wait()

    def output(self, rank: int) -> str:
        with open(self.logs[rank]) as f:
            return f.read()


def processes_writing_to(out: str) -> list[int]:
    """Every live process whose command line names `out` (launchers and trainers of a run)."""
    return [pid for pid in command_lines_naming(out) if alive(pid)]


def run_two_machines(config: str, args: list[str], out, launch_flags=()) -> TwoMachines:
    machines = TwoMachines(config, args, out, launch_flags)
    statuses = machines.wait()
    assert statuses == [0, 0], f"{statuses}\n{machines.output(0)[-4000:]}\n{machines.output(1)[-3000:]}"
    return machines


@pytest.fixture(scope="module")
def two_machine_runs(corpus, init_model, tmp_path_factory):
    """The uninterrupted two-machine run of each config, made when first asked for."""
    runs = {}

    def get(config: str):
        if config not in runs:
            out = tmp_path_factory.mktemp("two_machines") / config.removesuffix(".yaml")
            machines = run_two_machines(config, train_args(corpus, init_model, out, 2), out,
                                        CONFIGS_UNDER_TEST[config])
            runs[config] = out, machines.output(0)
        return runs[config]
    return get


@pytest.mark.parametrize("config", CONFIGS_UNDER_TEST)
def test_two_machines_match_one_process(config, two_machine_runs, reference):
    out, output = two_machine_runs(config)
    if config == "fsdp2.yaml":  # the grad norm of sharded gradients is summed in another order
        report = compare_runs(out, reference, (1, 2, 3, 4), LOSS_RTOL, GRAD_NORM_RTOL, WEIGHT_RTOL)
    else:
        report = assert_same_training(out, reference)
    proc = subprocess.CompletedProcess([], 0, stdout="", stderr=output)
    print(f"{config}, 2 machines x 1 process vs 1 process: {report}; "
          f"{assert_default_end_of_run(proc, out, reference)}")


# ---- a machine lost -------------------------------------------------------------------------------------------------

def until(condition, what: str, timeout: float = 300, machines: TwoMachines | None = None,
          every: float = 0.02) -> None:
    """Poll `condition` every `every` seconds (a step of the tiny runs takes ~0.15 s; a condition that starts a
    process, such as a Slurm query, is polled less often: the polls share the runs' core)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if machines is not None:
            assert all(p.poll() is None for p in machines.launchers), f"a launcher ended before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(every)


def proc_status(pid: int, field: str) -> str:
    with open(f"/proc/{pid}/status") as f:
        return re.search(rf"^{field}:\s*(\S+)", f.read(), re.M).group(1)


def signal_pending(pid: int, sig: signal.Signals) -> bool:
    """`sig` waits to be delivered to process `pid` (it is stopped)."""
    return bool(int(proc_status(pid, "ShdPnd"), 16) & (1 << (sig - 1)))


def pause(pids) -> None:
    """SIGSTOP each process and wait until it is stopped (the kernel stops it asynchronously)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    until(lambda: all(proc_status(pid, "State") == "T" for pid in pids), "stopped processes", 30)


def start_and_reach_stop_step(args, out) -> tuple[TwoMachines, list[int]]:
    machines = TwoMachines("multi_node.yaml", args, out, CONFIGS_UNDER_TEST["multi_node.yaml"])
    trainers = [None, None]

    def ready() -> bool:
        for rank in (0, 1):
            trainers[rank] = trainers[rank] or machines.trainer(rank)
        return None not in trainers and last_logged_step(out) >= STOP_AT
    until(ready, f"step {STOP_AT}", machines=machines)
    return machines, trainers


def newest_checkpoint(out) -> int:
    steps = [int(name.split("_")[1]) for name in os.listdir(os.path.join(out, "checkpoints"))
             if name.startswith("step_")]
    return max(steps)


def lost_machine_args(corpus, init_model, out, *extra: str, ddp_timeout: int = DDP_TIMEOUT) -> list[str]:
    return train_args(corpus, init_model, out, 2, "--max_steps", str(LOST_MAX_STEPS), "--ddp_timeout",
                      str(ddp_timeout), *extra)


@pytest.fixture(scope="module")
def uninterrupted(corpus, init_model, tmp_path_factory):
    """The lost-machine run without a loss, a checkpoint at every step: its two ranks on one machine (cpu_2proc.yaml,
    DDP over gloo as multi_node.yaml's), the same computation as on two (to 1e-6, like every comparison below) in a
    fifth of a two-machine launch's time; test_two_machines_match_one_process compares two machines with one."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    run_script("pretrain_llama.py", *lost_machine_args(corpus, init_model, out, "--checkpointing_steps", "1",
                                                       "--save_total_limit", str(LOST_MAX_STEPS)),
               launcher=launcher("cpu_2proc.yaml"))
    return out


def test_launcher_killed_both_stop_at_one_checkpoint_and_resume_exactly(corpus, init_model, uninterrupted, tmp_path):
    """Machine 1's launcher is SIGKILLed while its trainer is paused (so the step the kill lands in is known: the
    trainer hears of it, by PR_SET_PDEATHSIG, before it can finish another step)."""
    out = tmp_path / "run"
    args = lost_machine_args(corpus, init_model, out, ddp_timeout=KILLED_DDP_TIMEOUT)
    machines, trainers = start_and_reach_stop_step(args, out)
    try:
        pause([trainers[1]])
        logged = last_logged_step(out)
        os.kill(machines.launchers[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        until(lambda: signal_pending(trainers[1], signal.SIGTERM), "SIGTERM for the orphaned trainer", 30)
        os.kill(trainers[1], signal.SIGCONT)
        status = machines.launchers[0].wait(timeout=KILLED_DDP_TIMEOUT + 60)
        seconds = time.monotonic() - killed
        until(lambda: not processes_writing_to(str(out)), "the end of every process", 30)
        gone = time.monotonic() - killed
    finally:
        machines.kill()
    output = machines.output(0)
    assert status != 0 and seconds < KILLED_DDP_TIMEOUT, (status, seconds, output[-3000:])
    assert STOP_AT <= logged < LOST_MAX_STEPS - LANDS_WITHIN, f"both machines had logged step {logged} when killed"
    step = newest_checkpoint(out)
    assert os.listdir(out / "checkpoints") == [f"step_{step}"] and landed_after(step, logged), (logged, step)
    path = out / "checkpoints" / f"step_{step}"
    lines = [line for line in output.splitlines() if "Stopped on" in line]
    assert len(lines) == 1 and (f"Stopped on another process's signal after optimizer step {step}; checkpoint "
                                f"saved in {path}") in lines[0], output[-3000:]
    assert not (out / "model.safetensors").exists()
    report = assert_same_checkpoint(path, uninterrupted / "checkpoints" / f"step_{step}")

    run_two_machines("multi_node.yaml", [*args, "--resume_from_checkpoint", "auto"], out,
                     CONFIGS_UNDER_TEST["multi_node.yaml"])
    rows = [r["step"] for r in read_metrics(str(out)) if "loss" in r]
    assert rows == list(range(1, LOST_MAX_STEPS + 1)), rows  # each step once
    print(f"machine 1's launcher killed after step {logged}: machine 0's launcher ended after {seconds:.1f} s "
          f"(status {status}), every process gone after {gone:.1f} s; checkpoint at step {step}: {report}; resumed "
          f"on both machines: {assert_same_as_uninterrupted(out, uninterrupted)}")


def assert_same_as_uninterrupted(out, uninterrupted) -> str:
    run, ref = ({r["step"]: r["loss"] for r in read_metrics(str(d)) if "loss" in r} for d in (out, uninterrupted))
    assert sorted(run) == sorted(ref)
    loss_diff = max(abs(run[s] - ref[s]) for s in ref)
    w, w_ref = (load_file(os.path.join(d, "model.safetensors")) for d in (out, uninterrupted))
    weight_diff = max((w[k] - w_ref[k]).abs().max().item() for k in w_ref)
    assert loss_diff <= TOL and weight_diff <= TOL, (loss_diff, weight_diff)
    return f"max |loss difference| {loss_diff:.1e}, max |weight difference| {weight_diff:.1e}"


def test_frozen_machine_ends_the_other_after_ddp_timeout(corpus, init_model, uninterrupted, tmp_path):
    out = tmp_path / "run"
    args = lost_machine_args(corpus, init_model, out, "--checkpointing_steps", "1", "--save_total_limit", "2")
    machines, trainers = start_and_reach_stop_step(args, out)
    try:
        pause([machines.launchers[1].pid, trainers[1]])
        frozen, logged = time.monotonic(), last_logged_step(out)
        status = machines.launchers[0].wait(timeout=DDP_TIMEOUT + 120)
        seconds = time.monotonic() - frozen
    finally:
        machines.kill()
    output = machines.output(0)
    assert status != 0 and DDP_TIMEOUT - 1 <= seconds < DDP_TIMEOUT + 60, (status, seconds, output[-3000:])
    lines = [line for line in output.splitlines() if "Timed out waiting" in line]
    assert len(lines) == 1 and f"{DDP_TIMEOUT * 1000}ms" in lines[0], output[-4000:]
    step = newest_checkpoint(out)  # the save after the step logged last may be the one left unfinished
    assert step in (logged - 1, logged, logged + 1), (logged, step)
    report = assert_same_checkpoint(out / "checkpoints" / f"step_{step}",
                                    uninterrupted / "checkpoints" / f"step_{step}")
    print(f"machine 1 frozen after step {logged}: machine 0's launcher ended after {seconds:.1f} s (status "
          f"{status}, --ddp_timeout {DDP_TIMEOUT}): {lines[0].strip()[:160]}; newest checkpoint step {step}: {report}")
