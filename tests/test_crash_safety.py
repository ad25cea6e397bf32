"""Crash safety: checkpoints survive a kill at any moment, one run per output folder, a full disk is one line, and a
checkpoint damaged after it was written (a truncated file, a missing file, a flipped byte) is never resumed: `auto`
passes over it to the newest one that verifies, saying which file; `latest` and an explicit path stop with one line.

The chaos test SIGKILLs a tiny pretraining run (attention dropout on) at moments drawn from a fixed seed (one before
its first checkpoint, several while a checkpoint is being written) and restarts it each time with the same command line
(`--resume_from_checkpoint auto`) until it completes; it must end exactly like the run that was never interrupted.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import DAMAGES, ROOT, SCRIPTS, damage, read_metrics, run_script, skip_line
import forked_runs
from forked_runs import ForkedProcess

from common.checkpoint import CheckpointExtras, complete_checkpoints, find_checkpoint_to_resume, save_checkpoint
from common.features.checksums import CHECKSUM, checkpoint_files, record_files, share, verify_checkpoint
from common.metrics import MetricsWriter
from common.output_dir import remove_leftovers
from common.paths import COMPLETE_MARKER, LOCK_FILE

STEPS, EVERY = 16, 2  # room for 5 kills: each one during a save costs the attempt a checkpoint


def pretrain_command(corpus, cache_dir, output_dir, *extra: str) -> list[str]:
    return [sys.executable, os.path.join(SCRIPTS, "pretrain_llama.py"), "--train_file", corpus["train"],
            "--validation_file", corpus["validation"], "--tokenizer_vocab_size", "512", "--block_size", "64",
            "--cache_dir", str(cache_dir), "--output_dir", str(output_dir), "--logging_steps", "1",
            "--sample_max_new_tokens", "0", "--mixed_precision", "no", "--max_train_samples", "80",
            "--max_eval_samples", "8", "--per_device_train_batch_size", "4", "--learning_rate", "3e-3", *extra]


def chaos_command(corpus, cache_dir, output_dir, config: str) -> list[str]:
    """With `config` holding dropout: every restart must also draw the uninterrupted run's dropout masks."""
    return pretrain_command(corpus, cache_dir, output_dir, "--max_steps", str(STEPS), "--checkpointing_steps",
                            str(EVERY), "--resume_from_checkpoint", "auto", "--config_name", config)


def start(cmd: list[str], log: str) -> subprocess.Popen | ForkedProcess:
    """The run in its own process group, output appended to `log` (forked: no 4 s of imports per restart)."""
    return forked_runs.start(cmd, ROOT, log)


