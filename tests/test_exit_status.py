"""How a run ended survives the launcher: `accelerate launch` turns statuses 2, 3 and 143 into 1, so the main process
writes `<output_dir>/exit_status.json` (common/features/exit_status.py). The stop-signal and divergence tests of
tests/test_preemption.py check the file for 143 (under the real launcher, 1 and 2 processes) and 3."""

from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import ACCELERATE, CONFIGS, run_script
from common.errors import fail
from common.features.exit_status import record_exit_status
from common.paths import EXIT_STATUS_FILE, METRICS_FILE


def exit_status(output_dir) -> dict | None:
    path = os.path.join(output_dir, EXIT_STATUS_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        record = json.load(f)
    assert isinstance(record.pop("time"), int)
    return record


def run_folder(tmp_path, stale: bool = True):
    out = tmp_path / "out"
    out.mkdir()
    (out / METRICS_FILE).write_text("")
    if stale:
        (out / EXIT_STATUS_FILE).write_text('{"exit_status": 0, "state": "completed", "reason": "", "time": 0}\n')
    return out


def bad_input():
    fail("--per_device_train_batch_size must be >= 1 (got 0)")


def diverged():
    raise SystemExit(3)


def crashed():
    raise RuntimeError("CUDA out of memory")


@pytest.mark.parametrize("main, status, state, reason", [
    (lambda: None, 0, "completed", ""),
    (bad_input, 2, "error", "error: --per_device_train_batch_size must be >= 1 (got 0)"),
    (lambda: sys.exit(143), 143, "stopped",
     "stopped by a signal after saving a checkpoint: rerun with --resume_from_checkpoint latest"),
    (crashed, 1, "failed", "RuntimeError: CUDA out of memory"),
])
def test_the_end_of_a_run_is_recorded_in_its_folder(tmp_path, capsys, main, status, state, reason):
    out = run_folder(tmp_path)
    wrapped = record_exit_status(main, ["--output_dir", str(out), "--bf16"])
    if status == 0:
        wrapped()
    else:
        with pytest.raises(BaseException) as raised:
            wrapped()
        assert raised.value.code == status if isinstance(raised.value, SystemExit) else status == 1
    assert exit_status(out) == {"exit_status": status, "state": state, "reason": reason}
    assert sorted(os.listdir(out)) == [EXIT_STATUS_FILE, METRICS_FILE]  # no temporary file left


def test_a_folder_without_a_run_gets_nothing_and_a_stale_record_goes_at_start(tmp_path, capsys):
    fresh = tmp_path / "fresh"
    with pytest.raises(SystemExit):
        record_exit_status(bad_input, ["--output_dir", str(fresh)])()
    assert not fresh.exists()  # bad input on a fresh folder still writes nothing
    out = run_folder(tmp_path)

    def killed():  # a SIGKILL ends the process inside main: what the file says then is what main found
        assert exit_status(out) is None

    record_exit_status(killed, ["--output_dir", str(out)])()


def test_under_accelerate_launch_the_status_is_in_the_folder(tmp_path, corpus):
    """The README's command: the launcher returns 1 for a run that refused its bad input with status 2; the folder
    says 2 and why. A completed run says 0."""
    out = tmp_path / "out"
    launch = [ACCELERATE, "launch", "--quiet", "--config_file", os.path.join(CONFIGS, "default.yaml")]
    args = ["--train_file", corpus["train"], "--validation_file", corpus["validation"], "--block_size", "32",
            "--tokenizer_vocab_size", "300", "--cache_dir", str(tmp_path / "cache"), "--max_steps", "2",
            "--per_device_train_batch_size", "2", "--sample_max_new_tokens", "0", "--max_eval_samples", "2",
            "--output_dir", str(out)]
    run_script("pretrain_llama.py", *args, launcher=launch)
    assert exit_status(out) == {"exit_status": 0, "state": "completed", "reason": ""}
    proc = run_script("pretrain_llama.py", *args, launcher=launch, check=False)  # again, into the used folder
    expected = (f"error: --output_dir {out} already holds a run; pass --resume_from_checkpoint latest to continue it "
                "or --overwrite_output_dir to start over")
    assert proc.returncode == 1 and proc.stderr.splitlines()[-1] == expected, proc.stderr[-3000:]
    assert exit_status(out) == {"exit_status": 2, "state": "error", "reason": expected}
