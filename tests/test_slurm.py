"""accelerate_configs/slurm_multi_node.sbatch under a real Slurm: a cluster of two nodes on this machine, started by the
module's fixture (munge, slurmctld and two slurmd, Debian's Slurm 22.05), and the project's own sbatch file submitted
unchanged, with only command-line and environment overrides: 2 nodes x 1 CPU process
(`CONFIG=accelerate_configs/cpu_2proc.yaml GPUS_PER_NODE=1 sbatch --gpus-per-node=0 --cpus-per-task=1`).

Each job trains MAX_STEPS optimizer steps of test_preemption.py's run; the reference is its uninterrupted 2-process
run. Once both trainers have logged a given step they are paused (SIGSTOP), the job is stopped the way Slurm would,
and they go on once Slurm's SIGTERM waits for them: the step the stop lands in is then known (one or two after the
last one logged, test_preemption.py). Properties:
- time limit: the signal that `#SBATCH --signal=B:USR1@180` sends (here at once, `scancel --batch --signal=USR1`)
  makes every rank finish its step and publish one checkpoint at that step, equal to the uninterrupted run's; the
  job is requeued by Slurm and the requeued run resumes it;
- preemption, of that requeued run: a job of a higher-priority partition (PreemptMode=REQUEUE, Slurm's default
  signals: SIGTERM to the step, GraceTime) takes the nodes: the same, a second checkpoint and a second requeue; the
  run requeued again resumes the second checkpoint and ends at the uninterrupted run (exit 0, each step once in
  metrics.jsonl, losses and weights within TOL). One job for both stops: a job's start is ~20 s of one core here;
- `scancel` (no requeue): the job is cancelled and leaves one complete checkpoint at the step reached, equal to the
  uninterrupted run's (what the same submission again would resume, as in the case above).
After every job nothing of it runs any more.

The cluster: node names are loopback addresses (127.0.0.1, 127.0.0.2) so that the sbatch's rendezvous address (the
first node's name) resolves without /etc/hosts; each slurmd has its own port, the controller a free port, munge a
socket in the temporary folder, and a requeued job restarts after ~6 s (cred_expire=5, sched_interval=1) instead of
Slurm's ~2 min. The daemons are the fixture's children, stopped by PID at the end. Skips where Slurm is not installed
(`apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge`) or where not root.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import ROOT, read_metrics
from test_multinode import free_port, pause, processes_writing_to, proc_status, signal_pending, until
from test_preemption import (  # noqa: F401 (cache and uninterrupted are fixtures)
    LANDS_WITHIN,
    MAX_STEPS,
    STOP_AT,
    alive,
    assert_same_checkpoint,
    assert_same_run,
    cache,
    kill_all,
    landed_after,
    last_logged_step,
    pretrain_args,
    trainer_pids,
    uninterrupted,
)

COMMANDS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo", "squeue")
if not all(shutil.which(c) for c in COMMANDS) or os.geteuid() != 0:
    pytest.skip("needs root and Slurm: apt-get install -y --no-install-recommends slurmctld slurmd slurm-client "
                "munge", allow_module_level=True)
SBATCH = os.path.join(ROOT, "accelerate_configs", "slurm_multi_node.sbatch")
NODES = ("127.0.0.1", "127.0.0.2")
GRACE_TIME = 60  # the low partition's: a preempted job's time to save before Slurm's SIGTERM/SIGKILL sequence

SLURM_CONF = """\
ClusterName=tests
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={run}/munge.sock,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={run}/slurmctld.pid
SlurmdPidFile={run}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
SchedulerParameters=sched_interval=1,bf_interval=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName={node1} NodeHostname={hostname} NodeAddr=127.0.0.1 Port={node1_port} CPUs=1
NodeName={node2} NodeHostname={hostname} NodeAddr=127.0.0.1 Port={node2_port} CPUs=1
PartitionName=low Nodes={node1},{node2} Default=YES PriorityTier=1 GraceTime={grace} State=UP
PartitionName=high Nodes={node1},{node2} PriorityTier=10 PreemptMode=OFF State=UP
"""


class SlurmCluster:
    """munged, slurmctld and one slurmd per node, children of this process, state and logs under `root`."""

    def __init__(self, root):
        self.root = str(root)
        for folder in ("state", "log", *(f"spool-{node}" for node in NODES)):
            os.makedirs(os.path.join(self.root, folder))
        # Sockets and PID files: munged wants every folder on the way to its socket open to all (pytest's are not).
        self.run_dir = tempfile.mkdtemp(prefix="slurm-test-")
        os.chmod(self.run_dir, 0o755)
        self.conf = os.path.join(self.root, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write(SLURM_CONF.format(root=self.root, run=self.run_dir, ctld_port=free_port(), node1=NODES[0],
                                      node2=NODES[1], node1_port=free_port(), node2_port=free_port(),
                                      hostname=socket.gethostname(), grace=GRACE_TIME))
        self.env = {**os.environ, "SLURM_CONF": self.conf,
                    "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}  # `accelerate` in jobs
        self.daemons: list[subprocess.Popen] = []
        try:
            self.start_daemons()
        except BaseException:
            self.stop()
            raise

    def start_daemons(self) -> None:
        key, run = os.path.join(self.root, "munge.key"), self.run_dir
        subprocess.run(["mungekey", "-c", "-k", key], check=True, capture_output=True)
        self.start(["munged", "-F", f"--key-file={key}", f"--socket={run}/munge.sock",
                    f"--pid-file={run}/munged.pid", f"--seed-file={run}/munge.seed",
                    f"--log-file={self.root}/log/munged.log"], "munged")
        until(lambda: os.path.exists(f"{run}/munge.sock"), "munge socket", 30)
        self.start(["slurmctld", "-D", "-f", self.conf], "slurmctld")
        for node in NODES:
            self.start(["slurmd", "-D", "-f", self.conf, "-N", node], f"slurmd-{node}")
        until(lambda: self.idle_nodes() == 2, "two idle nodes", 60, every=0.2)

    def start(self, cmd: list[str], name: str) -> None:
        with open(os.path.join(self.root, "log", f"{name}.out"), "w") as out:
            self.daemons.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env))

    def run(self, *cmd: str, **kwargs) -> str:
        return subprocess.run(cmd, env={**self.env, **kwargs.pop("env", {})}, capture_output=True, text=True,
                              check=True, **kwargs).stdout

    def idle_nodes(self) -> int:
        try:
            return self.run("sinfo", "-h", "-N", "-p", "low", "-o", "%t").split().count("idle")
        except subprocess.CalledProcessError:  # the controller is not up yet
            return 0

    def job(self, job_id: str) -> dict[str, str]:
        """scontrol's fields of the job (JobState, Restarts, ExitCode, ...)."""
        return dict(re.findall(r"(\w+)=(\S*)", self.run("scontrol", "show", "job", "-o", job_id)))

    def stop(self) -> None:
        """Cancel what still runs, then stop each daemon by its PID (SIGTERM, then SIGKILL if it lingers)."""
        try:
            self.run("scancel", "--user", "root")
            until(lambda: not self.run("squeue", "-h").strip(), "no job", 120, every=0.2)
        except (subprocess.CalledProcessError, AssertionError):
            pass
        for daemon in reversed(self.daemons):
            daemon.terminate()
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()
    assert all(d.poll() is not None for d in cluster.daemons)


