"""Graceful stop on SIGTERM / SIGINT / SIGUSR1, and the divergence guard, through the scripts and their launchers.

Stop signals: a run is signalled once it has logged optimizer step STOP_AT. To make "the step the signal lands in"
deterministic on a busy machine, the trainers are paused (SIGSTOP) while the signal is sent and resumed (SIGCONT)
right after. A step asks whether to stop before its optimizer update (every rank at once) and logs its row after it,
so with k the last step logged the checkpoint is at k + 1, or at k + 2 when the pause came between step k + 1's
question and its row (seen on a busy machine: logged 2, stopped after 4); LANDS_WITHIN allows k to k + 2.
Properties: one checkpoint at that step, every process gone within GONE_WITHIN_S seconds, the documented exit
status, the one log line naming the checkpoint and the flag, and a checkpoint equal to the uninterrupted run's at
that step (weights and Adam state within 1e-6). Where the signal went to the launcher's process group the run is
also resumed from it (`latest`) and equals the uninterrupted run: losses at every step and the exported weights
within 1e-6. (Resuming is the same for every checkpoint: the launcher-only cases, whose checkpoints equal the
uninterrupted run's, are not resumed again, to keep the suite short.)

Divergence: a learning rate of 1e4 stops the run with one `error:` line and status 3, nothing non-finite is saved,
the JSON is strict. One non-finite step is produced honestly, by the model and data: a Llama with `rms_norm_eps=0`
whose embedding row of the token `q` is zero turns the one block holding `q` into NaN (RMSNorm of a zero vector is
0/0), so exactly one optimizer step gets a NaN loss and NaN gradients, on whichever rank holds that block.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, SCRIPTS, read_metrics, run_script
from safetensors.torch import load_file
from test_distributed import launcher
from test_finetune_causal_lm import sft  # noqa: F401  (fixture)
from test_exit_status import exit_status
from test_finetune_classifier import tiny  # noqa: F401  (fixture)

from common.features.exit_status import STOPPED_REASON
from common.guard import DIVERGED_STATUS
from common.guard import STOPPED_STATUS

TOL = 1e-6
MAX_STEPS, STOP_AT = 8, 2
LANDS_WITHIN = 2  # steps after the last one logged (the module's docstring)


def landed_after(step: int, logged: int) -> bool:
    """A stop at optimizer step `step` is where a signal sent once step `logged` was logged lands."""
    return logged <= step <= logged + LANDS_WITHIN
GONE_WITHIN_S = 15  # measured 2-4 s on a shared 2-core machine (one step, a save, teardown), 8 s under heavy load


def strict_json(text: str):
    """json.loads that rejects NaN / Infinity (Python's json accepts them; JSON does not)."""
    def reject(constant):
        raise ValueError(f"non-JSON constant {constant}")
    return json.loads(text, parse_constant=reject)


def assert_strict_outputs(out) -> None:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            strict_json(line)
    if os.path.exists(os.path.join(out, "all_results.json")):
        with open(os.path.join(out, "all_results.json")) as f:
            strict_json(f.read())


def pretrain_args(corpus, cache, out, *extra: str) -> list[str]:
    return ["--train_file", corpus["train"], "--validation_file", corpus["validation"], "--block_size", "64",
            "--tokenizer_vocab_size", "512", "--cache_dir", str(cache), "--output_dir", str(out),
            "--max_steps", str(MAX_STEPS), "--logging_steps", "1", "--per_device_train_batch_size", "4",
            "--mixed_precision", "no", "--sample_max_new_tokens", "0", "--max_eval_samples", "4", *extra]


def losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(str(out)) if "loss" in r}


def assert_same_checkpoint(checkpoint, reference) -> str:
    """Same weights and optimizer state (moments, step counts) as the reference checkpoint."""
    w, w_ref = (load_file(os.path.join(d, "model.safetensors")) for d in (checkpoint, reference))
    o, o_ref = (torch.load(os.path.join(d, "optimizer.bin"), weights_only=False)["state"]
                for d in (checkpoint, reference))
    weight_diff = max((w[k] - w_ref[k]).abs().max().item() for k in w_ref)
    state_diff = max((o[i][k] - o_ref[i][k]).abs().max().item() for i in o_ref for k in o_ref[i])
    assert weight_diff <= TOL and state_diff <= TOL, (weight_diff, state_diff)
    return f"checkpoint = uninterrupted run's (max |difference| weights {weight_diff:.1e}, Adam {state_diff:.1e})"


