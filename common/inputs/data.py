"""Corpora (embedded default, local files, hub datasets), the fast tokenizer, and packing into fixed blocks."""

from __future__ import annotations

import argparse
import ast
import csv
import hashlib
import json
import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import chain

from accelerate import Accelerator
from accelerate.logging import get_logger
from datasets import DatasetDict, load_dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from common.paths import TOKENIZER_DIR
from common.errors import fail
from common.upstream import dataset_fingerprint
from common.inputs import from_pretrained_or_fail
from common.inputs.cache import cached_folder
from common.inputs.json_types import json_features

logger = get_logger(__name__)

EOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<pad>"
DATA_EXTENSIONS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
DEFAULT_CORPUS_MAX_BYTES = 6_000_000
DEFAULT_DOCS_MAX_BYTES = 6_000_000  # the whole library's docstrings are less
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "turtledemo"}


@dataclass
class Source:
    """One corpus: a local file or a hub dataset (a local dataset folder too), its text column, its held-out file, and
    its name and weight in a mixture (a share of training tokens; common/inputs/mixture.py). Neither file nor dataset:
    the embedded default corpus."""
    name: str
    weight: float
    train_file: str | None = None
    validation_file: str | None = None
    dataset_name: str | None = None
    dataset_config_name: str | None = None
    text_column: str = "text"

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> Source:
        """The corpus the data flags of a one-corpus recipe name."""
        return cls("data", 1.0, args.train_file, args.validation_file, args.dataset_name, args.dataset_config_name,
                   args.text_column)

    def describe(self) -> dict:
        """What a resume must keep (a file by its name: a requeued job may stage it elsewhere)."""
        return {"source": self.name, "weight": self.weight,
                "data": os.path.basename(self.train_file) if self.train_file else self.dataset_name,
                "config": self.dataset_config_name, "text_column": self.text_column}


@dataclass
class HeldOut:
    """The held-out split of a corpus that has none (`percentage` of its training rows, drawn with `seed`), and the
    rows each split keeps (all: None)."""
    percentage: int
    seed: int
    max_train_samples: int | None = None
    max_eval_samples: int | None = None

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> HeldOut:
        return cls(args.validation_split_percentage, args.seed, args.max_train_samples, args.max_eval_samples)


def data_format(path: str) -> str:
    """The `datasets` builder that reads a data file (json for both .json and .jsonl)."""
    return DATA_EXTENSIONS[os.path.splitext(path)[1].lower()]


def check_data_files(train_file: str | None, validation_file: str | None) -> None:
    for flag, path in (("--train_file", train_file), ("--validation_file", validation_file)):
        if path is None:
            continue
        if os.path.isdir(path):
            fail(f"{flag} {path}: is a folder; pass a file (for a folder of files use --dataset_name {path})")
        if not os.path.isfile(path):
            fail(f"{flag} {path}: no such file")
        if os.path.splitext(path)[1].lower() not in DATA_EXTENSIONS:
            fail(f"{flag} {path}: unsupported extension (use one of {', '.join(DATA_EXTENSIONS)})")
        if os.path.getsize(path) == 0:
            fail(f"{flag} {path}: the file is empty")
        if holds_only_whitespace(path):  # datasets would say "Couldn't cast"
            fail(f"{flag} {path}: the file holds only whitespace, no rows")
    if validation_file and not train_file:
        fail("--validation_file needs --train_file")
    if validation_file and data_format(train_file) != data_format(validation_file):
        fail(f"--train_file {train_file} and --validation_file {validation_file} must have the same format "
             f"({data_format(train_file)} vs {data_format(validation_file)})")


