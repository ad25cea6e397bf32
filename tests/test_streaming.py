"""`--streaming` (common/features/streaming.py): the same blocks on any process count, exact mid-run resume.

Properties:
- coverage: the packed blocks are exactly the documents' tokens in order, less the tail shorter than a block, none
  held out for validation among them; two processes' blocks, taken in turn, are the one-process stream's (one file
  and two shards);
- in-process, the stream's loader saved after any batch of a pass (the last one too) and restored into a new one goes
  on with the uninterrupted batches and passes, with and without loader workers;
- resume = uninterrupted, with 1 and 2 processes: a run stopped at step K (a fresh folder holding only the step-K
  checkpoint) and resumed reaches step N with the uninterrupted run's losses (LOSS_ATOL) and weights, with attention
  dropout on (the same masks); the run crosses a pass boundary after the resume, and the checkpoint holds one stream
  position per process; the resumed run's own checkpoint (step 2K) resumed again reaches step N the same way (a
  second resume);
- a stream position saved by another process count (or none) is one error line on resume, and so is
  `--streaming` without `--max_steps`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, run_script, train_losses

LOSS_ATOL = 1e-6  # measured: identical (0.0) — the resumed run does the same arithmetic on the same blocks
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
N_DOCS, STOP, STEPS = 100, 3, 9  # ~7 optimizer steps per pass: resumed at step 3, the run crosses into pass 2


def document(i: int) -> str:
    rng = random.Random(i)
    words = "the model reads tokens and learns to predict the next one from batches of text".split()
    return f"doc{i} " + " ".join(rng.choice(words) for _ in range(rng.randint(10, 60)))


def write_docs(path: str, ids: range) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": document(i)}) + "\n" for i in ids)


@pytest.fixture(scope="module")
def stream_corpus(tmp_path_factory) -> dict[str, str]:
    """Documents `doc<i> ...` in one train file, the same split over two files, a validation file, a tokenizer."""
    from common.inputs.data import train_bpe_tokenizer

    d = tmp_path_factory.mktemp("stream")
    paths = {name: str(d / f"{name}.jsonl") for name in ("train", "part0", "part1", "validation")}
    write_docs(paths["train"], range(N_DOCS))
    write_docs(paths["part0"], range(0, N_DOCS // 2))
    write_docs(paths["part1"], range(N_DOCS // 2, N_DOCS))
    write_docs(paths["validation"], range(N_DOCS, N_DOCS + 20))
    with open(paths["train"]) as f:
        train_bpe_tokenizer([json.loads(line)["text"] for line in f], vocab_size=512).save_pretrained(str(d / "tok"))
    paths["tokenizer"] = str(d / "tok")
    return paths


def source(train_file: str | None = None, validation_file: str | None = None):
    from common.inputs.mixture import Source

    return Source("train", 1.0, train_file, validation_file)


HELD_OUT = (20, None, None)  # --validation_split_percentage 20, no --max_train_samples, no --max_eval_samples


def doc_ids(documents) -> list[int]:
    return [int(row["text"].split()[0][3:]) for row in documents]


@pytest.mark.parametrize("files", [["train"], ["part0", "part1"]], ids=["one-file", "two-shards"])
def test_each_block_once_per_pass_over_the_processes(stream_corpus, files):
    """Two processes' blocks, taken in turn, are the one-process stream's blocks: the same global batches."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    from common.features.streaming import packed_blocks, process_blocks

    tokenizer = AutoTokenizer.from_pretrained(stream_corpus["tokenizer"])
    stream = load_dataset("json", data_files=[stream_corpus[f] for f in files], streaming=True)["train"]
    blocks = packed_blocks(stream, source(), tokenizer, 64)
    whole = [row["input_ids"] for row in blocks]
    shares = [[row["input_ids"] for row in process_blocks(blocks, rank, 2)] for rank in range(2)]
    assert shares == [whole[0::2], whole[1::2]] and len(whole) > 20


def test_held_out_documents_are_not_trained_on(stream_corpus):
    from datasets import load_dataset

    from common.features.streaming import load_streams, split_streams

    _, validation = load_streams(source(stream_corpus["train"]), *HELD_OUT)  # 20 % held out, by hash
    held = doc_ids(validation)
    assert 10 <= len(held) <= 30
    for files in (["train"], ["part0", "part1"]):  # one file, and two shards
        raw = load_dataset("json", data_files={"train": [stream_corpus[f] for f in files]}, streaming=True)
        train, _ = split_streams(raw, "text", *HELD_OUT)
        trained = doc_ids(train)
        assert not set(held) & set(trained) and sorted(held + trained) == list(range(N_DOCS))
    train, validation = load_streams(source(stream_corpus["train"], stream_corpus["validation"]), *HELD_OUT)
    assert doc_ids(train) == list(range(N_DOCS)) and doc_ids(validation) == list(range(N_DOCS, N_DOCS + 20))


