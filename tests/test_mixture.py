"""Pretraining on a weighted mixture of corpora (common/inputs/mixture.py, docs/mixtures.md): each source's share of
training tokens, equal training for any split of the global batch and under ZeRO-3 and FSDP2, exact resume (killed
twice, and from 2 processes on 1 and 1 on 2), the same for a streamed mixture (split and killed), a second data stage,
per-source figures, and bad mixtures in one line.

Sources of unequal document lengths: `long` (200-400 words a document) and `short` (5-30), and `mid` for three."""

from __future__ import annotations

import json
import os
import random
import shutil
import sys

import numpy as np
import pytest
import torch

from conftest import CORE_OPTIMIZER, SCRIPTS, launcher, read_metrics, run_script
from test_crash_safety import newest_complete_step, sigkill, start, wait_for, weights_diff
from test_distributed import assert_same_training

WORDS = "the model reads tokens and learns to predict the next one while the optimizer updates weights".split()
CODE = "0 1 2 3 4 5 6 7 8 9 + - * / ( ) [ ] : ;".split()
GREEK = "ALPHA BETA GAMMA DELTA EPSILON ZETA ETA THETA IOTA KAPPA LAMBDA".split()
# disjoint alphabets: a 16-token block of one source is never one of another's
SOURCES = {"long": (120, 200, 400, WORDS), "short": (500, 5, 30, CODE), "mid": (200, 40, 120, GREEK)}
STEPS, EVERY = 8, 2
TIMING = ("time", "tokens_per_second", "peak_memory_bytes", "train_runtime")  # what differs between equal runs


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """name -> train file, name-val -> held-out file, and a tokenizer folder trained on all of them."""
    from common.inputs.data import train_bpe_tokenizer

    d, rng, paths, texts = tmp_path_factory.mktemp("mixture"), random.Random(0), {}, []
    for name, (docs, low, high, words) in SOURCES.items():
        for split, count in ((name, docs), (f"{name}-val", 12)):
            rows = [" ".join(rng.choice(words) for _ in range(rng.randint(low, high))) for _ in range(count)]
            paths[split] = str(d / f"{split}.jsonl")
            with open(paths[split], "w") as f:
                f.writelines(json.dumps({"text": r}) + "\n" for r in rows)
            texts += rows
    paths["tokenizer"] = str(d / "tokenizer")
    train_bpe_tokenizer(texts, 300).save_pretrained(paths["tokenizer"])
    paths["dir"] = str(d)
    return paths


def fresh_accelerator():
    """An Accelerator on the CPU from fresh process-wide state (other in-process tests may have left theirs)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True)


def mixture_args(sources, names, weights, **extra):
    """The recipe's flags for a mixture of `names` (parsed, checked)."""
    from test_bad_inputs import pretrain

    argv = ["--train_file", *[sources[n] for n in names], "--validation_file", *[sources[f"{n}-val"] for n in names],
            "--mixture_weights", *map(str, weights), "--tokenizer_name", sources["tokenizer"], "--block_size", "16",
            "--cache_dir", os.path.join(sources["dir"], "cache"),
            "--output_dir", os.path.join(sources["dir"], "never")]  # not outputs/run: a user's run may be there
    for key, value in extra.items():
        argv += [f"--{key}"] + ([] if value is True else [str(value)])
    return pretrain.parse_args(argv)


def source_of_blocks(blocks: dict) -> dict:
    """Each packed block's source, by its tokens (the sources' alphabets are disjoint)."""
    owner = {}
    for name, rows in blocks.items():
        for row in rows:
            assert owner.setdefault(tuple(row["input_ids"]), name) == name
    return owner


@pytest.mark.parametrize("names,weights", [(("long", "short"), (0.7, 0.3)),
                                           (("long", "short", "mid"), (0.2, 0.5, 0.3))])
