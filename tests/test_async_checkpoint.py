"""Asynchronous checkpoints (`--async_checkpointing`, common/features/async_checkpoint.py) keep every property of the
blocking ones:
- one process: each checkpoint holds byte for byte the files a blocking save writes (the completion markers record the
  same sizes and xxh3 checksums), and the run ends with the blocking run's weights and losses;
- SIGKILLs timed inside the background write (the save returned to the loop, the writer slowed by
  ASYNC_CHECKPOINT_TEST_DELAY_S) and at a random moment: each restart (`--resume_from_checkpoint auto`) resumes the
  newest complete checkpoint, which --save_total_limit never deleted while a newer one was being written, and the run
  ends exactly like the uninterrupted one (dropout on);
- a background write that fails on a full disk (a real 20 MiB tmpfs) stops the run with one line at the next wait,
  after the loop went on, and the previous checkpoint stays whole;
- 2 processes under DDP: the same files as blocking saves; under FSDP2: the same DCP shards (only `.metadata`'s save id
  and path differ) and the same final weights;
- any other failed background write is one line at the next wait, naming the error and the intact checkpoint;
- DeepSpeed is refused in one line.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, launcher, read_metrics, run_script
from safetensors.torch import load_file
from test_crash_safety import (leftovers, newest_complete_step, partial_saves, pretrain_command, rows_since, sigkill,
                               start, wait_for)

from common.checkpoint import complete_checkpoints
from common.features.async_checkpoint import WRITE_DELAY_ENV, save_in_background
from common.features.checksums import verify
from common.paths import COMPLETE_MARKER

STEPS, EVERY = 8, 2


def chaos_command(corpus, cache_dir, output_dir, config: str, *extra: str) -> list[str]:
    return pretrain_command(corpus, cache_dir, output_dir, "--max_steps", str(STEPS), "--checkpointing_steps",
                            str(EVERY), "--resume_from_checkpoint", "auto", "--config_name", config, *extra)


def recorded_files(checkpoint) -> dict[str, dict]:
    with open(os.path.join(checkpoint, COMPLETE_MARKER)) as f:
        return json.load(f)["files"]


def final_weights(output_dir) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(output_dir, "model.safetensors"))


def losses(output_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(str(output_dir)) if "loss" in r]


@pytest.fixture(scope="module")
def runs(corpus, dropout_config, tmp_path_factory):
    """The same run with blocking and with asynchronous checkpoints (it also fills the caches the other runs reuse)."""
    d = tmp_path_factory.mktemp("async")
    for name, extra in (("blocking", ()), ("async", ("--async_checkpointing",))):
        run_script("pretrain_llama.py", *chaos_command(corpus, d / "cache", d / name, dropout_config, *extra)[2:])
    return d


def test_async_checkpoints_are_the_blocking_ones_and_the_run_ends_the_same(runs):
    blocking, background = runs / "blocking", runs / "async"
    names = [os.path.basename(c) for c in complete_checkpoints(str(blocking))]
    assert names == [os.path.basename(c) for c in complete_checkpoints(str(background))] == ["step_6", "step_8"]
    for name in names:
        checkpoint = background / "checkpoints" / name
        assert recorded_files(checkpoint) == recorded_files(blocking / "checkpoints" / name)  # sizes and checksums
        assert verify(str(checkpoint)) == (True, None)  # and the files on disk are the recorded ones
    assert {k: v.tolist() for k, v in final_weights(background).items()} == \
        {k: v.tolist() for k, v in final_weights(blocking).items()}
    assert losses(background) == losses(blocking)
    assert not leftovers(background)


@pytest.fixture(scope="module")
def chaos(runs, corpus, dropout_config):
    """Kill the asynchronous run inside its background writes (slowed by 1 s per large file), restart it with the same
    command each time, until it completes."""
    out, log = runs / "chaos", str(runs / "chaos.log")
    cmd = chaos_command(corpus, runs / "cache", out, dropout_config, "--async_checkpointing")
    rng = random.Random(3)
    plan = [("writing", rng.uniform(0, 0.8)), ("writing", rng.uniform(0, 0.8)), ("time", rng.uniform(0, 1.5))]
    kills = []
    os.environ[WRITE_DELAY_ENV] = "1"
    try:
        for kind, delay in plan:
            began = time.time()
            proc = start(cmd, log)
            if kind == "writing":  # a save this attempt started is being written in the background
                moment = lambda: rows_since(out, began) and writing_in_background(out) and (  # noqa: E731
                    time.sleep(delay) or True)
            else:
                moment = lambda: rows_since(out, began) and (time.sleep(delay) or True)  # noqa: E731
            if not wait_for(proc, moment):
                assert proc.returncode == 0, open(log).read()[-3000:]
                break
            sigkill(proc)
            partial = [int(n.rsplit("_", 1)[1]) for n in partial_saves(out)]
            kills.append({"kind": kind, "partial": partial, "newest": newest_complete_step(out),
                          "complete": [os.path.basename(c) for c in complete_checkpoints(str(out))]})
        else:
            proc = start(cmd, log)
            assert proc.wait(timeout=600) == 0, open(log).read()[-3000:]
    finally:
        del os.environ[WRITE_DELAY_ENV]
    return {"out": out, "kills": kills}


def writing_in_background(output_dir) -> bool:
    """The loop has gone on from a save (its last small file is written), whose large files are not written yet."""
    for name in partial_saves(output_dir):
        try:
            files = set(os.listdir(os.path.join(output_dir, "checkpoints", name)))
        except FileNotFoundError:  # published meanwhile
            continue
        if "custom_checkpoint_0.pkl" in files and ".written-rank_0" not in files:
            return True
    return False


def test_kills_inside_background_writes_end_like_the_uninterrupted_run(chaos, runs):
    out, kills = chaos["out"], chaos["kills"]
    print("kills:", kills)
    assert len(kills) == 3
    inside = [k for k in kills if k["partial"]]
    assert len(inside) >= 2  # killed while a checkpoint was being written in the background
    for kill in inside:  # the one before it is complete and kept (--save_total_limit 2 pruned nothing newer)
        assert kill["newest"] == max(kill["partial"]) - EVERY or (kill["newest"] == 0 and max(kill["partial"]) == EVERY)
    reference = runs / "blocking"
    assert {k: v.tolist() for k, v in final_weights(out).items()} == \
        {k: v.tolist() for k, v in final_weights(reference).items()}
    got, want = losses(out), losses(reference)
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in want], abs=1e-6)
    assert sorted(os.listdir(out / "checkpoints")) == [f"step_{STEPS - EVERY}", f"step_{STEPS}"] and not leftovers(out)


def test_a_failed_background_write_stops_the_run_in_one_line_at_the_next_wait(runs, corpus):
    """A real full disk (a 14 MiB tmpfs): step 2's 9.6 MB fit, step 4's optimizer file does not; the loop goes on to
    step 6, whose save waits for step 4's and stops there."""
    if subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True).returncode:
        pytest.skip("unprivileged user namespaces are off: no tmpfs to fill")
    out, copy = runs / "small_disk", runs / "small_disk_copy"
    out.mkdir()
    cmd = pretrain_command(corpus, runs / "cache", out, "--max_steps", "8", "--checkpointing_steps", "2",
                           "--async_checkpointing")
    mount_run_copy = 'mount -t tmpfs -o size=14m tmpfs "$0" && "$@"; rc=$?; cp -a "$0" "$COPY"; exit $rc'
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount_run_copy, str(out),
                           *cmd], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COPY": str(copy)})
    last = proc.stderr.strip().splitlines()[-1]
    print(last)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last.startswith(f"error: disk full: checkpoint step_4 could not be written to {out}/checkpoints "
                           f"(filesystem {out}, ") and f"{out}/checkpoints/step_2 is intact" in last
    assert [r["step"] for r in read_metrics(str(copy)) if "loss" in r] == [1, 2, 3, 4, 5, 6]  # stopped at step 6's wait
    assert os.listdir(copy / "checkpoints") == ["step_2"]  # the partial save removed, the previous one whole
    assert verify(str(copy / "checkpoints" / "step_2")) == (True, None)