def submit(slurm: SlurmCluster, args: list[str], log, partition: str = "low") -> str:
    """The project's sbatch file, 2 nodes x 1 CPU process, from the repository root; returns the job id."""
    env = {"CONFIG": "accelerate_configs/cpu_2proc.yaml", "GPUS_PER_NODE": "1", "MAIN_PORT": str(free_port())}
    return slurm.run("sbatch", "--parsable", "--partition", partition, "--gpus-per-node=0", "--cpus-per-task=1",
                     f"--output={log}", SBATCH, *args, cwd=ROOT, env=env).strip()


def until_job(slurm: SlurmCluster, job_id: str, states: tuple[str, ...], timeout: float = 600) -> dict[str, str]:
    until(lambda: slurm.job(job_id)["JobState"] in states, f"job {job_id} in {states}", timeout, every=0.2)
    return slurm.job(job_id)


def stop_job(slurm: SlurmCluster, job_id: str, out, stop, past: int = STOP_AT) -> int:
    """Once both trainers have logged step `past`: pause them, call `stop()` (Slurm's signal for them follows), let
    them go on once it has reached them. Returns the last step logged before."""
    trainers: list[int] = []
    asked = [0.0]

    def ready() -> bool:
        trainers[:] = trainer_pids(out)
        if len(trainers) < 2:  # not (re)started yet: is the job still on? (each query is a process: 5 a second)
            if time.monotonic() - asked[0] > 0.2:
                assert slurm.job(job_id)["JobState"] in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED"), \
                    slurm.job(job_id)
                asked[0] = time.monotonic()
            return False
        return last_logged_step(out) >= past
    until(ready, f"two trainers past step {past}", 600)
    pause(trainers)
    logged = last_logged_step(out)
    stop()
    # SIGTERM pending, or already delivered with Slurm's own SIGCONT
    until(lambda: all(not alive(p) or signal_pending(p, signal.SIGTERM) or proc_status(p, "State") != "T"
                      for p in trainers), "Slurm's SIGTERM for the trainers", 120)
    for pid in trainers:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)
    assert past <= logged < MAX_STEPS - LANDS_WITHIN, f"the trainers had logged step {logged}"
    return logged