def test_map_style_shares_hold_at_every_step_and_sources_repeat_reshuffled(sources, names, weights):
    """Over two epochs, every optimizer step's prefix of the stream holds each source's weight as its token share
    to within 1 % (absolute; from the first 100 blocks on), `train_tokens/<source>` counts exactly what was drawn, a
    source drawn past its end starts a new pass in a new order, and `first_exhausted` ends before any block repeats."""
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    from common.inputs.mixture import TokensPerSource, load_mixed_blocks, read_sources

    args = mixture_args(sources, names, weights)
    accelerator = fresh_accelerator()
    _, train, _, _ = load_mixed_blocks(args, accelerator, None, read_sources(args))
    blocks = dict(zip(names, train.blocks))
    owner, mixture = source_of_blocks(blocks), train.mixture
    assert min(mixture.lengths) * 3 < max(mixture.lengths)  # unequal sizes: some sources repeat, some are cut
    batch, steps_per_epoch = 8, len(train) // 8
    tokens = TokensPerSource(accelerator, mixture, 16, batch, steps_per_epoch)
    drawn = {n: 0 for n in names}
    for epoch in range(2):
        train.set_epoch(epoch)
        for step, rows in enumerate(DataLoader(train, batch_size=batch, collate_fn=default_data_collator)):
            if step == steps_per_epoch:
                break
            for ids in rows["input_ids"].tolist():
                drawn[owner[tuple(ids)]] += 1
            total = sum(drawn.values())
            if total >= 100:
                for name, weight in zip(names, weights):
                    assert abs(drawn[name] / total - weight) <= 0.01, (epoch, step, name)
            assert tokens.at(epoch * steps_per_epoch + step + 1) == {n: 16 * c for n, c in drawn.items()}
    picked = [[] for _ in names]  # each source's blocks in the order the mixture draws them, epoch after epoch
    for epoch in range(3):
        for position in range(len(train)):
            source, index = mixture.block(epoch, position)
            picked[source].append(index)
    repeated = [k for k, n in enumerate(mixture.lengths) if len(picked[k]) >= 2 * n]
    assert repeated  # the smallest source ran through at least two passes
    for k in repeated:
        n = mixture.lengths[k]
        first, second = picked[k][:n], picked[k][n:2 * n]
        assert sorted(first) == sorted(second) == list(range(n)) and first != second  # each pass a new order
    once = load_mixed_blocks(mixture_args(sources, names, weights, mixture_stopping="first_exhausted"),
                             accelerator, None, read_sources(args))[1]
    picks = [once.mixture.block(0, p) for p in range(len(once))]
    assert len(set(picks)) == len(picks)  # no block twice
    counts = np.bincount([k for k, _ in picks], minlength=len(names))
    assert max(counts / np.asarray(once.mixture.lengths)) > 0.98  # a source ran out


