"""Adversarial inputs and faults a new user meets: caches killed or starved mid-write, a base model edited in the
middle, truncated weight files, misused tools, a quiet default start (docs/tests.md lists the probes)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest

from conftest import ROOT, run_script

from common.inputs.cache import MANIFEST, cached_folder, entry_problem


def forked(function) -> int:
    """Run `function()` in a forked child; its exit status (the negative signal number when killed)."""
    pid = os.fork()
    if pid == 0:
        try:
            function()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


# ---- caches: written whole or not at all ------------------------------------------------------------------------
def tokenizer_args(tmp_path) -> argparse.Namespace:
    return argparse.Namespace(tokenizer_name=None, model_name_or_path=None, cache_dir=str(tmp_path / "cache"),
                              text_column="text")


def tiny_raw():
    from datasets import Dataset, DatasetDict

    words = "the model reads tokens and learns to predict the next one".split()
    rows = [" ".join(words[i % 7:] + words[:i % 5]) for i in range(200)]
    return DatasetDict(train=Dataset.from_dict({"text": rows}))


def test_a_tokenizer_cache_killed_while_written_is_rebuilt_whole(tmp_path, monkeypatch):
    """SIGKILL while tokenizer.json is being written (half of it on disk): the old cache kept the half file under its
    final name and every later run on the data stopped with a JSONDecodeError. Now the next run gets a tokenizer
    identical to one trained without the kill."""
    from common.inputs import data

    args, raw = tokenizer_args(tmp_path), tiny_raw()
    no_accelerator = types.SimpleNamespace(main_process_first=contextlib.nullcontext)
    train = data.train_bpe_tokenizer

    def killed_while_saving(texts, vocab_size):
        tokenizer = train(texts, vocab_size)

        def save_pretrained(path):
            tokenizer.__class__.save_pretrained(tokenizer, path)
            written = os.path.join(path, "tokenizer.json")
            os.truncate(written, os.path.getsize(written) // 2)
            os.kill(os.getpid(), signal.SIGKILL)

        tokenizer.save_pretrained = save_pretrained
        return tokenizer

    def run_killed():
        monkeypatch.setattr(data, "train_bpe_tokenizer", killed_while_saving)
        data.get_tokenizer(args, no_accelerator, raw, None, vocab_size=300)

    assert forked(run_killed) == -signal.SIGKILL
    tokenizer = data.get_tokenizer(args, no_accelerator, raw, None, vocab_size=300)
    fresh = train((r for r in raw["train"]["text"]), 300)
    assert tokenizer.get_vocab() == fresh.get_vocab() and len(tokenizer) == len(fresh)
    assert [name for name in os.listdir(args.cache_dir) if ".tmp-" in name] == []


def test_a_damaged_cache_entry_is_rebuilt_and_said_in_one_line(tmp_path, caplog):
    """A cache entry damaged after it was written (a file cut short) or left by a version without a manifest is set
    aside and rebuilt, with one log line naming it; never read as it is."""
    path, builds = str(tmp_path / "entry"), []

    def build(folder):
        builds.append(folder)
        with open(os.path.join(folder, "rows.jsonl"), "w") as f:
            f.write("".join(json.dumps({"i": i}) + "\n" for i in range(1000)))

    cached_folder(path, build, "rows", "rows 0-999")
    assert cached_folder(path, build, "rows", "rows 0-999") == path and len(builds) == 1  # a whole entry is reused
    for damage in ("cut", "no manifest"):
        if damage == "cut":
            os.truncate(os.path.join(path, "rows.jsonl"), 100)
        else:
            os.remove(os.path.join(path, MANIFEST))
        caplog.clear()
        cached_folder(path, build, "rows", "rows 0-999")
        assert entry_problem(path, "rows 0-999") is None and len(builds) == 2 + (damage != "cut")
        said = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith(f"cache entry {path} is damaged"), said


def test_an_entry_under_another_key_is_rebuilt_and_said_in_one_line(tmp_path, caplog):
    """A cache entry's folder is named by a hash of its key, and folders get moved and copied: an entry of other data
    (or of another row count) under this key's name was read as this key's, its manifest whole. The manifest records
    the key and the rows: such an entry is set aside and rebuilt with one log line, as a damaged one is."""
    builds = []

    def build_for(text):
        def build(folder):
            builds.append(text)
            with open(os.path.join(folder, "rows.jsonl"), "w") as f:
                f.write(text)
        return build

    other, path = str(tmp_path / "other"), str(tmp_path / "entry")
    cached_folder(other, build_for("other data\n"), "rows", "key of other data", rows=1)
    for key, rows in (("key of this data", 1), ("key of other data", 2)):
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(other, path)  # an entry whole, but not of this key
        caplog.clear()
        cached_folder(path, build_for("this data\n"), "rows", key, rows)
        with open(os.path.join(path, "rows.jsonl")) as f:
            assert f.read() == "this data\n" and entry_problem(path, key, rows) is None
        said = [r.getMessage() for r in caplog.records if "rebuilding" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith(f"cache entry {path} is damaged (its cache.json records "), said
    assert builds == ["other data\n", "this data\n", "this data\n"]


def test_two_runs_building_one_entry_both_end_with_a_whole_one(tmp_path):
    """Two processes build the same entry at once, each writing its own content slowly: both return, and the entry is
    wholly one of the two builds (the old caches wrote one shared `.tmp` name: interleaved writes)."""
    path = str(tmp_path / "entry")

    def build(folder):
        with open(os.path.join(folder, "data.txt"), "w") as f:
            for _ in range(20):
                f.write(f"{os.getpid()}\n" * 100)
                f.flush()
                time.sleep(0.005)

    def run():
        with open(os.path.join(cached_folder(path, build, "data", "data"), "data.txt")) as f:
            os._exit(0 if len(set(f.read().split())) == 1 else 1)

    pids = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:
            try:
                run()
            finally:
                os._exit(3)
        pids.append(pid)
    assert [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids] == [0, 0]
    assert entry_problem(path, "data") is None and os.listdir(tmp_path) == ["entry"]


def test_a_full_disk_under_the_cache_is_one_line_and_leaves_nothing(tmp_path, capsys):
    """ENOSPC while an entry is written: one `error:` line naming the cache entry, no entry, no temporary folder."""
    path = str(tmp_path / "entry")

    def build(folder):
        with open(os.path.join(folder, "data.txt"), "w") as f:
            f.write("x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(SystemExit) as stopped:
        cached_folder(path, build, "the default corpus", "corpus")
    lines = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and lines == [
        f"error: the default corpus could not be written to the cache ({path}): No space left on device; free some "
        "space or choose another --cache_dir"]
    assert os.listdir(tmp_path) == []


def test_a_full_disk_under_the_rust_tokenizers_write_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """The tokenizers library writes tokenizer.json itself and reports a full disk as a bare `Exception: No space left
    on device (os error 28)` (not an OSError): it was a traceback. A real one here: tokenizer.json is /dev/full."""
    from common.inputs import data

    args, raw = tokenizer_args(tmp_path), tiny_raw()
    no_accelerator = types.SimpleNamespace(main_process_first=contextlib.nullcontext)
    train = data.train_bpe_tokenizer

    def saved_to_a_full_disk(texts, vocab_size):
        tokenizer = train(texts, vocab_size)
        save_pretrained = tokenizer.save_pretrained

        def save(path):
            os.symlink("/dev/full", os.path.join(path, "tokenizer.json"))  # every write: ENOSPC
            return save_pretrained(path)

        tokenizer.save_pretrained = save
        return tokenizer

    monkeypatch.setattr(data, "train_bpe_tokenizer", saved_to_a_full_disk)
    with pytest.raises(SystemExit) as stopped:
        data.get_tokenizer(args, no_accelerator, raw, None, vocab_size=300)
    lines = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and [line for line in lines if "Traceback" in line or "error" in line] == lines[-1:]
    assert re.fullmatch(rf"error: a byte-level BPE tokenizer \(vocab 300\) could not be written to the cache "
                        rf"\({re.escape(args.cache_dir)}/tokenizer-bpe-[0-9a-f]{{12}}\): No space left on device; "
                        "free some space or choose another --cache_dir", lines[-1]), lines
    assert os.listdir(args.cache_dir) == []  # no entry, no temporary folder


# ---- the folder lock: a full disk is one line; a run that changed nothing leaves the lock file as it found it --------
LOCK_AND_THEN = """
import sys
sys.path.insert(0, sys.argv[1])
from common.errors import fail
from common.features.folder_lock import lock_output_dir
lock_output_dir(sys.argv[2])
if sys.argv[3] == "bad input":
    fail("bad input")