def assert_same_run(out, reference) -> str:
    a, b = losses(out), losses(reference)
    assert sorted(a) == sorted(b) == list(range(1, MAX_STEPS + 1))
    loss_diff = max(abs(a[s] - b[s]) for s in a)
    w, w_ref = (load_file(os.path.join(d, "model.safetensors")) for d in (out, reference))
    weight_diff = max((w[k] - w_ref[k]).abs().max().item() for k in w_ref)
    assert loss_diff <= TOL and weight_diff <= TOL, (loss_diff, weight_diff)
    return f"max |loss difference| {loss_diff:.1e}, max |weight difference| {weight_diff:.1e}"


# ---- processes ------------------------------------------------------------------------------------------------------

def command_lines_naming(out) -> dict[int, list[str]]:
    """pid -> command line of every process whose command line has `out` as one of its arguments."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if str(out) in argv:
            found[int(pid)] = argv
    return found


def trainer_pids(out) -> list[int]:
    """The training processes of the run writing to `out` (not the launcher: its command line says `launch` or
    `tools/launch.py`)."""
    return [pid for pid, argv in command_lines_naming(out).items()
            if not {"launch", "launch.py"} & {os.path.basename(a) for a in argv}
            and any(a.endswith(".py") for a in argv)]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def kill_all(pids) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def last_logged_step(out) -> int:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return max((json.loads(line).get("step", 0) for line in f if line.endswith("\n")), default=0)


def stop_run(cmd: list[str], out, sig: signal.Signals, to_group: bool,
             processes: int) -> tuple[int, float, str, int, list[int]]:
    """Start `cmd`; once it has logged STOP_AT, pause the trainers, note the last step they logged, send `sig` to the
    launcher's process group or to its PID alone, and let them go on. Returns (launcher exit status, seconds until
    every process was gone, output, last step logged when the signal was sent, the trainers still running when the
    launcher had ended).

    The trainers are found before STOP_AT, so pausing them costs no /proc scan: a fast run (80 steps/s) could
    otherwise log more steps meanwhile; the property is checked against the step they had reached."""
    log = os.path.join(os.path.dirname(out), os.path.basename(out) + ".log")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    trainers, deadline = [], time.monotonic() + 300
    try:
        while len(trainers) < processes or last_logged_step(out) < STOP_AT:
            assert proc.poll() is None, f"the run ended before step {STOP_AT}"
            assert time.monotonic() < deadline, f"no step {STOP_AT} in {out}"
            if len(trainers) < processes:
                trainers = trainer_pids(out)
            time.sleep(0.01)
        for pid in trainers:
            os.kill(pid, signal.SIGSTOP)
        assert sorted(trainer_pids(out)) == sorted(trainers), trainers
        logged = last_logged_step(out)
        os.killpg(proc.pid, sig) if to_group else os.kill(proc.pid, sig)
        started = time.monotonic()
        for pid in trainers:
            os.kill(pid, signal.SIGCONT)
        status = proc.wait(timeout=120)
        left_running = [pid for pid in trainers if alive(pid)]
        while any(alive(pid) for pid in trainers) and time.monotonic() - started < 120:
            time.sleep(0.05)
        seconds = time.monotonic() - started
    finally:  # on success all are gone already; after a failure leave nothing running
        kill_all(set(trainers) | set(trainer_pids(out)) | ({proc.pid} if proc.poll() is None else set()))
        proc.wait()
    with open(log) as f:
        return status, seconds, f.read(), logged, left_running


def assert_stopped_once(out, output: str, logged: int, max_steps: int = MAX_STEPS) -> int:
    """One checkpoint, at the step the signal landed in (within LANDS_WITHIN of the step logged when it came), and
    the one line that says where and how to continue."""
    assert STOP_AT <= logged < max_steps - LANDS_WITHIN, f"the trainers had logged step {logged} when signalled"
    checkpoints = os.listdir(os.path.join(out, "checkpoints"))
    assert len(checkpoints) == 1 and checkpoints[0].startswith("step_"), (logged, checkpoints)
    step = int(checkpoints[0].split("_")[1])
    assert landed_after(step, logged), (logged, checkpoints)
    path = os.path.join(out, "checkpoints", checkpoints[0])
    lines = [line for line in output.splitlines() if "Stopped on" in line]
    assert len(lines) == 1, output[-3000:]
    assert f"after optimizer step {step}; checkpoint saved in {path}" in lines[0]
    assert f"--resume_from_checkpoint {path}" in lines[0] and f"exit status {STOPPED_STATUS}" in lines[0]
    assert not os.path.exists(os.path.join(out, "model.safetensors"))  # stopped before the final export
    return step


# ---- stop signals ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")  # the trained tokenizer, shared by the runs


@pytest.fixture(scope="module")
def uninterrupted(corpus, cache, tmp_path_factory):
    """The reference run for each process count (with a checkpoint at every step), made when first asked for."""
    runs = {}

    def get(processes: int):
        if processes not in runs:
            out = tmp_path_factory.mktemp("uninterrupted") / f"{processes}proc"
            config = "cpu_1proc.yaml" if processes == 1 else "cpu_2proc.yaml"
            run_script("pretrain_llama.py", *pretrain_args(corpus, cache, out, "--checkpointing_steps", "1",
                                                           "--save_total_limit", str(MAX_STEPS)),
                       launcher=launcher(config, processes))
            runs[processes] = out
        return runs[processes]
    return get


# Measured with accelerate 1.15 / torch 2.13 (see common/features/preemption.py): one process = accelerate's plain Popen in
# the launcher's process group; two = torchrun's agent, whose workers run in their own session (a signal to the
# launcher's group reaches only the agent). The launcher's own exit status is what accelerate / torchrun make of it.
CASES = {
    # 1 process, Ctrl-C/`kill -- -PGID` style: launcher and trainer get the signal; the launcher dies of it at once.
    "1proc-group-SIGTERM": (1, True, signal.SIGTERM, -signal.SIGTERM),
    # 1 process, `kill LAUNCHER_PID`: only the launcher gets it; the trainer hears of it via PR_SET_PDEATHSIG.
    # The launcher ends at once, its trainer still saving (what tools/launch.py is for).
    "1proc-launcher-SIGTERM": (1, False, signal.SIGTERM, -signal.SIGTERM),
    # 1 process, `kill LAUNCHER_PID` to tools/launch.py: the trainer gets it passed on; the launcher waits for it and
    # returns its status.
    "1proc-tools-launch-SIGTERM": (1, False, signal.SIGTERM, STOPPED_STATUS),
    # 2 processes: the agent forwards SIGTERM to the workers, waits for them, then exits 1 (SignalException).
    "2proc-group-SIGTERM": (2, True, signal.SIGTERM, 1),
    # 2 processes, SIGUSR1 to the launcher (Slurm --signal=USR1@...): the agent dies of it without forwarding it;
    # the workers hear of it via PR_SET_PDEATHSIG.
    "2proc-launcher-SIGUSR1": (2, False, signal.SIGUSR1, -signal.SIGUSR1),
}


@pytest.mark.parametrize("case", CASES)
def test_stop_signal_checkpoints_and_resumes_exactly(case, corpus, cache, uninterrupted, tmp_path):
    processes, to_group, sig, launcher_status = CASES[case]
    config = "cpu_1proc.yaml" if processes == 1 else "cpu_2proc.yaml"
    out = tmp_path / "run"
    launch = launcher(config, processes)
    if "tools-launch" in case:  # the same arguments, to our launcher
        launch = [sys.executable, os.path.join(ROOT, "tools", "launch.py"), *launch[2:]]
    cmd = launch + [os.path.join(SCRIPTS, "pretrain_llama.py"), *pretrain_args(corpus, cache, out)]
    status, seconds, output, logged, left_running = stop_run(cmd, str(out), sig, to_group, processes)
    step = assert_stopped_once(out, output, logged)
    assert status == launcher_status, output[-3000:]
    # a launcher that returns a status waited for its trainers; accelerate's one-process one, killed, left it saving
    assert not left_running if launcher_status >= 0 else case != "1proc-launcher-SIGTERM" or left_running, case
    assert exit_status(out) == {"exit_status": STOPPED_STATUS, "state": "stopped", "reason": STOPPED_REASON}
    assert seconds < GONE_WITHIN_S
    reference = uninterrupted(processes)
    report = assert_same_checkpoint(out / "checkpoints" / f"step_{step}", reference / "checkpoints" / f"step_{step}")
    if to_group:
        run_script("pretrain_llama.py", *pretrain_args(corpus, cache, out, "--resume_from_checkpoint", "latest"),
                   launcher=launcher(config, processes))
        report += f"; resumed: {assert_same_run(out, reference)}"
    print(f"{case}: checkpoint at step {step}, all processes gone after {seconds:.1f} s, launcher status {status}; "
          f"{report}")


def test_fine_tuning_scripts_stop_on_sigint_and_sigusr1(sft, tiny, tmp_path):  # noqa: F811
    """The two fine-tuning scripts, run directly with python: SIGINT (Ctrl-C) and SIGUSR1 (Slurm --signal) stop
    them after a checkpoint, with the script's own exit status 143."""
    runs = {"finetune_causal_lm.py": (signal.SIGINT, sft, ["--per_device_train_batch_size", "4"]),
            "finetune_classifier.py": (signal.SIGUSR1, tiny, ["--per_device_train_batch_size", "8",
                                                              "--max_seq_length", "128"])}
    for script, (sig, data, args) in runs.items():
        out = str(tmp_path / script.removesuffix(".py"))
        cmd = [sys.executable, os.path.join(SCRIPTS, script), "--model_name_or_path", data["model"], "--train_file",
               data["train"], "--validation_file", data["validation"], *args, "--output_dir", out, "--max_steps", "40",
               "--logging_steps", "1"]
        status, seconds, output, logged, _ = stop_run(cmd, out, sig, to_group=False, processes=1)
        step = assert_stopped_once(out, output, logged, max_steps=40)
        assert f"Stopped on {sig.name}" in output
        assert status == STOPPED_STATUS and seconds < GONE_WITHIN_S, output[-3000:]
        print(f"{script}: {sig.name} -> checkpoint at step {step}, exit status {status}, gone after {seconds:.1f} s")