def test_blocks_are_the_stream_tokens_in_order(stream_corpus):
    from transformers import AutoTokenizer

    from common.features.streaming import load_streams, packed_blocks

    args = source(stream_corpus["train"], stream_corpus["validation"])
    tokenizer = AutoTokenizer.from_pretrained(stream_corpus["tokenizer"])
    train, _ = load_streams(args, *HELD_OUT)
    tokens = [t for row in train for t in tokenizer(row["text"])["input_ids"] + [tokenizer.eos_token_id]]
    rows = list(packed_blocks(train, args, tokenizer, 64))
    assert all(row["labels"] == row["input_ids"] for row in rows)
    blocks = [row["input_ids"] for row in rows]
    assert [t for b in blocks for t in b] == tokens[:len(blocks) * 64] and len(tokens) - len(blocks) * 64 < 64


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_resumes_at_every_batch(stream_corpus, tmp_path, workers):
    """In-process: stopped after any batch of a pass (the last one too), saved and restored into a new loader, the
    stream goes on with the uninterrupted sequence of batches and passes (two shards, so two workers both read)."""
    from accelerate import Accelerator
    from datasets import load_dataset
    from torchdata.stateful_dataloader import StatefulDataLoader
    from transformers import AutoTokenizer, default_data_collator

    from common.features.streaming import StreamingLoader, packed_blocks

    accelerator, tokenizer = Accelerator(cpu=True), AutoTokenizer.from_pretrained(stream_corpus["tokenizer"])
    docs = load_dataset("json", data_files=[stream_corpus["part0"], stream_corpus["part1"]], streaming=True)["train"]
    args = source(stream_corpus["part0"])

    def new_stream() -> StreamingLoader:
        blocks = packed_blocks(docs, args, tokenizer, 64)
        return StreamingLoader(accelerator, StatefulDataLoader(blocks, batch_size=4, num_workers=workers,
                                                               collate_fn=default_data_collator))

    def passes(stream: StreamingLoader, count: int) -> list[list[list[list[int]]]]:
        return [[batch["input_ids"].tolist() for batch in stream] for _ in range(count)]

    want = passes(new_stream(), 2)
    n = len(want[0])
    for k in (1, n // 2, n - 1, n):
        stream = new_stream()
        batches = iter(stream)
        for _ in range(k):
            next(batches)
        stream._save([], [], str(tmp_path))
        resumed = new_stream()
        resumed._load([], str(tmp_path))
        got = [[], *passes(resumed, 1)] if k == n else passes(resumed, 2)
        assert got[0] == want[0][k:] and got[1] == want[1] and resumed.epoch == 2, k


def launcher(processes: int) -> list[str]:
    config = os.path.join(ROOT, "accelerate_configs", f"cpu_{processes}proc.yaml")
    return [ACCELERATE, "launch", "--config_file", config, "--num_processes", str(processes), "--main_process_port",
            "0"]


def train_stream(stream_corpus, output_dir, processes: int, config: str, *extra: str) -> None:
    run_script("pretrain_llama.py", "--streaming", "--config_name", config, "--tokenizer_name",
               stream_corpus["tokenizer"], "--train_file", stream_corpus["train"], "--validation_file",
               stream_corpus["validation"], "--block_size", "64", "--output_dir", str(output_dir),
               "--cache_dir", str(output_dir) + "-cache", "--max_steps", str(STEPS), "--logging_steps", "1",
               "--per_device_train_batch_size", str(4 // processes), "--gradient_accumulation_steps", "2",
               "--mixed_precision", "no", "--sample_max_new_tokens", "0", *extra, launcher=launcher(processes))


@pytest.mark.parametrize("processes", [1, 2])
def test_resume_equals_uninterrupted(stream_runs, processes):
    full, resumed = stream_runs(processes)
    checkpoint = full / "checkpoints" / f"step_{STOP}"
    # one position per process (save_state alone writes one loader state, rank 0's, for all)
    positions = [json.loads((checkpoint / f"stream_position_rank{r}.json").read_text()) for r in range(processes)]
    assert [p["epoch"] for p in positions] == [0] * processes  # stopped inside the first pass

    want, got = train_losses(str(full)), train_losses(str(resumed))
    assert sorted(got) == list(range(STOP + 1, STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in got) <= LOSS_ATOL
    a, b = load_file(str(full / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    passes = [json.loads((full / "checkpoints" / f"step_{STEPS - STEPS % STOP}" / f"stream_position_rank{r}.json")
                         .read_text())["epoch"] for r in range(processes)]
    assert min(passes) >= 1  # the resumed stretch crossed into the second pass


def test_position_saved_by_another_process_count_is_refused(tmp_path, capsys):
    from accelerate import Accelerator
    from torchdata.stateful_dataloader import StatefulDataLoader

    from common.features.streaming import StreamingLoader

    stream = StreamingLoader(Accelerator(cpu=True), StatefulDataLoader([{"input_ids": [i]} for i in range(8)]))
    with pytest.raises(SystemExit) as missing:
        stream._load([], str(tmp_path))
    stream._save([], [], str(tmp_path))
    path = tmp_path / "stream_position_rank0.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "world_size": 2}))
    with pytest.raises(SystemExit) as other_count:
        stream._load([], str(tmp_path))
    assert missing.value.code == other_count.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {tmp_path} holds no stream position for process 0: resume a --streaming run from a --streaming "
        "checkpoint, with the same number of processes",
        f"error: {tmp_path} was saved by 2 processes, this run has 1: a stream's per-process positions resume only "
        "at the same process count"]


def test_streaming_needs_max_steps(stream_corpus, tmp_path):
    proc = run_script("pretrain_llama.py", "--streaming", "--train_file", stream_corpus["train"], "--output_dir",
                      str(tmp_path / "out"), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --streaming needs --max_steps: a stream has no length to count epochs in"]


@pytest.fixture(scope="module")
def stream_runs(stream_corpus, dropout_config, tmp_path_factory):
    """`runs(processes)`: (the uninterrupted run, the run resumed from its step-STOP checkpoint alone in a fresh
    folder), made once per process count; both save a checkpoint every STOP steps and keep them."""
    made = {}

    def runs(processes: int):
        if processes not in made:
            d = tmp_path_factory.mktemp(f"stream-{processes}proc")
            keep = ("--checkpointing_steps", str(STOP), "--save_total_limit", "9")
            train_stream(stream_corpus, d / "full", processes, dropout_config, *keep)
            shutil.copytree(d / "full" / "checkpoints" / f"step_{STOP}", d / "resumed" / "checkpoints" / f"step_{STOP}")
            train_stream(stream_corpus, d / "resumed", processes, dropout_config, "--resume_from_checkpoint", "latest",
                         *keep)
            made[processes] = d / "full", d / "resumed"
        return made[processes]

    return runs


@pytest.mark.parametrize("processes", [1, 2])
def test_second_resume_equals_uninterrupted(stream_corpus, dropout_config, stream_runs, tmp_path, processes):
    """The resumed run's own step-6 checkpoint, alone in a fresh folder, resumed again: step 9 with the uninterrupted
    run's losses and bit-identical weights. `datasets` has had a bug where an IterableDataset's saved state stops
    advancing after the first resume, so a second resume restarts the stream where the first one began: guarded here
    against upgrades."""
    full, first = stream_runs(processes)
    second = tmp_path / "second"
    shutil.copytree(first / "checkpoints" / f"step_{2 * STOP}", second / "checkpoints" / f"step_{2 * STOP}")
    train_stream(stream_corpus, second, processes, dropout_config, "--resume_from_checkpoint", "latest")
    want, got = train_losses(str(full)), train_losses(str(second))
    assert sorted(got) == list(range(2 * STOP + 1, STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in got) <= LOSS_ATOL
    a, b = load_file(str(full / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_in_the_second_pass_continues_it(stream_corpus, dropout_config, tmp_path):
    """A run of 12 steps checkpointed at step 9, in the stream's second pass (about 7 steps per pass), resumed from
    that checkpoint alone: steps 10-12 and the weights of the run that never stopped. A fresh loader would set the
    stream's epoch to 0, where `datasets` restores no position, and replay the second pass from its start."""
    straight, resumed, last = tmp_path / "straight", tmp_path / "resumed", STEPS + STOP
    train_stream(stream_corpus, straight, 1, dropout_config, "--max_steps", str(last), "--checkpointing_steps",
                 str(STEPS), "--save_total_limit", "9")
    checkpoint = straight / "checkpoints" / f"step_{STEPS}"
    assert json.loads((checkpoint / "stream_position_rank0.json").read_text())["epoch"] >= 1  # a later pass
    shutil.copytree(checkpoint, resumed / "checkpoints" / f"step_{STEPS}")
    train_stream(stream_corpus, resumed, 1, dropout_config, "--max_steps", str(last), "--resume_from_checkpoint",
                 "latest")
    want, got = train_losses(str(straight)), train_losses(str(resumed))
    assert sorted(got) == list(range(STEPS + 1, last + 1))
    assert max(abs(got[s] - want[s]) for s in got) <= LOSS_ATOL
    a, b = (load_file(str(d / "model.safetensors")) for d in (straight, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)