open(sys.argv[2] + "/metrics.jsonl", "a").close()
"""


def lock_and_then(output_dir, then: str, wrap: list[str] = ()):
    return subprocess.run([*wrap, sys.executable, "-c", LOCK_AND_THEN, ROOT, str(output_dir), then],
                          capture_output=True, text=True, timeout=120)


def test_a_full_disk_at_the_folder_lock_is_one_line_and_leaves_nothing(tmp_path):
    """A real full disk (a 64 KiB tmpfs, filled): the lock's first write was an `OSError: [Errno 28]` traceback."""
    if subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True).returncode:
        pytest.skip("unprivileged user namespaces are off: no tmpfs to fill")
    disk = tmp_path / "disk"
    disk.mkdir()
    fill_run_list = ('mount -t tmpfs -o size=64k tmpfs "$0" && (dd if=/dev/zero of="$0/fill" bs=4k 2>/dev/null; '
                     '"$@"; rc=$?; ls -A "$0"; exit $rc)')
    proc = lock_and_then(disk / "out", "write", ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                                                 fill_run_list, str(disk)])
    assert proc.returncode == 2 and proc.stderr == (
        f"error: --output_dir {disk}/out: its lock file {disk}/out/.lock could not be written (No space left on "
        "device); nothing in the folder was changed: free some space, then rerun\n"), proc.stderr
    assert proc.stdout.split() == ["fill"]  # the folder the run created is gone again


