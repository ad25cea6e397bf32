"""Bad input fails fast with one clear line (exit status 2), before any expensive work, writing nothing."""

from __future__ import annotations

import importlib.util
import os

import pytest

from conftest import SCRIPTS, run_script


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pretrain = load_script("pretrain_llama")


def one_line_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        args = pretrain.parse_args(argv)
        pretrain.check_block_size(pretrain.load_config(args), args.block_size)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv,message", [
    (["--train_file", "/no/such.jsonl"], "--train_file /no/such.jsonl: no such file"),
    (["--train_file", "{empty}"], "the file is empty"),
    (["--train_file", "{bad_ext}"], "unsupported extension"),
    (["--optim", "sgd_9bit"], "argument --optim: invalid choice: 'sgd_9bit'"),
    (["--model_preset", "huge"], "argument --model_preset: invalid choice: 'huge'"),
    (["--block_size", "4096"], "--block_size 4096 is larger than the model's max_position_embeddings (1024)"),
    (["--mixed_precision", "fp16"], "fp16 mixed precision needs a CUDA GPU"),
    (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size must be >= 1"),
    (["--ddp_timeout", "0"], "--ddp_timeout must be > 0 seconds"),
    (["--resume_from_checkpoint", "/no/such/checkpoint"], "no such folder"),
    (["--model_preset", "tiny", "--config_name", "x"], "give only one of"),
    (["--resume_from_checkpoint", "latest"], "--resume_from_checkpoint latest: no checkpoint under"),
])
def test_bad_flag_gives_one_clear_line(capsys, tmp_path, argv, message):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "data.xml").write_text("<x/>")
    argv = [a.format(empty=tmp_path / "empty.jsonl", bad_ext=tmp_path / "data.xml") for a in argv]
    assert message in one_line_error(capsys, argv + ["--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_used_output_dir_is_not_overwritten(capsys, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    assert "already holds a run" in one_line_error(capsys, ["--output_dir", str(tmp_path)])
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'


def test_too_little_data_is_one_line_too(tmp_path):
    """Too little data for one block (known only once tokenized): one line, before the model is built."""
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text('{"text": "too short"}\n')
    proc = run_script("pretrain_llama.py", "--train_file", str(tiny), "--validation_file", str(tiny),
                      "--tokenizer_vocab_size", "300", "--cache_dir", str(tmp_path / "c"), "--output_dir",
                      str(tmp_path / "o1"), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("error: the train split holds fewer than --block_size=256 tokens;"
                                                    " use more data or a smaller --block_size")


def test_fsdp1_without_gpu_is_refused_not_silently_ddp(capsys, monkeypatch, tmp_path):
    """FSDP2 runs on CPU (tests/test_fsdp.py); FSDP1 would quietly become DDP there: one line."""
    from common.runtime import build_accelerator

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    args = pretrain.parse_args(["--output_dir", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exc:
        build_accelerator(args)
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().startswith("error: FSDP on CPU needs FSDP2")