def stop_steps(output: str, logged: list[int]) -> list[int]:
    """The steps the job's stops landed in, one per stop: within LANDS_WITHIN of the step logged when it came."""
    lines = [line for line in output.splitlines() if "Stopped on SIGTERM after optimizer step" in line]
    assert len(lines) == len(logged), output[-4000:]
    steps = [int(re.search(r"after optimizer step (\d+);", line).group(1)) for line in lines]
    assert all(landed_after(step, seen) for step, seen in zip(steps, logged)), (logged, lines)
    return steps


def assert_stop_checkpoint(out, output: str, step: int, reference) -> str:
    """The stop at `step` published its checkpoint, the uninterrupted run's at that step."""
    path = os.path.join(out, "checkpoints", f"step_{step}")
    assert f"after optimizer step {step}; checkpoint saved in {path}" in output
    assert os.path.isfile(os.path.join(path, "checkpoint_complete.json"))
    return assert_same_checkpoint(path, os.path.join(reference, "checkpoints", f"step_{step}"))


def test_time_limit_then_preemption_checkpoint_requeue_and_the_job_finishes(slurm, corpus, cache, uninterrupted,
                                                                             tmp_path):
    """Stopped by the time-limit signal once both trainers have logged step 1, requeued; the requeued run preempted
    once it has logged a step of its own, requeued again; that run finishes."""
    reference, out, log = uninterrupted(2), tmp_path / "run", tmp_path / "job.out"
    job_id = submit(slurm, pretrain_args(corpus, cache, out), log)
    preemptor = []
    try:
        time_limit = stop_job(slurm, job_id, out, lambda: slurm.run("scancel", "--batch", "--signal=USR1", job_id),
                              past=1)
        until(lambda: "Stopped on SIGTERM" in log.read_text(), "the time-limit stop's line", 60)
        first = stop_steps(log.read_text(), [time_limit])[0]
        preempted = stop_job(slurm, job_id, out, lambda: preemptor.append(slurm.run(
            "sbatch", "--parsable", "--partition", "high", "--nodes", "2", "--cpus-per-task=1",
            f"--output={tmp_path / 'high.out'}", "--wrap", "true").strip()), past=first + 1)
        job = until_job(slurm, job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"))
        output = log.read_text()
        assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "2"), (job, output[-4000:])
        assert until_job(slurm, preemptor[0], ("COMPLETED",))["ExitCode"] == "0:0"
        steps = stop_steps(output, [time_limit, preempted])
        reports = [assert_stop_checkpoint(out, output, step, reference) for step in steps]
        for step in steps:  # each checkpoint resumed once, by the run requeued after it
            assert output.count(f"Resumed from {os.path.join(out, 'checkpoints', f'step_{step}')} at optimizer step "
                                f"{step}") == 1, output[-4000:]
        rows = [r["step"] for r in read_metrics(str(out)) if "loss" in r]
        assert rows == list(range(1, MAX_STEPS + 1)), rows  # each step once
        until(lambda: not processes_writing_to(str(out)), "the end of the job's processes", 60)
        print(f"time limit (USR1 to the batch script) after step {time_limit}: checkpoint at step {steps[0]}: "
              f"{reports[0]}; requeued; preempted by job {preemptor[0]} (partition high) after step {preempted}: "
              f"checkpoint at step {steps[1]}: {reports[1]}; requeued again, then {assert_same_run(out, reference)}")
    finally:
        kill_all(processes_writing_to(str(out)))


def test_scancel_leaves_a_resumable_checkpoint(slurm, corpus, cache, uninterrupted, tmp_path):
    """The checkpoint is the only one, complete, and equal to the uninterrupted run's at its step (weights, Adam
    state): what the same submission again resumes (`--resume_from_checkpoint auto` takes the newest complete one),
    as the two tests above do after their requeue."""
    reference, out, log = uninterrupted(2), tmp_path / "run", tmp_path / "job.out"
    job_id = submit(slurm, pretrain_args(corpus, cache, out), log)
    try:
        logged = stop_job(slurm, job_id, out, lambda: slurm.run("scancel", job_id))
        job = until_job(slurm, job_id, ("CANCELLED", "COMPLETED", "FAILED"))
        until(lambda: not processes_writing_to(str(out)), "the end of the job's processes", 60)
        with open(log) as f:
            output = f.read()
        assert (job["JobState"], job["Restarts"]) == ("CANCELLED", "0"), (job, output[-4000:])
        step = stop_steps(output, [logged])[0]
        report = assert_stop_checkpoint(out, output, step, reference)
        assert os.listdir(out / "checkpoints") == [f"step_{step}"] and not (out / "model.safetensors").exists()
        print(f"scancel after step {logged}: job cancelled, not requeued; checkpoint at step {step}: {report}")
    finally:
        kill_all(processes_writing_to(str(out)))