def test_a_run_that_changes_nothing_leaves_the_lock_file_as_it_found_it(tmp_path):
    """A run stopped by bad input once it held the lock (a failed --overwrite_output_dir, say) wrote its pid over the
    previous run's: the file is given back; a run that writes in the folder is named by it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"weights")
    (out / ".lock").write_text("pid 12345 on the-previous-host\n")
    proc = lock_and_then(out, "bad input")
    assert proc.returncode == 2 and proc.stderr == "error: bad input\n"
    assert (out / ".lock").read_text() == "pid 12345 on the-previous-host\n"
    assert lock_and_then(out, "write").returncode == 0
    assert re.fullmatch(r"pid \d+ on .+\n", (out / ".lock").read_text()) and "12345" not in (out / ".lock").read_text()
    assert lock_and_then(tmp_path / "new", "bad input").returncode == 2 and not (tmp_path / "new").exists()


def test_a_full_disk_under_metrics_jsonl_is_one_line(corpus, tmp_path):
    """A real full disk (a 12 KiB tmpfs: the lock file, exit_status.json's reserved room and one page of rows) when a
    row is appended: that was the metrics writer's traceback. Now one line naming the file, status 2 (no checkpoint:
    the line says to start over), and exit_status.json says so: it was missing (no room left for it)."""
    if subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True).returncode:
        pytest.skip("unprivileged user namespaces are off: no tmpfs to fill")
    out, copy = tmp_path / "out", tmp_path / "copy"
    out.mkdir()
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "pretrain_llama.py"), "--train_file", corpus["train"],
           "--validation_file", corpus["validation"], "--tokenizer_vocab_size", "300", "--block_size", "64",
           "--per_device_train_batch_size", "4", "--max_steps", "60", "--logging_steps", "1",
           "--sample_max_new_tokens", "0", "--cache_dir", str(tmp_path / "cache"), "--output_dir", str(out)]
    mount_run_copy = 'mount -t tmpfs -o size=12k tmpfs "$0" && "$@"; rc=$?; cp -a "$0" "$COPY"; exit $rc'
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount_run_copy, str(out),
                           *cmd], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COPY": str(copy)})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = (f"error: disk full: {out}/metrics.jsonl could not be written (filesystem {out}, 0 MiB free): free some "
            "space, then rerun with --overwrite_output_dir (there is no checkpoint to resume)")
    assert proc.stderr.strip().splitlines()[-1] == line
    record = json.loads((copy / "exit_status.json").read_text())
    assert (record["exit_status"], record["state"], record["reason"]) == (2, "error", line)
    assert sorted(os.listdir(copy)) == [".lock", "exit_status.json", "metrics.jsonl"]  # the room became the record


def test_a_full_disk_under_tensorboard_is_one_line_naming_its_file(tmp_path, capfd):
    """TensorBoard writes its events in a thread, which printed its own 12-line traceback beside the run's line, and
    the line named the output folder. A disk that refuses the event file's growth (the file-size limit, as a full
    disk at its last page): one line naming the event file, nothing else on stderr."""
    import resource

    from torch.utils.tensorboard import SummaryWriter

    from common.checkpoint import CheckpointExtras
    from common.features.disk import mount_point, stop_on_full_disk

    def train() -> int:
        writer = SummaryWriter(str(tmp_path / "logs"))
        for step in range(100_000):
            writer.add_scalar("loss", 1.0, step)
            writer.flush()
        return 0

    def log_until_refused():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))
        try:
            stop_on_full_disk(train, str(tmp_path), CheckpointExtras())()
        except SystemExit as stop:
            sys.stderr.flush()
            os._exit(stop.code)

    capfd.readouterr()
    assert forked(log_until_refused) == 2
    err = capfd.readouterr().err
    events = [os.path.join(d, f) for d, _, names in os.walk(tmp_path / "logs") for f in names]
    assert len(events) == 1 and os.path.basename(events[0]).startswith("events.out.tfevents.")
    assert re.fullmatch(re.escape(f"error: disk full: {events[0]} could not be written (filesystem "
                                  f"{mount_point(str(tmp_path))}, ") + r"\d+" + re.escape(
        " MiB free): free some space, then rerun with --overwrite_output_dir (there is no checkpoint to resume)\n"),
        err), err


def test_a_metrics_row_the_disk_takes_only_in_part_is_not_written_at_all(tmp_path):
    """A write the disk takes only in part, then refuses (here the file-size limit, which does what a full disk does
    at its last free page): the row was left half written (4,096 bytes, no newline) until a resume trimmed it, and
    readers tailing metrics.jsonl broke on it. Now the file holds whole rows only and the write's own error goes up
    (the full-disk line: test_a_full_disk_under_metrics_jsonl_is_one_line)."""
    import resource

    from common.metrics import MetricsWriter

    def write_until_refused():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails (EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))
        writer = MetricsWriter(str(tmp_path), enabled=True)
        try:
            for step in range(100, 200):
                writer.write({"step": step, "note": "x" * 900})
        except OSError as e:
            os._exit(100 + (e.errno == errno.EFBIG))

    assert forked(write_until_refused) == 101
    text = (tmp_path / "metrics.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines()]
    assert text.endswith("\n") and [row["step"] for row in rows] == list(range(100, 100 + len(rows)))
    assert len(text) + len(text) // len(rows) > 10_000  # every row that fitted whole is there


# ---- a model folder that cannot load: one line before any data is read --------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A saved tiny Llama with its tokenizer (4.6 MB of weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.inputs.data import train_bpe_tokenizer
    from common.inputs.modeling import LLAMA_PRESETS

    path = str(tmp_path_factory.mktemp("tiny_model"))
    tokenizer = train_bpe_tokenizer(["the model reads tokens and learns"] * 50, 300)
    LlamaForCausalLM(LlamaConfig(**{**LLAMA_PRESETS["tiny"], "vocab_size": 512})).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def broken_copy(source: str, target, damage: str) -> str:
    import shutil

    shutil.copytree(source, target)
    if damage == "cut":
        weights = os.path.join(target, "model.safetensors")
        os.truncate(weights, os.path.getsize(weights) - 1000)
    elif damage == "no weights":
        os.remove(os.path.join(target, "model.safetensors"))
    else:
        for name in os.listdir(target):
            if name.startswith("tokenizer") or name in ("vocab.json", "merges.txt", "special_tokens_map.json"):
                os.remove(os.path.join(target, name))
    return str(target)


@pytest.mark.parametrize("damage", ["cut", "no weights", "no tokenizer"])
@pytest.mark.parametrize("script", ["pretrain_llama.py", "finetune_causal_lm.py", "finetune_classifier.py"])
def test_a_model_folder_that_cannot_load_is_one_line_before_the_data(script, damage, tiny_model, corpus, tmp_path):
    """A truncated model.safetensors gave a SafetensorError traceback, a folder without weights an OSError one, a
    folder without tokenizer files "Couldn't instantiate the backend tokenizer": all after the data was loaded and
    tokenized. Now one line names the file or folder, and no data was read (the output folder was never created)."""
    model = broken_copy(tiny_model, tmp_path / "model", damage)
    out = tmp_path / "out"
    proc = run_script(script, "--model_name_or_path", model, "--train_file", corpus["train"], "--validation_file",
                      corpus["validation"], "--output_dir", str(out), "--cache_dir", str(tmp_path / "cache"),
                      check=False)
    lines = proc.stderr.strip().splitlines()
    expected = f"error: --model_name_or_path {model}: " + {
        "cut": f"{model}/model.safetensors is cut short (4,",
        "no weights": "the folder holds a config but no weights (no *.safetensors or pytorch_model*.bin); copy or "
                      "download the model's weight files there",
        "no tokenizer": "the folder holds no tokenizer (none of tokenizer.json"}[damage]
    assert proc.returncode == 2 and lines[-1].startswith(expected), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not out.exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "config.json"])
def test_a_json_file_of_the_model_folder_cut_short_is_named(tiny_model, tmp_path, capsys, name):
    """tokenizer.json cut in half: transformers' error ("Unterminated string starting at: line ...") named no file."""
    import shutil

    from transformers import AutoConfig, AutoTokenizer

    from common.inputs import from_pretrained_or_fail

    model = str(tmp_path / "model")
    shutil.copytree(tiny_model, model)
    path = os.path.join(model, name)
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(json.JSONDecodeError) as raw:  # what the run met before
        json.loads(open(path).read())
    load = AutoConfig.from_pretrained if name == "config.json" else AutoTokenizer.from_pretrained
    with pytest.raises(SystemExit) as stopped:
        from_pretrained_or_fail(load, model, "--model_name_or_path")
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"error: --model_name_or_path {model}: {path} is not valid JSON ({raw.value})\n"