# ---- divergence -----------------------------------------------------------------------------------------------------

def assert_all_weights_finite(out) -> int:
    """Every saved model file (checkpoints, export) holds finite weights; returns how many files were checked."""
    files = [os.path.join(d, f) for d, _, names in os.walk(out) for f in names
             if f.endswith(".safetensors") or f.endswith("model_states.pt")]
    for path in files:
        state = load_file(path) if path.endswith(".safetensors") else torch.load(path, weights_only=False)["module"]
        assert all(torch.isfinite(t).all() for t in state.values() if torch.is_tensor(t)), path
    return len(files)


def test_learning_rate_1e4_stops_with_one_line(corpus, cache, tmp_path):
    out = tmp_path / "diverged"
    proc = run_script("pretrain_llama.py", *pretrain_args(corpus, cache, out, "--learning_rate", "1e4",
                                                          "--warmup_steps", "0", "--checkpointing_steps", "1"),
                      check=False)
    assert proc.returncode == DIVERGED_STATUS, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: training diverged: optimizer steps ")
    assert "5 in a row, --max_nonfinite_steps 5" in errors[0]
    assert exit_status(out) == {"exit_status": DIVERGED_STATUS, "state": "diverged", "reason": errors[0]}
    rows = [r for r in read_metrics(str(out)) if "loss" in r]
    # the fifth non-finite step stops the run before its row is written
    assert sum(r["skipped_nonfinite_steps"] for r in rows) == 4 and rows[-1]["grad_norm"] is None
    assert not os.path.exists(out / "model.safetensors") and not os.path.exists(out / "all_results.json")
    assert_strict_outputs(out)
    checked = assert_all_weights_finite(out)
    print(f"lr 1e4: stopped after step {rows[-1]['step']} (status {proc.returncode}); {checked} saved model files, "
          f"all finite")


