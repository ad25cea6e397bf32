"""Bad input fails fast with one clear line (exit status 2), before any expensive work, writing nothing."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from common.paths import EXIT_STATUS_FILE
from conftest import ROOT, SCRIPTS, run_script


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pretrain = load_script("pretrain_llama")


def one_line_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        args = pretrain.parse_args(argv)  # what main() does before any heavy work
        pretrain.find_checkpoint_to_resume(args.output_dir, args.resume_from_checkpoint)
        pretrain.check_block_size(pretrain.load_config(args), args.block_size)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv,message", [
    (["--train_file", "/no/such.jsonl"], "--train_file /no/such.jsonl: no such file"),
    (["--train_file", "{tmp}"], "--train_file {tmp}: is a folder; pass a file (for a folder of files use "
                                "--dataset_name {tmp})"),
    (["--validation_split_percentage", "100"], "--validation_split_percentage must be between 0 and 99 (got 100)"),
    (["--warmup_steps", "50", "--max_steps", "20"], "--warmup_steps 50 is more than the run's --max_steps 20"),
    (["--train_file", "{empty}"], "the file is empty"),
    (["--train_file", "{bad_ext}"], "unsupported extension"),
    (["--optim", "sgd_9bit"], "argument --optim: invalid choice: 'sgd_9bit'"),
    (["--optim", "muon", "--muon_momentum", "1.5"], "--muon_momentum must be in [0, 1) (got 1.5)"),
    (["--lr_scheduler_type", "warmup_stable_decay", "--lr_decay_ratio", "0"], "--lr_decay_ratio must be in (0, 1]"),
    (["--model_preset", "huge"], "argument --model_preset: invalid choice: 'huge'"),
    (["--block_size", "4096"], "--block_size 4096 is larger than the model's max_position_embeddings (1024)"),
    (["--mixed_precision", "fp16"], "fp16 mixed precision needs a CUDA GPU"),
    (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size must be >= 1"),
    (["--ddp_timeout", "0"], "--ddp_timeout must be > 0 seconds"),
    (["--resume_from_checkpoint", "/no/such/checkpoint"], "no such folder"),
    (["--model_preset", "tiny", "--config_name", "x"], "give only one of"),
    (["--resume_from_checkpoint", "latest"], "--resume_from_checkpoint latest: no checkpoint under"),
    (["--resume_from_checkpoint", "{tmp}"], "--resume_from_checkpoint {tmp}: not a checkpoint (it holds no run.json)"),
    (["--train_file", "{jsonl}", "--validation_file", "{csv}"],
     "--train_file {jsonl} and --validation_file {csv} must have the same format (json vs csv)"),
    (["--model_name_or_path", "{tmp}/no-model"], "--model_name_or_path {tmp}/no-model: no such folder"),
    (["--tokenizer_name", "./no-such-tokenizer"], "--tokenizer_name ./no-such-tokenizer: no such folder"),
    (["--model_name_or_path", "{broken}"], "--model_name_or_path {broken}: {broken}/config.json is not valid JSON "
                                            "(Expecting property name enclosed in double quotes: line 1 column 25"),
])
def test_bad_flag_gives_one_clear_line(capsys, tmp_path, argv, message):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "data.xml").write_text("<x/>")
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "rows.csv").write_text("text\na\n")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "llama", }')
    names = dict(empty=tmp_path / "empty.jsonl", bad_ext=tmp_path / "data.xml", tmp=tmp_path,
                 jsonl=tmp_path / "rows.jsonl", csv=tmp_path / "rows.csv", broken=tmp_path / "broken")
    argv = [a.format(**names) for a in argv]
    assert message.format(**names) in one_line_error(capsys, argv + ["--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_unwritable_output_dir_is_one_line(capsys, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    err = one_line_error(capsys, ["--output_dir", str(tmp_path / "file" / "out")])
    assert err == (f"error: --output_dir {tmp_path}/file/out: cannot write there ({tmp_path}/file is not a writable "
                   "folder)")


@pytest.mark.parametrize("name,content,problem", [
    ("latin1.txt", b"first line\ncaf\xe9 au lait\n", "line 2 is not UTF-8 text (byte 0xe9 at column 4)"),
    ("rows.jsonl", b'{"text": "a"}\n{"text": "b"\n{"text": "c"}\n',
     "line 2 is not valid JSON (Expecting ',' delimiter at column 13)"),
    ("rows.parquet", b"PAR1 not really parquet", "not a readable parquet file (Parquet magic bytes not found"),
])
def test_unreadable_data_names_the_file_and_line(capsys, tmp_path, name, content, problem):
    """datasets stops with a traceback naming neither the file nor the row; the scripts name both, in one line."""
    from common.inputs.data import HeldOut, load_raw_datasets
    from common.inputs.mixture import read_sources

    good = tmp_path / ("good" + os.path.splitext(name)[1])
    if name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": ["a", "b"]}), good)
    else:
        good.write_text('{"text": "a"}\n' if name.endswith(".jsonl") else "a\n")
    bad = tmp_path / name
    bad.write_bytes(content)
    args = pretrain.parse_args(["--train_file", str(good), "--validation_file", str(bad), "--output_dir",
                                str(tmp_path / "out"), "--cache_dir", str(tmp_path / "cache")])
    with pytest.raises(SystemExit) as exc:
        load_raw_datasets(read_sources(args)[0], HeldOut.from_flags(args), args.cache_dir)  # as the recipe reads it
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()  # datasets' progress bars come first
    assert err[-1].startswith(f"error: --validation_file {bad}: {problem}"), err
    assert sum(line.startswith("error:") for line in err) == 1


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


def test_warmup_longer_than_an_epoch_based_run_is_one_line(tmp_path, corpus):
    """The run's length from --num_train_epochs is known only once the data is counted: refused then, untrained."""
    proc = run_script("pretrain_llama.py", "--train_file", corpus["train"], "--validation_file", corpus["validation"],
                      "--tokenizer_vocab_size", "300", "--block_size", "64", "--per_device_train_batch_size", "32",
                      "--warmup_steps", "1000", "--cache_dir", str(tmp_path / "c"), "--output_dir",
                      str(tmp_path / "o"), check=False)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --warmup_steps 1000 is more than the run's ") and last.endswith(
        " optimizer steps: the learning rate would never reach --learning_rate"), last
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_fsdp1_without_gpu_is_refused_not_silently_ddp(capsys, monkeypatch, tmp_path):
    """FSDP2 runs on CPU (tests/test_fsdp.py); FSDP1 would quietly become DDP there: one line."""
    from common.features.fsdp_on_cpu import use_fsdp2_on_cpu
    from common.runtime import build_accelerator

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    args = pretrain.parse_args(["--output_dir", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exc:
        use_fsdp2_on_cpu(build_accelerator(args))
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().startswith("error: FSDP on CPU needs FSDP2")


@pytest.mark.parametrize("num_processes, quiet", [(1, False), (1, True), (2, False)])
def test_under_accelerate_launch_the_line_is_printed_once(tmp_path, num_processes, quiet):
    """The README's `accelerate launch`: one process meets a bad flag before the process group exists, two processes
    a bad row once it does. Each prints the line once (not once per process). The launcher then adds its own report
    and exits with status 1 whatever the script's status (accelerate 1.15), except with `--quiet` on one process, where
    the line is the last one printed; after a multi-process run the report names the line as the root cause."""
    config = "cpu_2proc.yaml" if num_processes == 2 else "cpu_1proc.yaml"
    launch = [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", *(["--quiet"] if quiet else []),
              "--config_file", os.path.join(ROOT, "accelerate_configs", config), "--num_processes", str(num_processes),
              "--main_process_port", "0"]
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "a"}\n{"text": "b"\n')
    bad = (["--per_device_train_batch_size", "0"] if num_processes == 1 else
           ["--train_file", str(rows), "--validation_file", str(rows), "--cache_dir", str(tmp_path / "cache")])
    expected = ("error: --per_device_train_batch_size must be >= 1 (got 0)" if num_processes == 1 else
                f"error: --train_file {rows}: line 2 is not valid JSON (Expecting ',' delimiter at column 13)")
    proc = run_script("pretrain_llama.py", *bad, "--output_dir", str(tmp_path / "out"), launcher=launch, check=False)
    lines = proc.stderr.splitlines()
    assert [line for line in lines if line.startswith("error:")] == [expected], proc.stderr[-3000:]
    assert proc.returncode == 1 and not (tmp_path / "out" / "metrics.jsonl").exists()
    if quiet:
        assert lines[-1] == expected and proc.stdout.strip() == "", proc.stderr[-3000:]
    if num_processes == 2:
        root_cause = proc.stderr[proc.stderr.index("Root Cause"):]
        assert f"traceback : {expected}" in root_cause


def test_the_quick_start_command_opens_with_the_run_not_launcher_notices(tmp_path):
    """The README's first command, as written (a bad flag stops it right after the launch): all it prints is the run's
    own line. Without its --config_file accelerate opens with a five-line notice of the values it picked."""
    import re
    import subprocess

    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    command = re.search(r"&& \.venv/bin/(accelerate launch [^\n]*scripts/pretrain_llama\.py)\n", readme).group(1)
    launch = [os.path.join(os.path.dirname(sys.executable), "accelerate"), *command.split()[1:]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env["HF_HOME"] = str(tmp_path / "hf")  # no `accelerate config` default file of this machine's user
    bad = ["--block_size", "1", "--output_dir", str(tmp_path / "out")]
    without_config = [arg for arg in launch if arg not in ("--config_file", "accelerate_configs/default.yaml")]
    for cmd, notice in ((launch, False), (without_config, True)):
        proc = subprocess.run(cmd + bad, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 1 and proc.stdout == ""  # accelerate 1.15's status after a script's failure
        assert ("The following values were not passed to `accelerate launch`" in proc.stderr) == notice, proc.stderr
        if not notice:
            assert proc.stderr == "error: --block_size must be >= 2 (got 1)\n"
    assert not (tmp_path / "out").exists()


def test_the_checks_only_check(tmp_path):
    """Validation reads the flags and the environment and changes neither: `auto` stays `auto` in `args`; the
    checkpoint it names is found by `find_checkpoint_to_resume`, whose result the script keeps on its own."""
    from common.flags import check_common_flags

    args = pretrain.parse_args(["--resume_from_checkpoint", "auto", "--output_dir", str(tmp_path / "out")])
    flags, environment = dict(vars(args)), dict(os.environ)
    check_common_flags(args)
    assert vars(args) == flags and args.resume_from_checkpoint == "auto"
    assert dict(os.environ) == environment
    assert pretrain.find_checkpoint_to_resume(args.output_dir, args.resume_from_checkpoint) is None  # a fresh start


SMALL_RUN = ["--tokenizer_vocab_size", "300", "--block_size", "64", "--per_device_train_batch_size", "4",
             "--max_train_samples", "40", "--max_eval_samples", "8", "--sample_max_new_tokens", "0"]


def tree(folder) -> dict[str, bytes]:
    """Every file under `folder` with its bytes (the lock file aside: it names the latest run that held it)."""
    return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(folder) for f in files if f != ".lock"}


def test_overwrite_keeps_the_previous_run_until_the_new_one_passes_its_checks(tmp_path, corpus):
    """--overwrite_output_dir with a malformed train file, or a --warmup_steps refused once the data is counted: one
    line, status 2, and the previous run's checkpoints, weights, metrics, tokenizer and lock file (it named the failed
    run's pid) stay byte for byte; only exit_status.json, the record of the last command on the folder, says so."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "a"}\n{"text": "b"\n')
    common = SMALL_RUN + ["--cache_dir", str(tmp_path / "cache")]
    previous = tmp_path / "previous"
    run_script("pretrain_llama.py", "--train_file", corpus["train"], "--validation_file", corpus["validation"],
               *common, "--max_steps", "2", "--checkpointing_steps", "1", "--output_dir", str(previous))
    before = tree(previous)
    assert {"checkpoints/step_2/model.safetensors", "model.safetensors", "metrics.jsonl", "tokenizer.json",
            "all_results.json"} <= set(before)
    assert json.loads(before.pop(EXIT_STATUS_FILE))["state"] == "completed"
    lock = (previous / ".lock").read_bytes()  # names the run that wrote the folder
    bad_data = ["--train_file", str(rows), "--validation_file", str(rows)]
    long_warmup = ["--train_file", corpus["train"], "--validation_file", corpus["validation"], "--warmup_steps", "1000"]
    for flags, line in ((bad_data, f"error: --train_file {rows}: line 2 is not valid JSON (Expecting ',' delimiter at "
                                   "column 13)"),
                        (long_warmup, "error: --warmup_steps 1000 is more than the run's ")):
        proc = run_script("pretrain_llama.py", *flags, *common, "--output_dir", str(previous), "--overwrite_output_dir",
                          check=False)
        errors = [e for e in proc.stderr.splitlines() if e.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith(line), proc.stderr[-3000:]
        after = tree(previous)
        record = json.loads(after.pop(EXIT_STATUS_FILE))
        assert (record["exit_status"], record["state"], record["reason"]) == (2, "error", errors[0])
        assert after == before and (previous / ".lock").read_bytes() == lock


@pytest.mark.parametrize("num_processes", [1, 2])
def test_a_data_error_creates_no_output_dir(tmp_path, num_processes):
    """The folder and its lock are made before the data is read (a live run's folder is refused at once); a run that
    stops on its data removes them again, also when two processes meet the error."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "a"}\n{"text": "b"\n')
    bad_data = ["--train_file", str(rows), "--validation_file", str(rows), *SMALL_RUN, "--cache_dir",
                str(tmp_path / "cache")]
    launch = None if num_processes == 1 else [
        os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--config_file",
        os.path.join(ROOT, "accelerate_configs", "cpu_2proc.yaml"), "--num_processes", "2", "--main_process_port", "0"]
    out = tmp_path / "out"
    proc = run_script("pretrain_llama.py", *bad_data, "--output_dir", str(out), launcher=launch, check=False,
                      launcher_output=False)  # the processes' lines and the folder (the launcher's report: above)
    assert proc.returncode == (2 if num_processes == 1 else 1), proc.stderr[-3000:]  # accelerate's status: 1
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
        f"error: --train_file {rows}: line 2 is not valid JSON (Expecting ',' delimiter at column 13)"]
    assert not out.exists(), sorted(os.listdir(out))


@pytest.mark.parametrize("flag", ["--model_name_or_path", "--tokenizer_name", "--config_name"])
@pytest.mark.parametrize("inside", [False, True], ids=["is", "contains"])
def test_output_dir_holding_what_the_run_loads_is_one_line(capsys, tmp_path, flag, inside):
    """An --output_dir that is (or contains) the model, tokenizer or config the run loads would be written over by
    the export, or removed by --overwrite_output_dir: refused before anything, the folder untouched."""
    from transformers import LlamaConfig

    model = tmp_path / "model"
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2).save_pretrained(model)
    (model / "model.safetensors").write_bytes(b"weights")
    before = tree(model)
    output_dir = tmp_path if inside else model
    err = one_line_error(capsys, [flag, str(model), "--output_dir", str(output_dir), "--overwrite_output_dir"])
    assert err == (f"error: --output_dir {output_dir} is or contains {flag} {model}, which this run loads: its export "
                   "(and --overwrite_output_dir) would write over it; choose another --output_dir")
    assert tree(model) == before and sorted(os.listdir(tmp_path)) == ["model"]


def test_whitespace_only_data_file_is_one_line(capsys, tmp_path):
    """datasets said "cannot read ...: Couldn't cast" for a JSON lines file of blank lines."""
    blank = tmp_path / "blank.jsonl"
    blank.write_text("  \n\n\t\n")
    assert one_line_error(capsys, ["--train_file", str(blank), "--output_dir", str(tmp_path / "out")]) == (
        f"error: --train_file {blank}: the file holds only whitespace, no rows")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("train,validation,problem", [
    (b'{"text": "a"}\n{"text": "b"}\n', b'{"text": "a"}\n{"text": "caf\xe9"}\n',
     "--validation_file {validation}: line 2 is not UTF-8 text (byte 0xe9 at column 14)"),
    (b'{"text": "a"}\n{"text": "b"}\n', b'{"text": "a", "source": "x"}\n',
     "--train_file {train} has no column 'source', which --validation_file {validation} has: give both files the "
     "same columns"),
], ids=["not-utf8-in-validation-jsonl", "column-missing-from-train-only"])
def test_unreadable_json_lines_name_the_file(capsys, tmp_path, train, validation, problem):
    """A JSON lines validation file is read with the train file's columns: datasets read the bad byte without a word
    (a UnicodeDecodeError traceback when the rows were tokenized) and stopped at an extra column with "Couldn't
    cast". Both are one line naming the file (and the line)."""
    from common.inputs.data import HeldOut, load_raw_datasets
    from common.inputs.mixture import read_sources

    files = {"train": tmp_path / "train.jsonl", "validation": tmp_path / "validation.jsonl"}
    files["train"].write_bytes(train)
    files["validation"].write_bytes(validation)
    args = pretrain.parse_args(["--train_file", str(files["train"]), "--validation_file", str(files["validation"]),
                                "--output_dir", str(tmp_path / "out"), "--cache_dir", str(tmp_path / "cache")])
    with pytest.raises(SystemExit) as exc:
        load_raw_datasets(read_sources(args)[0], HeldOut.from_flags(args), args.cache_dir)  # as the recipe reads it
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()  # datasets' progress bars come first
    assert [line for line in err if line.startswith("error:")] == [f"error: {problem.format(**files)}"], err


USER = {"role": "user", "content": "alpha?"}
ANSWER = {"role": "assistant", "content": "beta"}
TEXT_PAIR = {"prompt": "Q", "chosen": "a", "rejected": "b"}
CHAT_PAIR = {"prompt": [USER], "chosen": [ANSWER], "rejected": [{"role": "assistant", "content": "mu"}]}


def assert_rows_refused(capsys, tmp_path, script: str, load: str, rows: list[dict], problem: str) -> None:
    """The recipe's data function, given `rows` as its train and validation file, stops with the one line `problem`
    before it needs an accelerator or a model."""
    import json

    recipe = load_script(script)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = recipe.parse_args(["--model_name_or_path", "unused", "--train_file", str(path), "--validation_file",
                              str(path), "--output_dir", str(tmp_path / "out"), "--cache_dir", str(tmp_path / "cache")])
    with pytest.raises(SystemExit) as exc:
        getattr(recipe, load)(args, None, None, None)  # no accelerator, no model: it stops before either is used
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if line.startswith("error:")] == [f"error: {problem.format(rows=path)}"], err


@pytest.mark.parametrize("rows,problem", [
    ([{"prompt": "Q", "chosen": "a"}], "no column 'rejected' in the train split (columns: prompt, chosen); set "
                                       "--rejected_column"),
    ([TEXT_PAIR, {"prompt": "Q", "chosen": " ", "rejected": "b"}],
     "--train_file {rows}: row 2 has an empty 'chosen' response"),
    ([TEXT_PAIR, {"prompt": "Q", "chosen": "b", "rejected": "b"}],
     "--train_file {rows}: row 2 has the same 'chosen' and 'rejected': nothing to prefer"),
    ([CHAT_PAIR, {"prompt": [USER], "chosen": [USER], "rejected": [ANSWER]}],
     "--train_file {rows}: row 2 has no assistant turn: nothing in it to learn"),
    ([{"prompt": "Q", "chosen": [ANSWER], "rejected": [ANSWER]}],
     "--train_file {rows}: row 1 mixes plain text and chat turns in 'prompt', 'chosen', 'rejected'"),
    ([CHAT_PAIR, {**CHAT_PAIR, "rejected": [{"role": "assistant", "content": " "}]}],
     "--train_file {rows}: row 2 has an empty 'rejected' response (turn 1)"),
], ids=["missing-column", "empty-response", "chosen-is-rejected", "chat-without-answer", "text-and-chat",
        "empty-chat-response"])
def test_bad_preference_rows_are_one_line_before_any_work(capsys, tmp_path, rows, problem):
    """scripts/finetune_dpo.py checks its rows before it loads the tokenizer or a model: a pair it cannot train on
    is one line naming the file and the row."""
    assert_rows_refused(capsys, tmp_path, "finetune_dpo", "load_preference_data", rows, problem)


@pytest.mark.parametrize("rows,problem", [
    ([{"prompt": "Q", "completion": "a"}, {"prompt": "Q", "completion": " "}],
     "--train_file {rows}: row 2 has an empty 'completion' response"),
    ([{"messages": [USER, ANSWER]}, {"messages": [USER, {"role": "assistant", "content": ""}]}],
     "--train_file {rows}: row 2 has an empty 'messages' response (turn 2)"),
    ([{"messages": [USER, ANSWER]}, {"messages": [USER, {"role": "assistant", "content": None}]}],
     "--train_file {rows}: row 2 has an empty 'messages' response (turn 2)"),
], ids=["empty-completion", "empty-assistant-turn", "assistant-turn-without-content"])
def test_bad_sft_rows_are_one_line_before_any_work(capsys, tmp_path, rows, problem):
    """scripts/finetune_causal_lm.py checks its rows before it loads the tokenizer or a model. An assistant turn with
    nothing in it trained (its end-of-turn tokens only) where an empty text response was refused: both are refused,
    in both recipes (the DPO case: test_bad_preference_rows_are_one_line_before_any_work)."""
    assert_rows_refused(capsys, tmp_path, "finetune_causal_lm", "load_sft_data", rows, problem)


TEXT_ROW = {"prompt": "Q", "completion": "a"}
CHAT_COMPLETION_ROW = {"prompt": "Q", "completion": [ANSWER]}
MIXED = "holds chat turns where row 1 of the train split holds plain text: give every row the same kind"
PAST_10_MB = 18_000  # rows of 600 bytes: datasets reads a JSON file 10 MB at a time, the first chunk fixing the types


@pytest.mark.parametrize("recipe,train,validation,problem", [
    ("finetune_dpo", [TEXT_PAIR], [TEXT_PAIR, CHAT_PAIR], f"--validation_file {{validation}}: row 2 {MIXED}"),
    ("finetune_dpo", [TEXT_PAIR], [CHAT_PAIR, TEXT_PAIR], f"--validation_file {{validation}}: row 1 {MIXED}"),
    ("finetune_dpo", [{**TEXT_PAIR, "prompt": "Q" * 600}] * PAST_10_MB + [CHAT_PAIR], [TEXT_PAIR],
     f"--train_file {{train}}: row {PAST_10_MB + 1} {MIXED}"),
    ("finetune_causal_lm", [TEXT_ROW], [TEXT_ROW, CHAT_COMPLETION_ROW],
     "--validation_file {validation}: row 2 holds chat turns in 'completion', where plain text is expected"),
    ("finetune_causal_lm", [{**TEXT_ROW, "prompt": "Q" * 600}] * PAST_10_MB + [CHAT_COMPLETION_ROW], [TEXT_ROW],
     f"--train_file {{train}}: row {PAST_10_MB + 1} holds chat turns in 'completion', where plain text is expected"),
], ids=["dpo-validation-last-row", "dpo-validation-first-row", "dpo-train-past-10-MB", "sft-validation-last-row",
        "sft-train-past-10-MB"])
def test_a_chat_row_among_text_rows_is_one_line_however_datasets_hands_it_over(capsys, tmp_path, recipe, train,
                                                                                 validation, problem):
    """`datasets` 5.2 casts a column to one type: a chat row in a validation file read with a text train file's types,
    or past the first 10 MB of a file of text rows, reached the recipes as its JSON text ('[{"role": ...}]', the text
    rows around it as '"Q"') and trained as such, without a word ("18001 training pairs", status 0). The rows are read
    as their file holds them: one line naming the file and the row."""
    import json

    script = load_script(recipe)
    files = {"train": tmp_path / "train.jsonl", "validation": tmp_path / "validation.jsonl"}
    for split, rows in (("train", train), ("validation", validation)):
        files[split].write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = script.parse_args(["--model_name_or_path", "unused", "--train_file", str(files["train"]),
                              "--validation_file", str(files["validation"]), "--output_dir", str(tmp_path / "out"),
                              "--cache_dir", str(tmp_path / "cache")])
    load = script.load_preference_data if recipe == "finetune_dpo" else script.load_sft_data
    with pytest.raises(SystemExit) as exc:
        load(args, None, None, None)  # no accelerator, no model: it stops before either is used
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if line.startswith("error:")] == [f"error: {problem.format(**files)}"], err


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> str:
    """A tokenizer without a chat template (a few seconds' BPE), for the checks that need one."""
    from common.inputs.data import train_bpe_tokenizer

    path = str(tmp_path_factory.mktemp("tokenizer"))
    train_bpe_tokenizer(["alpha beta gamma delta, the model reads tokens"] * 20, 300).save_pretrained(path)
    return path