def test_a_data_error_in_an_existing_output_dir_leaves_no_lock(corpus, tmp_path):
    """An output folder that holds a file already, and a data file with a row lacking its text: the run stops with
    one line and the folder holds what it held (the lock file used to stay: the folder was not empty)."""
    out, data = tmp_path / "out", tmp_path / "rows.jsonl"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    data.write_text((json.dumps({"body": "no text column"}) + "\n") * 10)
    proc = run_script("pretrain_llama.py", "--train_file", str(data), "--output_dir", str(out), "--cache_dir",
                      str(tmp_path / "cache"), check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: no column 'text'")
    assert os.listdir(out) == ["notes.txt"]


def test_the_base_fingerprint_tells_a_base_edited_in_the_middle(tiny_model, tmp_path):
    """One byte changed in the middle of model.safetensors (same size, same header, same first and last MiB): the
    fingerprint of the first and last MiB let a LoRA resume onto it pass with exit 0. The whole-file checksum tells
    it; a copy elsewhere still matches, and a checkpoint that holds only the old fingerprint is compared by it."""
    import shutil

    from common.features.resume_guard import _differs, base_model_fingerprint

    copy, edited = str(tmp_path / "copy"), str(tmp_path / "edited")
    shutil.copytree(tiny_model, copy)
    shutil.copytree(tiny_model, edited)
    weights = os.path.join(edited, "model.safetensors")
    with open(weights, "r+b") as f:
        f.seek(os.path.getsize(weights) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    original, moved, changed = (base_model_fingerprint(p, None) for p in (tiny_model, copy, edited))
    assert original["weights"] == changed["weights"]  # what the old fingerprint saw: nothing
    assert _differs("base_model", original, changed, False) and not _differs("base_model", original, moved, False)
    old_record = {k: v for k, v in original.items() if k != "weights_xxh3_64"}
    assert not _differs("base_model", old_record, moved, False)


def test_a_base_saved_again_is_refused_naming_the_file_that_differs(tiny_model, tmp_path):
    """The same weights saved again (equal tensors, other bytes: here a metadata entry) are refused, as a byte-for-byte
    check must: the line said "whose weights differ", which read as wrong numbers. It names the file and how."""
    import torch
    from safetensors.torch import load_file, save_file

    from common.features.resume_guard import _difference, _differs, base_model_fingerprint

    resaved = tmp_path / "resaved"
    resaved.mkdir()
    for name in os.listdir(tiny_model):
        if name != "model.safetensors":
            (resaved / name).write_bytes(open(os.path.join(tiny_model, name), "rb").read())
    tensors = load_file(os.path.join(tiny_model, "model.safetensors"))
    save_file(tensors, resaved / "model.safetensors", metadata={"format": "pt", "saved_by": "another tool"})
    assert all(torch.equal(tensors[k], v) for k, v in load_file(resaved / "model.safetensors").items())
    saved, current = base_model_fingerprint(tiny_model, None), base_model_fingerprint(str(resaved), None)
    old_size, new_size = (os.path.getsize(os.path.join(p, "model.safetensors")) for p in (tiny_model, resaved))
    assert _differs("base_model", saved, current, False) and old_size != new_size
    assert _difference("base_model", saved, current, "ckpt") == (
        f"the checkpoint was trained from --model_name_or_path {tiny_model}, this run from --model_name_or_path "
        f"{resaved}, whose weight files differ byte for byte (model.safetensors has {new_size:,} bytes, not "
        f"{old_size:,}; the same weights saved again differ too); resume with the checkpoint's base model")
    os.rename(resaved / "model.safetensors", resaved / "model-00001-of-00001.safetensors")
    renamed = base_model_fingerprint(str(resaved), None)
    assert "(model-00001-of-00001.safetensors is not in the checkpoint's base; model.safetensors is missing;" in \
        _difference("base_model", saved, renamed, "ckpt")


# ---- the tools: each misuse is one line -------------------------------------------------------------------------
def stopped_with(capsys, run) -> str:
    """The one line `run()` stops with (exit status 2, the last line on stderr, no other error line)."""
    with pytest.raises(SystemExit) as stopped:
        run()
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert stopped.value.code == 2 and len(errors) == 1 and err[-1] == errors[0], err
    return errors[0]


def test_copy_recipe_misuse_is_one_line_and_never_strips_the_recipe(tmp_path, monkeypatch, capsys):
    """The destination equal to the recipe stripped the recipe in place (exit 0); a missing recipe, an unwritable
    destination and a non-Python file gave tracebacks."""
    from tools import copy_recipe

    recipe = tmp_path / "pretrain.py"
    original = open(os.path.join(ROOT, "scripts", "pretrain_llama.py"), encoding="utf-8").read()
    recipe.write_text(original, encoding="utf-8")
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "a"}\n')
    cases = {(str(recipe), str(recipe)): "is the recipe itself",
             (str(recipe), str(tmp_path / "." / "pretrain.py")): "is the recipe itself",
             (str(tmp_path / "missing.py"), str(tmp_path / "copy.py")): "no such file",
             (str(recipe), str(recipe / "copy.py")): "cannot write the copy",
             (str(data), str(tmp_path / "copy.py")): "not a Python file"}
    for (source, destination), said in cases.items():
        monkeypatch.setattr(sys, "argv", ["copy_recipe.py", source, destination])
        assert said in stopped_with(capsys, copy_recipe.main)
        assert recipe.read_text(encoding="utf-8") == original
    assert sorted(os.listdir(tmp_path)) == ["pretrain.py", "rows.jsonl"]


def test_estimate_memory_misuse_is_one_line_and_offload_is_bounded_by_host_memory(capsys):
    """--host_memory_gb -1 and --vocab_size 0 were accepted, --activation_modes with --params silently dropped its
    table, and the offload row's longest sequence ignored the host RAM that holds its activations."""
    from tools import estimate_memory as em

    for flags, said in ((["--model_preset", "1b", "--host_memory_gb", "-1"], "--host_memory_gb must be > 0"),
                        (["--model_preset", "1b", "--vocab_size", "0"], "--vocab_size must be >= 1"),
                        (["--params", "7e9", "--activation_modes"], "--activation_modes needs the model's layers")):
        assert said in stopped_with(capsys, lambda: em.parse_args(flags))

    def offload_tokens(*host: str) -> int:
        table = em.report(em.parse_args(["--model_preset", "1b", "--use_peft", "--activation_modes", *host]))
        row = next(line for line in table.splitlines() if line.startswith("| offload |"))
        return int(row.split("|")[-2].split()[0].replace(",", ""))

    args = em.parse_args(["--model_preset", "1b"])
    host_bytes_per_token = em.per_token_layer_bytes(em.model_shape(args), "full") * em.model_shape(args).layers
    unbounded, eight_gb = offload_tokens(), offload_tokens("--host_memory_gb", "2")
    assert eight_gb * host_bytes_per_token <= 0.9 * 2 * em.GB < (eight_gb + 1024) * host_bytes_per_token
    assert eight_gb < unbounded


def test_a_full_disk_during_the_merged_export_is_one_line_and_leaves_no_part_of_it(tiny_model, tmp_path,
                                                                                    monkeypatch, capsys):
    """--merge_adapter on a disk that fills while the merged weights are written (ENOSPC after half of them): the
    merged export wrote straight into merged/, left config.json there without weights and ended in a SafetensorError
    traceback. Now: one line naming output_dir/merged, no merged/ and no partial folder, the adapter export intact."""
    from accelerate import PartialState
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, modeling_utils

    from common.features.disk import explain_full_disk
    from common.features.lora import export_merged_model

    PartialState(cpu=True)  # one process: broadcast_object_list returns its input
    out = tmp_path / "out"
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(out)
    adapter = sorted(os.listdir(out))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    save_file = modeling_utils.safe_save_file

    def disk_fills(tensors, filename, metadata=None):
        save_file(tensors, filename, metadata=metadata)
        os.truncate(filename, os.path.getsize(filename) // 2)
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(modeling_utils, "safe_save_file", disk_fills)
    accelerator = types.SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None)
    merge = explain_full_disk(export_merged_model)
    line = stopped_with(capsys, lambda: merge(accelerator, tokenizer, str(out), AutoModelForCausalLM, tiny_model))
    assert line.startswith(f"error: disk full: the model could not be exported to {out / 'merged'} (filesystem ")
    assert line.endswith("nothing of it was left): free some space, then rerun with --overwrite_output_dir (there is "
                         "no checkpoint to resume)")
    assert sorted(os.listdir(out)) == adapter


def test_the_default_start_prints_no_warning(corpus, tmp_path):
    """A run without flags beyond its data printed bitsandbytes' "Failed to load CPU gemm_4bit_forward from
    kernels-community" (peft, imported by transformers' get_scheduler, imports bitsandbytes): a warning about 4-bit
    kernels in a run with none. Its own process (the tests' fork server has imported bitsandbytes already)."""
    proc = run_script("pretrain_llama.py", "--train_file", corpus["train"], "--validation_file", corpus["validation"],
                      "--tokenizer_vocab_size", "300", "--block_size", "32", "--max_steps", "1", "--max_eval_samples",
                      "4", "--sample_max_new_tokens", "0", "--output_dir", str(tmp_path / "out"), "--cache_dir",
                      str(tmp_path / "cache"), env={})
    warnings = [line for line in proc.stderr.splitlines() + proc.stdout.splitlines() if "warn" in line.lower()]
    assert warnings == [], warnings


def test_a_sharded_model_is_checked_through_its_index(tiny_model, tmp_path, capsys):
    """Each shard the index names must exist and hold what its header describes: a shard cut short or missing is
    one line naming it."""
    from transformers import AutoModelForCausalLM

    from common.inputs.modeling import check_model_folder

    folder = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_model).save_pretrained(folder, max_shard_size="2MB")
    for name in os.listdir(tiny_model):
        if name.startswith("tokenizer"):
            os.link(os.path.join(tiny_model, name), folder / name)
    args = argparse.Namespace(model_name_or_path=str(folder), tokenizer_name=None)
    check_model_folder(args)  # whole: passes
    shards = sorted(name for name in os.listdir(folder) if name.endswith(".safetensors"))
    assert len(shards) > 1
    os.truncate(folder / shards[-1], 100)
    assert f"{folder / shards[-1]} is cut short" in stopped_with(capsys, lambda: check_model_folder(args))
    os.remove(folder / shards[-1])
    assert f"{shards[-1]}, named by {folder}/model.safetensors.index.json, is missing" in stopped_with(
        capsys, lambda: check_model_folder(args))