def holds_only_whitespace(path: str) -> bool:
    """Reads up to the first byte that is not whitespace: the start of the file, for any file with data."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return False
    return True


def build_default_corpus(cache_dir: str, max_bytes: int = DEFAULT_CORPUS_MAX_BYTES) -> dict[str, str]:
    """The embedded default corpus: this Python's own standard library sources.

    Present on every machine that has Python, so the default run needs no download. One JSON row per file;
    one file in twenty of the whole library (chosen by a hash of its path, so stable across machines) is held out for
    validation, while the training files stop at `max_bytes`: with Python 3.11, 33 of the 313 files (10.5 %).
    """
    return build_stdlib_corpus(cache_dir, max_bytes, "stdlib-corpus", "the default corpus", read_text)


def build_default_docs_corpus(cache_dir: str, max_bytes: int = DEFAULT_DOCS_MAX_BYTES) -> dict[str, str]:
    """The default mixture's second source: the standard library's documentation as pydoc shows it (each public
    module's, class's and function's docstring under its name), read with `ast` (nothing is imported). One row per
    module; the same files as the code corpus are held out."""
    return build_stdlib_corpus(cache_dir, max_bytes, "stdlib-docs", "the default documentation corpus", docstrings)


def build_stdlib_corpus(cache_dir: str, max_bytes: int, prefix: str, what: str, read) -> dict[str, str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    paths = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        paths += [os.path.join(root, f) for f in sorted(files) if f.endswith(".py")]
    key = f"{stdlib}|{len(paths)}|{max_bytes}" + ("" if read is read_text else f"|{prefix}")
    out_dir = cached_folder(os.path.join(cache_dir, f"{prefix}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"),
                            partial(write_default_corpus, stdlib, paths, max_bytes, read), what, key)
    return {split: os.path.join(out_dir, f"{split}.jsonl") for split in ("train", "validation")}


def read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def docstrings(path: str) -> str:
    """A module's documentation as pydoc's plain text shows it: each public docstring under its name."""
    tree = ast.parse(read_text(path))
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            name = getattr(node, "name", os.path.splitext(os.path.basename(path))[0])
            doc = ast.get_docstring(node)
            if doc and (not name.startswith("_") or name == "__init__"):
                parts.append(f"{name}\n    " + doc.replace("\n", "\n    "))
    return "\n\n".join(parts)


def write_default_corpus(stdlib: str, paths: list[str], max_bytes: int, read, folder: str) -> None:
    rows = {"train": [], "validation": []}
    size = 0
    for path in paths:
        try:
            text = read(path)
        except (UnicodeDecodeError, OSError, SyntaxError, ValueError):
            continue
        rel = os.path.relpath(path, stdlib)
        split = "validation" if int(hashlib.md5(rel.encode()).hexdigest(), 16) % 20 == 0 else "train"
        if not text or (split == "train" and size >= max_bytes):
            continue
        size += len(text) if split == "train" else 0
        rows[split].append(json.dumps({"text": text, "source": rel}))
    if not rows["train"]:
        fail(f"no readable Python sources under {stdlib} to build the default corpus; pass --train_file")
    for split, split_rows in rows.items():
        with open(os.path.join(folder, f"{split}.jsonl"), "w", encoding="utf-8") as f:
            f.write("\n".join(split_rows) + "\n")


def load_raw_datasets(source: Source, held_out: HeldOut, cache_dir: str, columns: dict[str, str] | None = None,
                      check_rows: Callable[[DatasetDict], tuple[str, int, str] | None] | None = None) -> DatasetDict:
    """train/validation splits of `source`: a hub dataset, local files, or (neither) the embedded default corpus,
    built under `cache_dir`.

    `columns` maps each column the caller needs to the flag that names it (default: the source's text column,
    --text_column). `check_rows` returns the first row the caller cannot train on as (split, row index, what is
    wrong), or None; it sees the splits as read, before any is cut or shortened, so the row it names is the file's.
    """
    if source.dataset_name:
        raw = load_dataset(source.dataset_name, source.dataset_config_name)
        where = {split: f"--dataset_name {source.dataset_name} ({split} split)" for split in raw}
    else:
        files = {"train": source.train_file} if source.train_file else build_default_corpus(cache_dir)
        if source.validation_file:
            files["validation"] = source.validation_file
        builder = data_format(files["train"])
        kwargs = {"keep_linebreaks": True} if builder == "text" else \
            {"features": json_features(files)} if builder == "json" else {}
        try:
            raw = load_dataset(builder, data_files=files, **kwargs)
            for split in raw.values():  # a JSON file read with the train file's columns is not checked for UTF-8
                split.data.validate(full=True)
        except Exception as e:  # datasets names neither the file nor the row: find them
            fail(describe_unreadable_data(files, builder, e))
        where = {split: f"--{split}_file {path}" for split, path in files.items()}
    if "train" not in raw:
        fail(f"the dataset has no 'train' split (splits: {', '.join(raw)})")
    found = check_rows(raw) if check_rows else None
    if found:
        split, row, problem = found
        fail(f"{where[split]}: row {row + 1} {problem}")
    if "validation" not in raw:
        if held_out.percentage <= 0 or len(raw["train"]) < 2:
            fail("no validation data: pass --validation_file or a --validation_split_percentage > 0 with more data")
        split = raw["train"].train_test_split(test_size=held_out.percentage / 100, seed=held_out.seed)
        raw = DatasetDict(train=split["train"], validation=split["test"])
    if held_out.max_train_samples:
        raw["train"] = raw["train"].select(range(min(held_out.max_train_samples, len(raw["train"]))))
    if held_out.max_eval_samples:
        raw["validation"] = raw["validation"].select(range(min(held_out.max_eval_samples, len(raw["validation"]))))
    columns = {source.text_column: "--text_column"} if columns is None else columns
    for split in ("train", "validation"):
        if len(raw[split]) == 0:
            fail(f"the {split} split is empty")
        for column, flag in columns.items():
            if column not in raw[split].column_names:
                fail(f"no column '{column}' in the {split} split (columns: {', '.join(raw[split].column_names)});"
                     f" set {flag}")
    return raw


def describe_unreadable_data(files: dict[str, str], builder: str, error: Exception) -> str:
    """One line for data files `datasets` could not read: the file, and the line that is not UTF-8 or not JSON, or
    the column or value of the validation file that the train file's columns cannot hold."""
    for split, path in files.items():
        problem = find_bad_row(path, builder)
        if problem:
            return f"--{split}_file {path}: {problem}"
    if "validation" in files and builder != "text":  # datasets reads it with the train file's columns and types
        extra = sorted(columns_of(files["validation"], builder) - columns_of(files["train"], builder))
        if extra:
            return (f"--train_file {files['train']} has no column {', '.join(map(repr, extra))}, which "
                    f"--validation_file {files['validation']} has: give both files the same columns")
        mismatch = find_value_of_another_type(files, builder)
        if mismatch:
            return mismatch
    while error.__cause__ or error.__context__:  # the innermost error says what went wrong
        error = error.__cause__ or error.__context__
    detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return f"cannot read {' / '.join(files.values())}: {detail}"


def find_bad_row(path: str, builder: str) -> str | None:
    """The first line of a text/json/csv file that is not UTF-8 (or, in JSON lines, not JSON), or why a parquet file
    does not open; None when nothing is found."""
    if builder == "parquet":
        import pyarrow.parquet as pq

        try:
            pq.ParquetFile(path)
        except Exception as e:
            return f"not a readable parquet file ({e})"
        return None
    document = False  # a .json file may hold one document (an array of rows) instead of one row per line
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"line {number} is not UTF-8 text (byte 0x{line[e.start]:02x} at column {e.start + 1})"
            if builder != "json" or document or not text.strip():
                continue
            if number == 1 and (text.lstrip().startswith("[") or text.strip() == "{"):
                document = True
                continue
            try:
                json.loads(text.rstrip("\r\n"))
            except ValueError as e:
                return f"line {number} is not valid JSON ({e.msg} at column {e.colno})"
    if document:
        try:
            with open(path, encoding="utf-8") as f:
                json.load(f)
        except ValueError as e:
            return f"not valid JSON ({e})"
    return None


def columns_of(path: str, builder: str) -> set[str]:
    """The column names of a data file: a CSV header, a parquet schema, or every key of the JSON rows."""
    if builder == "parquet":
        import pyarrow.parquet as pq

        return set(pq.ParquetFile(path).schema_arrow.names)
    with open(path, encoding="utf-8", newline="") as f:
        if builder == "csv":
            return set(next(csv.reader(f), []))
        text = f.read()
    try:
        rows = json.loads(text)  # one document holding a list of rows
    except ValueError:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return {key for row in (rows if isinstance(rows, list) else [rows]) if isinstance(row, dict) for key in row}


def find_value_of_another_type(files: dict[str, str], builder: str) -> str | None:
    """The first value of the validation file that its column's type in the train file cannot hold (`datasets` reads
    the validation file with the train file's column types: text such as `no` in a column of integers fails), or
    None. Each file is read again on its own: only after a failed load."""
    import pyarrow as pa

    try:
        train, validation = (load_dataset(builder, data_files={split: files[split]}, split=split)
                             for split in ("train", "validation"))
    except Exception:
        return None
    for column in validation.column_names:
        want = getattr(train.features.get(column), "pa_type", None)
        if want is None or validation.features[column] == train.features[column]:
            continue
        for row, value in enumerate(validation[column]):
            try:
                pa.array([value]).cast(want)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
                return (f"--validation_file {files['validation']}: row {row + 1} has {column} {value!r}, which the "
                        f"column's type in --train_file {files['train']} ({want}) cannot hold: give the column the "
                        "same kind of values in both files")
    return None


def train_bpe_tokenizer(texts, vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 style: every byte representable, no unknown tokens), trained in seconds."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN, PAD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN,
                                   pad_token=PAD_TOKEN, model_max_length=1_000_000)