@pytest.fixture(scope="module")
def one_bad_block(tmp_path_factory) -> dict[str, str]:
    """A corpus of 11 optimizer steps (batch 4 x 64 tokens) in which one block holds the token `q`, and a tiny Llama
    (rms_norm_eps=0) whose embedding of `q` is zero: that block's forward pass is NaN."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.inputs.data import train_bpe_tokenizer
    from common.inputs.modeling import LLAMA_PRESETS

    d = tmp_path_factory.mktemp("one_bad_block")
    rng = random.Random(0)
    words = ("the model reads tokens and learns to predict the next one while the optimizer updates weights "
             "with gradients from a loss over batches of text").split()
    rows = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 120))) for _ in range(48)]
    rows[5] += " q " + rows[6]
    paths = {"train": str(d / "train.jsonl"), "validation": str(d / "validation.jsonl"), "model": str(d / "init")}
    for split, part in (("train", rows[:40]), ("validation", rows[40:])):
        with open(paths[split], "w") as f:
            f.writelines(json.dumps({"text": r}) + "\n" for r in part)
    tokenizer = train_bpe_tokenizer(rows[:40], vocab_size=512)
    q = tokenizer.convert_tokens_to_ids("q")
    assert sum(tokenizer(r)["input_ids"].count(q) for r in rows[:40]) == 1
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_PRESETS["tiny"], vocab_size=len(tokenizer), rms_norm_eps=0.0))
    with torch.no_grad():
        model.model.embed_tokens.weight[q] = 0
    model.save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    return paths


def one_bad_block_run(data, out, config: str, processes: int, checkpointing_steps: int) -> list[dict]:
    run_script("pretrain_llama.py", "--model_name_or_path", data["model"], "--train_file", data["train"],
               "--validation_file", data["validation"], "--block_size", "64", "--output_dir", str(out),
               "--num_train_epochs", "1", "--logging_steps", "1", "--per_device_train_batch_size", str(4 // processes),
               "--mixed_precision", "no", "--sample_max_new_tokens", "0", "--checkpointing_steps",
               str(checkpointing_steps), "--save_total_limit", "100", launcher=launcher(config, processes))
    assert_strict_outputs(out)
    rows = [r for r in read_metrics(str(out)) if "loss" in r]
    saved = len(rows) // checkpointing_steps + 1  # the checkpoints and the export
    assert assert_all_weights_finite(out) == saved
    return rows


@pytest.fixture(scope="module")
def one_skipped_step(one_bad_block, tmp_path_factory):
    """Two processes (DDP): the rank holding the bad block gets NaN gradients, the all-reduce spreads them."""
    out = tmp_path_factory.mktemp("one_skipped_step") / "ddp"
    return out, one_bad_block_run(one_bad_block, out, "cpu_2proc.yaml", 2, checkpointing_steps=1)


def test_one_nonfinite_step_is_skipped_and_training_goes_on(one_skipped_step):
    out, rows = one_skipped_step
    skipped = [r["step"] for r in rows if r["skipped_nonfinite_steps"]]
    assert len(skipped) == 1 and len(rows) == 11, skipped
    bad = skipped[0]
    assert 1 < bad < 11  # with this seed; the comparison below needs a checkpoint before it
    assert rows[bad - 1]["loss"] is None and rows[bad - 1]["grad_norm"] is None
    assert all(r["loss"] is not None and r["grad_norm"] is not None for r in rows if r["step"] != bad)
    before, after = (os.path.join(out, "checkpoints", f"step_{s}") for s in (bad - 1, bad))
    # The update was skipped: weights, optimizer state (moments and step count) and schedule are as before it.
    w0, w1 = (load_file(os.path.join(d, "model.safetensors")) for d in (before, after))
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    o0, o1 = (torch.load(os.path.join(d, "optimizer.bin"), weights_only=False)["state"] for d in (before, after))
    assert all(torch.equal(o0[i][k], o1[i][k]) for i in o0 for k in o0[i])
    s0, s1 = (torch.load(os.path.join(d, "scheduler.bin"), weights_only=False) for d in (before, after))
    assert s0["last_epoch"] == s1["last_epoch"] and rows[bad]["lr"] == rows[bad - 1]["lr"]
    # ... and training went on: the next step updates the weights and the loss keeps falling.
    w2 = load_file(os.path.join(out, "checkpoints", f"step_{bad + 1}", "model.safetensors"))
    assert not all(torch.equal(w1[k], w2[k]) for k in w1)
    assert rows[-1]["loss"] < rows[0]["loss"]
    with open(os.path.join(out, "all_results.json")) as f:
        assert strict_json(f.read())["train_steps"] == 11
    print(f"step {bad} skipped on both ranks; weights, Adam state and schedule unchanged across it; final loss "
          f"{rows[-1]['loss']:.4f} (first {rows[0]['loss']:.4f})")


def test_deepspeed_skips_the_nonfinite_step_itself(one_bad_block, one_skipped_step, tmp_path):
    """DeepSpeed steps inside `backward`: ZeRO-2 (0.19.8) with its own Muon (the default --optim) sees the inf/NaN
    gradient norm, skips the update (momentum kept) and reports the norm as inf; the guard counts it. The same step
    skipped as in the DDP run, every later loss finite, nothing non-finite saved (`one_bad_block_run`). The losses
    are not compared to the DDP run's: DeepSpeed's Muon runs Newton-Schulz in bf16 (AdamW: test_distributed.py)."""
    _, ddp_rows = one_skipped_step
    rows = one_bad_block_run(one_bad_block, tmp_path / "zero2", "deepspeed_zero2.yaml", 1, checkpointing_steps=4)
    assert [r["skipped_nonfinite_steps"] for r in rows] == [r["skipped_nonfinite_steps"] for r in ddp_rows]
    losses = [r["loss"] for r in rows if r["loss"] is not None]
    assert len(losses) == 10 and all(math.isfinite(loss) for loss in losses)
    assert rows[0]["loss"] == pytest.approx(ddp_rows[0]["loss"], rel=1e-6)  # the same start


def late_skip_run(data, out, config: str) -> list[dict]:
    """The one-bad-block run of 11 steps on 2 processes, its figures read a step late (a row every 100 steps: only
    the last step is read at once), nothing saved before the export."""
    launch = [*launcher(config, 2), "--mixed_precision", "no"] if config == "fsdp2.yaml" else launcher(config, 2)
    run_script("pretrain_llama.py", "--model_name_or_path", data["model"], "--train_file", data["train"],
               "--validation_file", data["validation"], "--block_size", "64", "--output_dir", str(out),
               "--num_train_epochs", "1", "--logging_steps", "100", "--per_device_train_batch_size", "2",
               "--mixed_precision", "no", "--sample_max_new_tokens", "0", launcher=launch)
    return [r for r in read_metrics(str(out)) if "loss" in r]


@pytest.mark.parametrize("config", ["cpu_2proc.yaml", "fsdp2.yaml"])
def test_a_step_skipped_on_the_device_and_read_late_trains_as_one_read_at_once(one_bad_block, one_skipped_step,
                                                                               config, tmp_path):
    """Fused AdamW skips the NaN step on the device and the host learns it a step later (its schedule step taken
    back then): the run ends with the weights of the run that read every step at once (DDP: bit for bit; FSDP2:
    its own rounding), and counts the one skipped step."""
    from test_fsdp import weight_difference

    out, _ = one_skipped_step
    rows = late_skip_run(one_bad_block, tmp_path / "late", config)
    assert [r["step"] for r in rows] == [11] and rows[0]["skipped_nonfinite_steps"] == 1
    difference = weight_difference(tmp_path / "late", out)
    assert difference == 0.0 if config == "cpu_2proc.yaml" else difference <= 1e-5, difference
    print(f"{config}: the NaN step skipped on the device, read a step late; weights {difference:.1e} from the run "
          "that read each step at once")