def sigkill(proc: subprocess.Popen | ForkedProcess) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def wait_for(proc: subprocess.Popen | ForkedProcess, condition, timeout: float = 300) -> bool:
    """Poll every 5 ms until `condition()` holds (True) or the process ends (False)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if condition():
            return True
        assert time.monotonic() < deadline, "the run neither reached the kill moment nor ended"
        time.sleep(0.005)
    return False


def rows_since(output_dir, since: float) -> list[dict]:
    try:
        return [r for r in read_metrics(output_dir) if r["time"] > since]
    except (OSError, json.JSONDecodeError):  # not there yet, or a row being written
        return []


def leftovers(output_dir) -> list[str]:
    root = os.path.join(output_dir, "checkpoints")
    return sorted(n for n in os.listdir(root) if n.startswith(".tmp-")) if os.path.isdir(root) else []


def saving_after(output_dir, since: float) -> bool:
    """A checkpoint is being written after one this attempt published (time `since` on)."""
    try:
        published = [int(c.rsplit("_", 1)[1]) for c in complete_checkpoints(str(output_dir))
                     if os.path.getmtime(os.path.join(c, COMPLETE_MARKER)) > since]
    except FileNotFoundError:  # pruned meanwhile
        return False
    partial = [int(n.rsplit("_", 1)[1]) for n in partial_saves(output_dir)]
    return bool(published and partial and max(partial) > max(published))


def partial_saves(output_dir) -> list[str]:
    return [n for n in leftovers(output_dir) if re.fullmatch(r"\.tmp-step_\d+", n)]


def newest_complete_step(output_dir) -> int:
    found = complete_checkpoints(str(output_dir))
    return int(found[-1].rsplit("_", 1)[1]) if found else 0


def weights_diff(a, b) -> float:
    wa, wb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def train_rows(output_dir) -> list[dict]:
    return [r for r in read_metrics(output_dir) if "loss" in r]


@pytest.fixture(scope="module")
def reference(corpus, dropout_config, tmp_path_factory):
    """The uninterrupted run (it also fills the tokenizer and dataset caches the other runs reuse)."""
    d = tmp_path_factory.mktemp("crash")
    run_script("pretrain_llama.py", *chaos_command(corpus, d / "cache", d / "reference", dropout_config)[2:])
    return d


@pytest.fixture(scope="module")
def chaos(reference, corpus, dropout_config):
    """Kill the run at the planned moments, restarting it with the same command each time, until it completes."""
    out, log = reference / "chaos", str(reference / "chaos.log")
    cmd = chaos_command(corpus, reference / "cache", out, dropout_config)
    rng = random.Random(9)
    # A time kill lands inside a step after a drawn number of this attempt's rows, not after a drawn wall time: a
    # faster step must not carry the attempt so far that the save kills run out of checkpoints to interrupt.
    plan = [("save", rng.uniform(0, 0.02)) for _ in range(3)] + [("time", (rng.randint(1, 4), rng.uniform(0, 0.03)))]
    rng.shuffle(plan)
    plan.insert(0, ("first row", 0.0))  # dies before its first checkpoint: the restart starts fresh
    kills = []
    for kind, delay in plan:
        began = time.time()
        proc = start(cmd, log)
        if kind == "first row":
            moment = lambda: rows_since(out, began)  # noqa: E731
        elif kind == "time":
            rows, pause = delay
            moment = lambda: len(rows_since(out, began)) >= rows and (time.sleep(pause) or True)  # noqa: E731
        else:  # while the checkpoint after this attempt's first published one is being written
            moment = lambda: saving_after(out, began) and (time.sleep(delay) or True)  # noqa: E731
        if not wait_for(proc, moment):
            assert proc.returncode == 0, open(log).read()[-3000:]
            break
        sigkill(proc)
        kills.append({"kind": kind, "partial": partial_saves(out), "newest": newest_complete_step(out),
                      "rows": len(train_rows(out)) if os.path.exists(out / "metrics.jsonl") else 0})
    else:
        proc = start(cmd, log)
        assert proc.wait(timeout=600) == 0, open(log).read()[-3000:]
    return {"out": out, "kills": kills, "log": log}


def test_chaos_kills_end_like_the_uninterrupted_run(chaos, reference):
    out, kills = chaos["out"], chaos["kills"]
    print("kills:", kills)
    assert len(kills) == 5
    assert kills[0]["newest"] == 0 and kills[0]["rows"] >= 1  # died before any checkpoint, with rows logged
    during_saves = [k for k in kills if k["partial"]]
    assert len(during_saves) >= 2  # killed while a checkpoint was half-written
    ref = reference / "reference"
    assert weights_diff(out, ref) < 1e-6
    got, want = train_rows(out), train_rows(ref)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # each step once, the stale rows dropped
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], abs=1e-6)
    got, want = [r for r in read_metrics(out) if "eval_loss" in r], [r for r in read_metrics(ref) if "eval_loss" in r]
    assert [r["step"] for r in got] == [r["step"] for r in want] == [STEPS]
    assert got[0]["eval_loss"] == pytest.approx(want[0]["eval_loss"], abs=1e-6)
    # Only complete checkpoints remain, the newest --save_total_limit (2); the leftovers were cleaned up.
    assert sorted(os.listdir(out / "checkpoints")) == [f"step_{STEPS - EVERY}", f"step_{STEPS}"] and not leftovers(out)
    assert [p for p in os.listdir(out) if p.startswith(".tmp-")] == []


@pytest.fixture()
def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_leftovers_are_ignored_by_latest_and_cleaned_and_pruning_keeps_the_newest(accelerator, tmp_path):
    model = torch.nn.Linear(4, 4)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    for step in range(1, 6):
        save_checkpoint(accelerator, str(tmp_path), step, save_total_limit=2)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_4", "step_5"]  # pruned after each new one
    assert all((tmp_path / "checkpoints" / s / COMPLETE_MARKER).is_file() for s in ("step_4", "step_5"))
    # An interrupted save of step 6 (half a model file) and a step_7 folder without the completion marker.
    shutil.copytree(tmp_path / "checkpoints" / "step_5", tmp_path / "checkpoints" / ".tmp-step_6")
    shutil.copytree(tmp_path / "checkpoints" / "step_5", tmp_path / "checkpoints" / "step_7")
    os.remove(tmp_path / "checkpoints" / "step_7" / COMPLETE_MARKER)
    with open(tmp_path / "checkpoints" / ".tmp-step_6" / "model.safetensors", "r+b") as f:
        f.truncate(10)
    for value in ("latest", "auto"):
        assert find_checkpoint_to_resume(str(tmp_path), value) == str(tmp_path / "checkpoints" / "step_5")
    accelerator.load_state(find_checkpoint_to_resume(str(tmp_path), "latest"))  # what it picks loads
    remove_leftovers(str(tmp_path))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_4", "step_5", "step_7"]  # the leftover is gone
    save_checkpoint(accelerator, str(tmp_path), 8, save_total_limit=2)  # prunes complete ones only
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_5", "step_7", "step_8"]


# In-process saves without a script run: the marker records file sizes and checksums, as a recipe's do.
CHECKSUMS = CheckpointExtras(record_files=record_files, verify=verify_checkpoint)


def argparse_namespace(output_dir, overwrite: bool = False):
    import argparse

    return argparse.Namespace(output_dir=str(output_dir), overwrite_output_dir=overwrite)


def test_metrics_trim_keeps_the_rows_before_the_checkpoint_and_is_atomic(tmp_path, monkeypatch):
    rows = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 2, "eval_loss": 2.5},
            {"step": 3, "loss": 1.0}, {"step": 4, "loss": 0.5}, {"step": 4, "eval_loss": 0.7}]
    original = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "lo'  # the last row cut by a kill
    (tmp_path / "metrics.jsonl").write_text(original)
    (tmp_path / "checkpoints" / "step_4").mkdir(parents=True)
    # Saved at step 4 (the final step) before its evaluation: 5 rows; the resumed run evaluates step 4 again.
    (tmp_path / "checkpoints" / "step_4" / COMPLETE_MARKER).write_text('{"step": 4, "metrics_rows": 5}')

    def killed(*args):
        raise KeyboardInterrupt  # stands for a kill between writing the trimmed copy and replacing the file

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        MetricsWriter(str(tmp_path), True, resume_step=4)
    assert (tmp_path / "metrics.jsonl").read_text() == original  # never emptied
    monkeypatch.undo()
    MetricsWriter(str(tmp_path), True, resume_step=4)
    assert read_metrics(tmp_path) == rows[:5]
    MetricsWriter(str(tmp_path), True, resume_step=2)  # no marker for step 2: rows up to step 2
    assert read_metrics(tmp_path) == rows[:3]
    MetricsWriter(str(tmp_path), True, resume_step=0)  # a fresh start in a folder whose run died early
    assert read_metrics(tmp_path) == []


def lock_is_free(output_dir) -> bool:
    with open(os.path.join(output_dir, LOCK_FILE), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def test_one_live_run_per_folder_and_overwrite_starts_over(reference, corpus):
    """A run with --overwrite_output_dir in a finished run's folder: the old checkpoints, metrics and export are gone
    before it trains; the same command started beside it is refused with one line; a SIGKILL frees the folder."""
    out = reference / "overwritten"
    shutil.copytree(reference / "reference", out)
    began = time.time()
    cmd = pretrain_command(corpus, reference / "cache", out, "--max_steps", "100000", "--overwrite_output_dir")
    live = start(cmd, str(reference / "live.log"))
    try:
        assert wait_for(live, lambda: rows_since(out, began)), open(reference / "live.log").read()[-3000:]
        assert not (out / "checkpoints").exists() and not (out / "model.safetensors").exists()
        assert not (out / "all_results.json").exists() and all(r["time"] > began for r in read_metrics(out))
        assert not lock_is_free(out)
        second = run_script("pretrain_llama.py", *cmd[2:], timeout=300, check=False)
        assert live.poll() is None  # still running: the refusal was about a live run
        lines = second.stderr.strip().splitlines()
        print(lines[-1])
        assert second.returncode == 2 and lines[-1].startswith(f"error: --output_dir {out} is in use by a live run "
                                                               f"(pid {live.pid} on ")
        assert "Traceback" not in second.stderr and all(r["time"] > began for r in read_metrics(out))
    finally:
        sigkill(live)
    assert lock_is_free(out)  # the kernel released the killed run's lock
    assert find_checkpoint_to_resume(str(out), "auto") is None  # nothing of the old run can be resumed
    with pytest.raises(SystemExit):
        find_checkpoint_to_resume(str(out), "latest")


def test_full_disk_is_one_line_and_keeps_the_previous_checkpoint(reference, corpus):
    """A real full disk: the output folder on a 14 MiB tmpfs (a user + mount namespace). A checkpoint takes 9.6 MB:
    step 2 fits, step 4 does not."""
    if subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True).returncode:
        pytest.skip("unprivileged user namespaces are off: no tmpfs to fill")
    out, copy = reference / "small_disk", reference / "small_disk_copy"
    out.mkdir()
    cmd = pretrain_command(corpus, reference / "cache", out, "--max_steps", "4", "--checkpointing_steps", "2")
    mount_run_copy = 'mount -t tmpfs -o size=14m tmpfs "$0" && "$@"; rc=$?; cp -a "$0" "$COPY"; exit $rc'
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount_run_copy, str(out),
                           *cmd], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COPY": str(copy)})
    last = proc.stderr.strip().splitlines()[-1]
    print(last)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last.startswith(f"error: disk full: checkpoint step_4 could not be written to {out}/checkpoints "
                           f"(filesystem {out}, ") and f"{out}/checkpoints/step_2 is intact" in last
    assert os.listdir(copy / "checkpoints") == ["step_2"]  # the partial save removed, the previous one whole
    ckpt = copy / "checkpoints" / "step_2"
    assert json.loads((ckpt / COMPLETE_MARKER).read_text())["step"] == 2
    assert load_file(ckpt / "model.safetensors").keys() and torch.load(ckpt / "optimizer.bin")["state"]


def one_line_stop(capsys, find, *args) -> str:
    """The `error: ...` line (status 2) a resume stops with."""
    with pytest.raises(SystemExit) as stopped:
        find(*args)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.bin", "random_states_0.pkl"])
def test_a_damaged_checkpoint_is_skipped_by_auto_and_refused_by_latest(accelerator, tmp_path, capsys, caplog, name):
    """Two checkpoints; the newer one damaged each way in turn. Without the record, safetensors would load the
    flipped byte and a resume without random_states_0.pkl would go on, inexact, both without a word."""
    import xxhash

    model = torch.nn.Linear(64, 64)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    model(torch.ones(2, 64)).sum().backward()
    optimizer.step()  # the optimizer has moments to save
    for step in (1, 2):
        save_checkpoint(accelerator, str(tmp_path / "run"), step, save_total_limit=None, extras=CHECKSUMS)
    newest = tmp_path / "run" / "checkpoints" / "step_2"
    files = json.loads((newest / COMPLETE_MARKER).read_text())["files"]
    assert sorted(files) == checkpoint_files(str(newest)) and name in files  # every file, the marker aside
    for file, recorded in files.items():
        content = (newest / file).read_bytes()
        assert recorded == {"bytes": len(content), CHECKSUM: xxhash.xxh3_64(content).hexdigest()}
    for kind in DAMAGES:
        out = tmp_path / kind
        shutil.copytree(tmp_path / "run", out)
        checkpoint, previous = out / "checkpoints" / "step_2", str(out / "checkpoints" / "step_1")
        problem = damage(checkpoint, name, kind)
        if kind == "flipped" and name == "model.safetensors":
            assert load_file(checkpoint / name).keys()  # safetensors alone would not notice
        caplog.clear()
        assert find_checkpoint_to_resume(str(out), "auto", accelerator, verify_checkpoint) == previous
        assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [skip_line(checkpoint, problem)]
        find = (find_checkpoint_to_resume, str(out))
        assert one_line_stop(capsys, *find, "latest", accelerator, verify_checkpoint) == (
            f"error: --resume_from_checkpoint latest: {checkpoint} is damaged: {problem}; --resume_from_checkpoint "
            "auto resumes the newest checkpoint that verifies")
        assert one_line_stop(capsys, *find, str(checkpoint), accelerator, verify_checkpoint) == (
            f"error: --resume_from_checkpoint {checkpoint} is damaged: {problem}; resume another checkpoint "
            "(--resume_from_checkpoint auto takes the newest one that verifies)")
        if kind == "missing":  # both damaged: auto has nothing to resume and says so, rather than start over
            other = damage(previous, name, "truncated")
            assert one_line_stop(capsys, *find, "auto", accelerator, verify_checkpoint) == (
                f"error: --resume_from_checkpoint auto: no checkpoint under {out / 'checkpoints'} verifies (step_2: "
                f"{problem}; step_1: {other}); remove them to start fresh, or start over with --overwrite_output_dir "
                "instead of --resume_from_checkpoint")


def test_a_checkpoint_without_a_file_record_resumes_with_a_warning(accelerator, tmp_path, caplog):
    """Checkpoints saved before markers recorded their files: resumed unverified, with one line saying so."""
    model = torch.nn.Linear(4, 4)
    accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    save_checkpoint(accelerator, str(tmp_path), 1, save_total_limit=None, extras=CHECKSUMS)
    checkpoint = tmp_path / "checkpoints" / "step_1"
    (checkpoint / COMPLETE_MARKER).write_text('{"step": 1, "metrics_rows": 0}')
    for value in ("latest", "auto"):
        caplog.clear()
        assert find_checkpoint_to_resume(str(tmp_path), value, accelerator, verify_checkpoint) == str(checkpoint)
        assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
            f"{checkpoint} records no file sizes or checksums (saved by an older version, or not marked complete): "
            "resuming it unverified"]


def test_the_processes_share_the_checksums_evenly():
    """Each file is checksummed by exactly one process; no process carries more than the largest file extra."""
    sizes = {f"f{i}": size for i, size in enumerate([100, 7, 7, 3, 50, 50, 1, 0, 64, 2])}
    for count in (1, 2, 3, 4):
        parts = [share(sizes, index, count) for index in range(count)]
        assert sorted(n for part in parts for n in part) == sorted(sizes)
        loads = [sum(sizes[n] for n in part) for part in parts]
        assert max(loads) - min(loads) <= max(sizes.values())


@pytest.mark.parametrize("processes", [1, 2])
def test_full_disk_during_the_export_is_one_line_and_leaves_no_part_of_it(reference, corpus, processes):
    """A real full disk (a 3 MiB tmpfs) when the final export writes its 4.5 MB of weights: a safetensors traceback
    left config.json without weights. Now the export is written aside and moved into place once complete: one line,
    and no part of it in the folder; with 2 processes, the main process alone writes and every process stops."""
    from conftest import launcher

    if subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True).returncode:
        pytest.skip("unprivileged user namespaces are off: no tmpfs to fill")
    out, copy = reference / f"small_export_disk_{processes}", reference / f"small_export_disk_{processes}_copy"
    out.mkdir()
    cmd = pretrain_command(corpus, reference / "cache", out, "--max_steps", "2")
    if processes == 2:
        cmd = launcher("cpu_2proc.yaml", 2) + cmd[1:]
    mount_run_copy = 'mount -t tmpfs -o size=3m tmpfs "$0" && "$@"; rc=$?; cp -a "$0" "$COPY"; exit $rc'
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount_run_copy, str(out),
                           *cmd], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COPY": str(copy)})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    print(errors)
    assert len(errors) == 1 and errors[0].startswith(
        f"error: disk full: the model could not be exported to {out} (filesystem {out}, ") and errors[0].endswith(
        " MiB free after removing the partial export; nothing of it was left): free some space, then rerun with "
        "--overwrite_output_dir (there is no checkpoint to resume)"), proc.stderr[-3000:]
    if processes == 1:
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == errors[0]
    else:  # the launcher's status and report (tests/test_bad_inputs.py)
        assert proc.returncode == 1 and f"traceback : {errors[0]}" in proc.stderr
    # no config.json, no weights, no leftover; the record of how the command ended
    assert sorted(os.listdir(copy)) == [".lock", "exit_status.json", "metrics.jsonl"]