@pytest.mark.parametrize("config", ["cpu_2proc.yaml", "fsdp2.yaml"])
def test_two_processes_write_what_blocking_saves_write(config, runs, corpus, dropout_config):
    outputs = {}
    for name, extra in (("blocking", ()), ("async", ("--async_checkpointing",))):
        outputs[name] = out = runs / f"{config.removesuffix('.yaml')}-{name}"
        args = pretrain_command(corpus, runs / "cache", out, "--max_steps", "3", "--checkpointing_steps", "1",
                                "--config_name", dropout_config, "--per_device_train_batch_size", "2", *extra)[2:]
        run_script("pretrain_llama.py", *args, launcher=launcher(config) + ["--mixed_precision", "no"])
    blocking, background = outputs["blocking"], outputs["async"]
    names = [os.path.basename(c) for c in complete_checkpoints(str(background))]
    assert names == [os.path.basename(c) for c in complete_checkpoints(str(blocking))] == ["step_2", "step_3"]
    for name in names:
        files = recorded_files(background / "checkpoints" / name)
        reference = recorded_files(blocking / "checkpoints" / name)
        assert files.keys() == reference.keys()
        # DCP's .metadata records the folder it was written to and a random save id; every other byte is the same
        assert {k: v for k, v in files.items() if not k.endswith(".metadata")} == \
            {k: v for k, v in reference.items() if not k.endswith(".metadata")}
    assert any(name.endswith(".distcp") for name in files) == (config == "fsdp2.yaml")
    assert {k: v.tolist() for k, v in final_weights(background).items()} == \
        {k: v.tolist() for k, v in final_weights(blocking).items()}
    assert losses(background) == losses(blocking)