def get_tokenizer(args: argparse.Namespace, accelerator: Accelerator, raw: DatasetDict, resume_from: str | None,
                  vocab_size: int | None = None, text_column: str = "text") -> PreTrainedTokenizerBase:
    """The fast tokenizer named by --tokenizer_name / the model; else a BPE tokenizer of `vocab_size` trained on the
    train split's `text_column`.

    A trained tokenizer is cached under --cache_dir by a fingerprint of the data and vocab size (common/inputs/cache.py:
    written whole or not at all): later runs reuse it.
    A resumed run takes it from its checkpoint (which carries it), whatever the cache holds.
    """
    name = args.tokenizer_name or args.model_name_or_path
    carried = os.path.join(resume_from or "", TOKENIZER_DIR)
    if name:
        flag = "--tokenizer_name" if args.tokenizer_name else "--model_name_or_path"
        tokenizer = from_pretrained_or_fail(partial(AutoTokenizer.from_pretrained, use_fast=True), name, flag)
        if not tokenizer.is_fast:
            fail(f"{name} has only a slow (Python) tokenizer; this script needs a fast one")
    elif resume_from and os.path.isdir(carried):  # the tokenizer the checkpoint was trained with
        tokenizer = AutoTokenizer.from_pretrained(carried)
    else:
        key = f"{dataset_fingerprint(raw['train'])}-{vocab_size}"
        path = os.path.join(args.cache_dir, f"tokenizer-bpe-{hashlib.sha256(key.encode()).hexdigest()[:12]}")
        texts = (batch[text_column] for batch in raw["train"].iter(batch_size=1000))
        with accelerator.main_process_first():
            cached_folder(path, lambda folder: train_bpe_tokenizer(texts, vocab_size).save_pretrained(folder),
                          f"a byte-level BPE tokenizer (vocab {vocab_size})", key)
            tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:  # collators and generation need one; never trained on (labels are masked)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def document_tokenizer(tokenizer: PreTrainedTokenizerBase, text_column: str,
                       train_file: str | None) -> Callable[[dict], dict]:
    """A batched map function: `text_column` -> token ids, EOS after each document (not between lines of a .txt)."""
    append_eos = tokenizer.eos_token_id is not None and not (train_file or "").endswith(".txt")

    def tokenize(batch: dict) -> dict:
        ids = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [tokenizer.eos_token_id] for x in ids] if append_eos else ids}

    return tokenize