FOR_EACH_TURN = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"


@pytest.mark.parametrize("recipe,template,message", [
    ("finetune_causal_lm", FOR_EACH_TURN + "{{ messages[7]['content'] }}", "list object has no element 7"),
    ("finetune_dpo", FOR_EACH_TURN + "{{ messages[7]['content'] }}", "list object has no element 7"),
    ("finetune_dpo", "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ raise_exception('no answers here') }}"
                     "{% endif %}{{ m['content'] }}{% endfor %}", "no answers here"),
], ids=["sft-undefined", "dpo-prompt-undefined", "dpo-response-raises"])
def test_a_chat_template_that_fails_on_the_first_row_is_one_line(capsys, tmp_path, tokenizer_folder, recipe,
                                                                  template, message):
    """A template that compiles but fails when it renders a conversation (`messages[7]` of a shorter one; its own
    `raise_exception` once a response follows the prompt) ended in jinja2's traceback midway through tokenizing: one line
    naming the file and the row, with the template's own message (a later row: tests/test_chat_data.py)."""
    import contextlib
    import json
    import types

    script = load_script(recipe)
    path, chat = tmp_path / "rows.jsonl", tmp_path / "chat.jinja"
    chat.write_text(template)
    row = {"messages": [USER, ANSWER]} if recipe == "finetune_causal_lm" else CHAT_PAIR
    path.write_text(json.dumps(row) + "\n")
    args = script.parse_args(["--model_name_or_path", tokenizer_folder, "--train_file", str(path), "--validation_file",
                              str(path), "--chat_template", str(chat), "--output_dir", str(tmp_path / "out"),
                              "--cache_dir", str(tmp_path / "cache")])
    load = script.load_preference_data if recipe == "finetune_dpo" else script.load_sft_data
    no_accelerator = types.SimpleNamespace(main_process_first=contextlib.nullcontext)
    with pytest.raises(SystemExit) as exc:
        load(args, no_accelerator, None, None)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if line.startswith("error:")] == [
        f"error: --chat_template {chat} fails on row 1 of --train_file {path}: {message}"], err