def test_streaming_shares_are_within_two_percent(sources):
    """The streamed mixture (`interleave_datasets` with the weights as probabilities over packed blocks) holds each
    source's weight as its token share to within 2 % over 6,000 blocks, 2 and 3 sources, the short sources repeating;
    the loader counts per source what it hands out."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from transformers import AutoTokenizer, default_data_collator

    from common.features.streaming import StreamingLoader, load_streams, mix_streams, packed_blocks
    from common.inputs.mixture import Mixture, read_sources

    tokenizer, accelerator = AutoTokenizer.from_pretrained(sources["tokenizer"]), fresh_accelerator()
    for names, weights in ((("long", "short"), (0.7, 0.3)), (("long", "short", "mid"), (0.2, 0.5, 0.3))):
        args = mixture_args(sources, names, weights, streaming=True, max_steps=1)
        found = read_sources(args)
        blocks = [packed_blocks(load_streams(s, 0, None, None)[0], s, tokenizer, 8) for s in found]
        stream = StreamingLoader(accelerator, StatefulDataLoader(
            mix_streams(blocks, Mixture(found, None, "repeat", 42)), batch_size=100, collate_fn=default_data_collator),
            len(names))
        for count, _ in enumerate(stream, 1):
            if count == 60:
                break
        shares = stream.blocks_drawn() / 6000
        assert np.abs(shares - np.asarray(weights)).max() <= 0.02, shares


def test_a_streamed_mixture_resumes_at_any_batch(sources, tmp_path):
    """In-process: the interleaved stream saved after any of its first batches (`interleave_datasets`' state: the
    generator, each source's position, repeats) and restored into a new loader goes on with the uninterrupted
    batches, and its per-source counts with them."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from transformers import AutoTokenizer, default_data_collator

    from common.features.streaming import StreamingLoader, load_streams, mix_streams, packed_blocks
    from common.inputs.mixture import Mixture, read_sources

    tokenizer, accelerator = AutoTokenizer.from_pretrained(sources["tokenizer"]), fresh_accelerator()
    args = mixture_args(sources, ("long", "short"), (0.7, 0.3), streaming=True, max_steps=1)
    found = read_sources(args)

    def new_stream() -> StreamingLoader:
        blocks = [packed_blocks(load_streams(s, 0, None, None)[0], s, tokenizer, 16) for s in found]
        return StreamingLoader(accelerator, StatefulDataLoader(mix_streams(blocks, Mixture(found, None, "repeat", 3)),
                                                               batch_size=8, collate_fn=default_data_collator), 2)

    def batches(stream: StreamingLoader, count: int) -> list[list[list[int]]]:
        got = []
        for batch in stream:
            got.append(batch["input_ids"].tolist())
            if len(got) == count:
                return got

    want = batches(new_stream(), 36)
    for k in (5, 29):
        stream = new_stream()
        assert batches(stream, k) == want[:k]
        stream._save([], [], str(tmp_path))
        resumed = new_stream()
        resumed._load([], str(tmp_path))
        assert resumed.drawn.tolist() == stream.drawn.tolist() and sum(stream.drawn.tolist()) == 8 * k
        assert batches(resumed, 36 - k) == want[k:], k


@pytest.mark.parametrize("extra,message", [
    ({"mixture_weights": "0.6"}, "--mixture_weights has 1 weights for 2 --train_file: give one per file"),
    ({"mixture_weights": "0.6 0"}, "source 'short': weight 0.0 must be a finite number > 0 (leave a source out "
                                   "instead of giving it 0)"),
    ({"mixture_weights": "-1 1"}, "source 'long': weight -1.0 must be a finite number > 0"),
    ({"mixture_weights": "nan 1"}, "source 'long': weight nan must be a finite number > 0"),
    ({"mixture_weights": "inf 1"}, "source 'long': weight inf must be a finite number > 0"),
    ({"mixture_weights": None}, "2 --train_file need --mixture_weights, one per file (shares of training tokens)"),
    ({"validation_file": "{long-val}"}, "--validation_file has 1 files for 2 --train_file: give one per source"),
    ({"train_file": "{long} {long}"}, "two sources are named 'long'"),
    ({"train_file": "{long} {dir}/empty.jsonl"}, "--train_file {dir}/empty.jsonl: the file is empty"),
    ({"dataset_mixture": "{dir}/mix.yaml"}, "give --dataset_mixture or --train_file/--dataset_name/--mixture_weights"),
    ({"streaming": "", "max_steps": "5", "mixture_stopping": "first_exhausted"},
     "--mixture_stopping first_exhausted needs the map-style path"),
])
def test_a_bad_mixture_is_one_line_before_any_work(sources, capsys, extra, message):
    from test_bad_inputs import one_line_error

    open(os.path.join(sources["dir"], "empty.jsonl"), "w").close()
    flags = {"train_file": "{long} {short}", "validation_file": "{long-val} {short-val}", "mixture_weights": "0.6 0.4",
             **extra}
    argv = [x for key, value in flags.items() if value is not None
            for x in [f"--{key}", *value.format(**sources).split()]]
    err = one_line_error(capsys, argv + ["--output_dir", os.path.join(sources["dir"], "never")])
    assert err.startswith("error: " + message.format(**sources)), err
    assert not os.path.exists(os.path.join(sources["dir"], "never"))  # nothing written


@pytest.mark.parametrize("yaml_text,message", [
    ("datasets: []", "needs a non-empty `datasets:` list"),
    ("datasets:\n  - weight: 1", "source 1: needs a `path` (a data file, a dataset folder or a hub id)"),
    ("datasets:\n  - path: {long}\n    weigth: 1", "source 1 ({long}): unknown key weigth (keys: columns, name, path, "
                                                  "split, validation_file, weight)"),
    ("datasets:\n  - path: {long}\n    weight: lots", "source 1 ({long}): weight 'lots' is not a number"),
    ("datasets:\n  - path: {long}\n    split: test", "source 1 ({long}): split 'test': only the train split"),
    ("datasets:\n  - path: {long}\n  - path: {short}\n    weight: 0", "source 'short': weight 0.0 must be"),
])
def test_a_bad_mixture_file_is_one_line_naming_the_source(sources, capsys, yaml_text, message):
    from test_bad_inputs import one_line_error

    path = os.path.join(sources["dir"], "bad.yaml")
    with open(path, "w") as f:
        f.write(yaml_text.format(**sources))
    err = one_line_error(capsys, ["--dataset_mixture", path, "--output_dir", os.path.join(sources["dir"], "never")])
    prefix = "" if message.startswith("source '") else f"--dataset_mixture {path}: "
    assert err.startswith("error: " + prefix + message.format(**sources)), err


def test_a_mixture_file_trains_as_the_flags_do_and_a_source_without_text_is_one_line(sources, tmp_path, capsys):
    """The mixture file gives the sources, weights and held-out files the flags give; a source whose rows hold no text
    stops the run in one line naming it, before the tokenizer is trained."""

    from common.inputs.mixture import load_mixed_blocks, read_sources
    from test_bad_inputs import pretrain

    mix = tmp_path / "mix.yaml"
    mix.write_text("datasets:\n" + "".join(
        f"  - path: {sources[n]}\n    columns: [text]\n    weight: {w}\n    validation_file: {sources[n + '-val']}\n"
        for n, w in (("long", 0.7), ("short", 0.3))))
    flags = mixture_args(sources, ("long", "short"), (0.7, 0.3))
    from_file = pretrain.parse_args(["--dataset_mixture", str(mix), "--tokenizer_name", sources["tokenizer"],
                                     "--output_dir", str(tmp_path / "never")])
    assert read_sources(from_file) == read_sources(flags)
    empty = tmp_path / "blank.jsonl"
    empty.write_text('{"text": ""}\n' * 5)
    args = mixture_args({**sources, "short": str(empty)}, ("long", "short"), (0.5, 0.5), tokenizer_name=None)
    args.tokenizer_name, args.cache_dir = None, str(tmp_path / "cache")
    with pytest.raises(SystemExit) as exc:
        load_mixed_blocks(args, fresh_accelerator(), None, read_sources(args))
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: source 'blank': its training rows hold no text"
    assert not (tmp_path / "cache").exists()  # no tokenizer trained


# ---- training runs -------------------------------------------------------------------------------------------------
def run_args(sources, output_dir, *extra: str, weights=("0.7", "0.3")) -> list[str]:
    """AdamW + cosine, not the recipe's Muon default: the ZeRO-3 run below is compared to fp32 rounding, and
    DeepSpeed's own Muon runs Newton-Schulz in bf16 (Muon on every engine: test_muon.py)."""
    return [*CORE_OPTIMIZER, "--train_file", sources["long"], sources["short"], "--validation_file",
            sources["long-val"], sources["short-val"], "--mixture_weights", *weights, "--tokenizer_name",
            sources["tokenizer"], "--block_size", "32", "--max_steps", str(STEPS), "--logging_steps", "1",
            "--eval_steps", "4",
            "--checkpointing_steps", str(EVERY), "--save_total_limit", "9", "--mixed_precision", "no",
            "--sample_max_new_tokens", "0",
            "--learning_rate", "3e-3", "--cache_dir", os.path.join(sources["dir"], "run-cache"),
            "--output_dir", str(output_dir), *extra]


def rows(output_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(str(output_dir))]


@pytest.fixture(scope="module")
def runs(sources, dropout_config, tmp_path_factory):
    """1 x 8 (the reference), 2 x 4, 2 x 4's checkpoint at step 2 continued by 1 process x 8 accumulation and 1 x 8's
    continued by 2 processes x 4; with
    dropout: an uninterrupted run and one SIGKILLed twice at steps drawn from a fixed seed, resumed each time."""
    d = tmp_path_factory.mktemp("mixture-runs")
    run_script("pretrain_llama.py", *run_args(sources, d / "one", "--per_device_train_batch_size", "8"))
    run_script("pretrain_llama.py", *run_args(sources, d / "two", "--per_device_train_batch_size", "4"),
               launcher=launcher("cpu_2proc.yaml"))
    shutil.copytree(d / "two" / "checkpoints" / "step_2", d / "two_to_one" / "checkpoints" / "step_2")
    run_script("pretrain_llama.py", *run_args(sources, d / "two_to_one", "--per_device_train_batch_size", "1",
                                              "--gradient_accumulation_steps", "8", "--resume_from_checkpoint",
                                              "latest"))
    shutil.copytree(d / "one" / "checkpoints" / "step_2", d / "one_to_two" / "checkpoints" / "step_2")
    run_script("pretrain_llama.py", *run_args(sources, d / "one_to_two", "--per_device_train_batch_size", "4",
                                              "--resume_from_checkpoint", "latest"), launcher=launcher("cpu_2proc.yaml"))
    return d, killed_twice_and_resumed(sources, dropout_config, d)


def killed_twice_and_resumed(sources, dropout_config, d, *extra: str) -> list[int]:
    """With dropout, 1 x 8: `d/full` uninterrupted, `d/killed` SIGKILLed twice after checkpoints at steps drawn from a
    fixed seed (in the middle of later steps) and resumed each time; returns the steps the kills resumed from."""
    dropout = ("--config_name", dropout_config, "--per_device_train_batch_size", "8", "--resume_from_checkpoint",
               "auto", *extra)
    run_script("pretrain_llama.py", *run_args(sources, d / "full", *dropout))
    cmd = [sys.executable, os.path.join(SCRIPTS, "pretrain_llama.py"), *run_args(sources, d / "killed", *dropout)]
    rng, kills = random.Random(5), []
    for low, high in ((1, 3), (4, 6)):
        at = max(rng.randint(low, high), kills[-1] + 1 if kills else 0)
        proc = start(cmd, str(d / "killed.log"))
        assert wait_for(proc, lambda: newest_complete_step(d / "killed") >= at), "the run ended before the kill"
        sigkill(proc)
        kills.append(newest_complete_step(d / "killed"))
    proc = start(cmd, str(d / "killed.log"))
    assert proc.wait(timeout=300) == 0, (d / "killed.log").read_text()[-3000:]
    return kills


def test_processes_and_accumulation_train_as_one_batch(runs):
    """2 processes x 4, and from a step-2 checkpoint the other way round (2 x 4's continued by 1 process x 8
    accumulation, 1 x 8's by 2 processes x 4), equal 1 x 8 from the next step on: losses 1e-6 and weights 1e-5
    relative (fp32); the per-source figures are the same rows."""
    d, _ = runs
    print(assert_trains_as(d / "two", d / "one", range(1, STEPS + 1)))
    for resumed in ("two_to_one", "one_to_two"):
        print(resumed, assert_trains_as(d / resumed, d / "one", range(EVERY + 1, STEPS + 1)))
    one, two = read_metrics(str(d / "one")), read_metrics(str(d / "two"))
    assert [r.keys() for r in one] == [r.keys() for r in two] and len(one) == STEPS + 2
    for a, b in zip(one, two):
        assert {k: v for k, v in a.items() if k.startswith("train_tokens/")} == {
            k: v for k, v in b.items() if k.startswith("train_tokens/")}
        assert all(a[k] == pytest.approx(b[k], rel=1e-5) for k in a if k.startswith("eval_loss/"))
    resumed = [{k: v for k, v in r.items() if k.startswith("train_tokens/")} for r in read_metrics(str(d / "one"))]
    for elastic in ("two_to_one", "one_to_two"):
        assert resumed[EVERY:] == [{k: v for k, v in r.items() if k.startswith("train_tokens/")}
                                   for r in read_metrics(str(d / elastic))]


def test_killed_twice_and_resumed_ends_as_the_uninterrupted_run(runs):
    """SIGKILL at two drawn steps, resumed each time (dropout on): the same weights (0.0) and the same metric rows,
    per-source figures included; the token shares of the run are within 1 % of the weights."""
    d, kills = runs
    assert kills[0] >= 1 and kills[1] > kills[0]
    assert weights_diff(d / "killed", d / "full") == 0.0
    assert rows(d / "killed") == rows(d / "full")
    final = json.loads((d / "full" / "all_results.json").read_text())
    assert {k for k in final if "/" in k} == {"eval_loss/long", "eval_loss/short", "train_tokens/long",
                                              "train_tokens/short", "train_passes/long", "train_passes/short"}
    total = final["train_tokens/long"] + final["train_tokens/short"]
    assert total == STEPS * 8 * 32 and abs(final["train_tokens/long"] / total - 0.7) <= 0.01
    evals = [r for r in read_metrics(str(d / "full")) if "eval_loss" in r]
    assert all(min(r["eval_loss/long"], r["eval_loss/short"]) <= r["eval_loss"] <= max(
        r["eval_loss/long"], r["eval_loss/short"]) for r in evals) and len(evals) == 2


def test_a_changed_mixture_is_refused_and_continues_as_a_second_stage(runs, sources):
    """Other weights on a checkpoint: refused in one line that names the flag to use; with --new_data_mixture the run
    continues (weights, optimizer and schedule from the checkpoint) and counts its tokens on from the checkpoint's."""
    d, _ = runs
    stage = d / "stage2"
    checkpoint = f"step_{STEPS - EVERY}"
    shutil.copytree(d / "one" / "checkpoints" / checkpoint, stage / "checkpoints" / checkpoint)
    shutil.copy(d / "one" / "metrics.jsonl", stage / "metrics.jsonl")
    base = run_args(sources, stage, "--per_device_train_batch_size", "8", "--resume_from_checkpoint", "latest",
                    weights=("0.2", "0.8"))
    refused = run_script("pretrain_llama.py", *base, check=False)
    assert refused.returncode == 2
    line = [x for x in refused.stderr.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and line[0].endswith("the checkpoint was trained on the mixture long 0.7, short 0.3 "
                                               "(repeat), this run has long 0.2, short 0.8 (repeat); to continue it "
                                               "with another mixture (a second stage), add --new_data_mixture"), line
    run_script("pretrain_llama.py", *base, "--new_data_mixture")
    before, after = read_metrics(str(d / "one")), read_metrics(str(stage))
    at_checkpoint = [r for r in before if r["step"] == STEPS - EVERY and "loss" in r][0]
    last = [r for r in after if r["step"] == STEPS and "loss" in r][0]
    added = {k: last[k] - at_checkpoint[k] for k in ("train_tokens/long", "train_tokens/short")}
    assert sum(added.values()) == EVERY * 8 * 32
    assert added["train_tokens/short"] > added["train_tokens/long"]  # the new weights



@pytest.mark.parametrize("engine,extra", [
    ("deepspeed_zero3.yaml", ()),
    ("fsdp2.yaml", ("--async_checkpointing", "--chunked_cross_entropy", "--torch_compile", "--torch_compile_backend",
                    "aot_eager")),  # aot_eager: dynamo's graphs without building kernels (tests/test_compile.py)
], ids=["zero3", "fsdp2-async-chunked-compiled"])
def test_a_mixture_trains_as_one_process_under_every_engine(runs, sources, engine, extra):
    """2 processes x 4 under ZeRO-3 (ds_configs/zero3.json) and under FSDP2 with asynchronous checkpoints, the chunked
    loss and compiled layers train as 1 x 8 (test_distributed.py's tolerances: losses and gradient norms 1e-5,
    weights 1e-4 relative); the per-source figures are the same rows (tokens equal, held-out losses 1e-5)."""
    d, _ = runs
    out = d / engine.removesuffix(".yaml")
    fsdp = ["--mixed_precision", "no"] if engine.startswith("fsdp") else []  # the launcher's flag beats the config's
    run_script("pretrain_llama.py", *run_args(sources, out, "--per_device_train_batch_size", "4", *extra),
               launcher=launcher(engine) + fsdp)
    print(engine, assert_same_training(out, d / "one", steps=range(1, STEPS + 1)))
    one, other = read_metrics(str(d / "one")), read_metrics(str(out))
    assert [r.keys() for r in one] == [r.keys() for r in other]
    for a, b in zip(one, other):
        assert {k: v for k, v in a.items() if k.startswith("train_tokens/")} == {
            k: v for k, v in b.items() if k.startswith("train_tokens/")}
        assert all(a[k] == pytest.approx(b[k], rel=1e-5) for k in a if k.startswith("eval_loss"))
    assert (out / "checkpoints" / f"step_{STEPS}").is_dir()  # the last (asynchronous) checkpoint was published
    assert "--torch_compile" not in extra or json.loads((out / "all_results.json").read_text())["compiled_graphs"]

# ---- the streaming path, end to end --------------------------------------------------------------------------------
def assert_trains_as(run_dir, reference_dir, steps) -> str:
    """Losses 1e-6 and weights 1e-5 relative (each tensor's Frobenius norm; fp32), the per-source token counts equal."""
    from test_distributed import exported_weights, train_rows

    run, ref = train_rows(run_dir), train_rows(reference_dir)
    assert sorted(run) == list(steps)
    for step in steps:
        assert run[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-6), f"loss at step {step}"
        tokens = {k: v for k, v in ref[step].items() if k.startswith("train_tokens/")}
        assert tokens and {k: run[step][k] for k in tokens} == tokens, f"tokens per source at step {step}"
    weights, ref_weights = exported_weights(run_dir), exported_weights(reference_dir)
    errors = {name: (torch.linalg.norm(w - ref_weights[name]) / torch.linalg.norm(ref_weights[name])).item()
              for name, w in weights.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, f"{worst}: relative difference {errors[worst]:.1e}"
    return f"max relative loss difference {max(abs(run[s]['loss'] / ref[s]['loss'] - 1) for s in steps):.1e}, " \
           f"max relative weight difference {errors[worst]:.1e}"


@pytest.fixture(scope="module")
def streamed(sources, dropout_config, tmp_path_factory):
    """`--streaming`: 1 x 8 (the reference) and 2 processes x 2 x 2 accumulation (one run for both splits); with
    dropout, an uninterrupted run and one SIGKILLed twice and resumed."""
    d = tmp_path_factory.mktemp("mixture-streamed")
    run_script("pretrain_llama.py", *run_args(sources, d / "one", "--streaming", "--per_device_train_batch_size", "8"))
    run_script("pretrain_llama.py", *run_args(sources, d / "two", "--streaming", "--per_device_train_batch_size", "2",
                                              "--gradient_accumulation_steps", "2"), launcher=launcher("cpu_2proc.yaml"))
    return d, killed_twice_and_resumed(sources, dropout_config, d, "--streaming")


def test_a_streamed_mixture_trains_as_one_batch_on_any_split(streamed):
    """Streaming: 2 processes x 2 sequences x 2 accumulation steps equal 1 x 8 (losses 1e-6, weights 1e-5 relative,
    fp32), with the same tokens per source at every step."""
    d, _ = streamed
    print(assert_trains_as(d / "two", d / "one", range(1, STEPS + 1)))


def test_a_streamed_mixture_killed_twice_and_resumed_ends_as_the_uninterrupted_run(streamed):
    """Streaming, dropout on: SIGKILL at two drawn steps, resumed each time from the newest checkpoint: the same
    weights (0.0) and the same metric rows (per-source tokens and held-out losses included)."""
    d, kills = streamed
    assert kills[0] >= 1 and kills[1] > kills[0]
    assert weights_diff(d / "killed", d / "full") == 0.0
    assert rows(d / "killed") == rows(d / "full")
    assert {k for k in rows(d / "full")[-1] if "/" in k} >= {"eval_loss/long", "eval_loss/short"}