def test_deepspeed_is_refused_in_one_line(capsys):
    from accelerate.utils import DistributedType

    with pytest.raises(SystemExit) as stopped:
        save_in_background(SimpleNamespace(async_checkpointing=True),
                           SimpleNamespace(distributed_type=DistributedType.DEEPSPEED))
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --async_checkpointing does not work with DeepSpeed") and len(err.splitlines()) == 1


@pytest.fixture()
def background_saves():
    """An in-process accelerator with a tiny prepared model, and checkpoint extras that write in the background."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from common.checkpoint import CheckpointExtras
    from common.features.async_checkpoint import BackgroundCheckpoints
    from common.features.checksums import record_files
    from common.features.disk import stop_if_disk_full
    from common.steps import track_progress

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    track_progress(accelerator)
    extras = CheckpointExtras(record_files=record_files, explain_failed_save=stop_if_disk_full)
    extras.save = BackgroundCheckpoints(accelerator)
    yield accelerator, extras
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_any_failed_background_write_is_one_line_at_the_next_wait(background_saves, tmp_path, capsys,
                                                                   monkeypatch):
    """In-process: a save returns while its write runs; a write that raised is reported by the next wait, never
    silently, with one line naming the error and the intact checkpoint; nothing of the failed save is published."""
    from common.checkpoint import save_checkpoint
    from common.features import async_checkpoint
    from common.features.async_checkpoint import wait_for_checkpoint

    accelerator, extras = background_saves
    first = save_checkpoint(accelerator, str(tmp_path), 1, 2, extras)
    wait_for_checkpoint(extras)
    assert complete_checkpoints(str(tmp_path)) == [first] and verify(first) == (True, None)

    def broken(*args, **kwargs):
        raise RuntimeError("the storage went away\n(details)")

    monkeypatch.setattr(async_checkpoint, "save", broken)
    second = save_checkpoint(accelerator, str(tmp_path), 2, 2, extras)  # returns: the write runs meanwhile
    with pytest.raises(SystemExit) as stopped:
        wait_for_checkpoint(extras)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: checkpoint {second} could not be written in the background (RuntimeError: the storage went "
        f"away); {first} is intact: rerun with --resume_from_checkpoint auto")
    assert complete_checkpoints(str(tmp_path)) == [first]


@pytest.mark.parametrize("background_write", ["fails", "succeeds"])
def test_a_full_disk_met_first_by_another_write_leaves_no_partial_save(background_saves, tmp_path, capsys,
                                                                       monkeypatch, background_write):
    """The disk fills while step 4's checkpoint is written in the background, and a metrics.jsonl row meets it first
    (a real ENOSPC: the file is /dev/full): that was the metrics writer's traceback with `.tmp-step_4` left behind. Now
    the background write is waited for: failed, its partial folder goes and the line is the blocking save's (step_2
    intact); published, the line names metrics.jsonl and step_4 is intact."""
    import errno
    import threading

    from common.checkpoint import save_checkpoint
    from common.features import async_checkpoint
    from common.features.async_checkpoint import wait_for_checkpoint
    from common.features.disk import mount_point, stop_on_full_disk
    from common.metrics import MetricsWriter

    out = tmp_path / "out"
    accelerator, extras = background_saves
    step_2 = save_checkpoint(accelerator, str(out), 2, None, extras)
    wait_for_checkpoint(extras)
    os.symlink("/dev/full", out / "metrics.jsonl")  # every write: ENOSPC
    writing, write = threading.Event(), async_checkpoint.save

    def slow_write(*args, **kwargs):
        writing.set()
        time.sleep(0.5)  # the loop's metrics row meets the full disk first
        if background_write == "fails":
            raise OSError(errno.ENOSPC, "No space left on device")
        write(*args, **kwargs)

    monkeypatch.setattr(async_checkpoint, "save", slow_write)

    def train() -> int:
        save_checkpoint(accelerator, str(out), 4, None, extras)  # returns while the write runs
        assert writing.wait(10)
        MetricsWriter(str(out), True).write({"step": 5, "loss": 1.0})
        return 0

    with pytest.raises(SystemExit) as stopped:
        stop_on_full_disk(train, str(out), extras)()
    assert stopped.value.code == 2
    line = capsys.readouterr().err
    checkpoints = out / "checkpoints"
    if background_write == "fails":
        assert line.startswith(f"error: disk full: checkpoint step_4 could not be written to {checkpoints} "
                               f"(filesystem {mount_point(str(out))}, ") and line.endswith(
            f" MiB free after removing the partial save); {step_2} is intact: free some space, then rerun with "
            "--resume_from_checkpoint auto\n")
        assert os.listdir(checkpoints) == ["step_2"]  # no .tmp-step_4
    else:
        assert line.startswith(f"error: disk full: {out}/metrics.jsonl could not be written (filesystem ") and \
            line.endswith(f" MiB free): free some space, then rerun with --resume_from_checkpoint auto "
                          f"({checkpoints}/step_4 is intact)\n")
        assert sorted(os.listdir(checkpoints)) == ["step_2", "step_4"]
        assert verify(str(checkpoints / "step_4")) == (True, None)
    assert len(line.splitlines()) == 1