def block_packer(block_size: int) -> Callable[[dict], dict]:
    """A batched map function: concatenate the batch's token ids into `block_size` blocks with labels (the tail
    shorter than a block is dropped, as Hugging Face's run_clm does)."""

    def pack(batch: dict) -> dict:
        flat = list(chain.from_iterable(batch["input_ids"]))
        usable = len(flat) // block_size * block_size
        blocks = [flat[i:i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    return pack


def tokenize_and_pack(accelerator: Accelerator, raw: DatasetDict, source: Source, tokenizer: PreTrainedTokenizerBase,
                      block_size: int, num_proc: int | None = None) -> DatasetDict:
    """Tokenize every row of `source`'s text column (EOS after each document) and concatenate into `block_size`
    blocks with labels, in `num_proc` processes.

    Runs on the main process first so the other processes load the result from the datasets cache.
    The tail shorter than a block in each map batch is dropped.
    """
    tokenize, pack = document_tokenizer(tokenizer, source.text_column, source.train_file), block_packer(block_size)
    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, num_proc=num_proc, remove_columns=raw["train"].column_names,
                            desc="Tokenizing")
        packed = tokenized.map(pack, batched=True, num_proc=num_proc, desc=f"Packing into blocks of {block_size}")
    for split in ("train", "validation"):
        if len(packed[split]) == 0:
            fail(f"the {split} split holds fewer than --block_size={block_size} tokens; use more data or a smaller"
                 " --block_size")
    return packed
