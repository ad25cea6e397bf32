"""Guarded resume and exported special tokens (scripts/pretrain_llama.py; the guard is shared by all three scripts).

- A checkpoint records what continuing it needs (run.json) and carries its tokenizer; a resume that would see other
  data, cut or ordered otherwise, another tokenizer or model, or another global batch stops with one line naming the
  difference, before any heavy work where the flags show it.
- The process count, per-device batch and accumulation may change when the global batch stays: 2 -> 1 and 1 -> 2
  processes (DDP over gloo) continue with the uninterrupted run's losses (relative 1e-5) and weights (1e-5). Both
  also change the accumulation steps, whose sync points accelerate would otherwise restore from the checkpoint.
- A checkpoint taken at the last step resumes to no extra step.
- The export names the tokenizer's special tokens, so generation stops at `<|endoftext|>` (id 0), not at LlamaConfig's
  default EOS id 2.
All runs: global batch 8 blocks of 64 tokens, 6 optimizer steps, checkpoints at steps 3 and 6, fp32.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, SCRIPTS, read_metrics, run_script, train_losses

CONFIGS = os.path.join(ROOT, "accelerate_configs")
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-5  # per tensor, |a - b| / |b| (Frobenius): summation order differs between geometries


def launcher(num_processes: int) -> list[str]:
    config = "cpu_2proc.yaml" if num_processes == 2 else "cpu_1proc.yaml"
    return [ACCELERATE, "launch", "--config_file", os.path.join(CONFIGS, config), "--num_processes",
            str(num_processes), "--main_process_port", "0"]


def flags(corpus, cache, output_dir, per_device: int, accumulation: int, *extra: str) -> list[str]:
    return ["--train_file", corpus["train"], "--validation_file", corpus["validation"], "--tokenizer_vocab_size",
            "512", "--block_size", "64", "--cache_dir", str(cache), "--output_dir", str(output_dir),
            "--max_steps", "6", "--checkpointing_steps", "3", "--logging_steps", "1", "--learning_rate", "3e-3",
            "--max_eval_samples", "16", "--sample_max_new_tokens", "0", "--mixed_precision", "no",
            "--per_device_train_batch_size", str(per_device), "--gradient_accumulation_steps", str(accumulation),
            *extra]


def weights(output_dir) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(output_dir, "model.safetensors"))


def relative_weight_difference(a, b) -> float:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return max((torch.linalg.norm(wa[k] - wb[k]) / torch.linalg.norm(wb[k])).item() for k in wa)


def resume_from(source, step: int, target) -> None:
    """A fresh output folder whose only state is `source`'s checkpoint at `step` (the interrupted run)."""
    shutil.copytree(os.path.join(source, "checkpoints", f"step_{step}"),
                    os.path.join(target, "checkpoints", f"step_{step}"))


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """The uninterrupted run: one process, 4 blocks x 2 accumulation steps."""
    root = tmp_path_factory.mktemp("resume-guard")
    run_script("pretrain_llama.py", *flags(corpus, root / "cache", root / "reference", 4, 2))
    return root


def test_checkpoint_records_the_run_and_carries_its_tokenizer(runs):
    from transformers import AutoTokenizer

    checkpoint = runs / "reference" / "checkpoints" / "step_3"
    record = json.loads((checkpoint / "run.json").read_text())
    assert record["global_batch"] == {"sequences": 8, "per_device": 4, "accumulation": 2, "processes": 1}
    assert record["block_size"] == 64 and record["seed"] == 42 and record["script"] == "pretrain_llama"
    assert record["train_file"]["name"] == "train.jsonl" and record["steps_per_epoch"] > 6
    assert record["model"]["hidden_size"] == 128 and len(record["tokenizer"]) == 16
    carried = AutoTokenizer.from_pretrained(checkpoint / "tokenizer")
    exported = AutoTokenizer.from_pretrained(runs / "reference")
    assert carried.get_vocab() == exported.get_vocab()


def test_final_step_checkpoint_resumes_to_no_extra_step(corpus, runs):
    resumed = runs / "final-resumed"
    resume_from(runs / "reference", 6, resumed)
    run_script("pretrain_llama.py", *flags(corpus, runs / "cache", resumed, 4, 2, "--resume_from_checkpoint",
                                           "latest"))
    assert json.loads((resumed / "all_results.json").read_text())["train_steps"] == 6
    assert train_losses(resumed) == {}  # no optimizer step was taken
    assert relative_weight_difference(resumed, runs / "reference") == 0.0


@pytest.mark.parametrize("before,after", [((2, 4, 1), (1, 4, 2)), ((1, 8, 1), (2, 2, 2))],
                         ids=["2-to-1-processes", "1-to-2-processes"])
def test_other_process_count_with_the_same_global_batch_continues_exactly(corpus, runs, before, after):
    """(processes, per-device batch, accumulation) before and after the interruption at step 3; global batch 8."""
    name = f"{before[0]}to{after[0]}"
    first, resumed = runs / f"{name}-first", runs / f"{name}-resumed"
    run_script("pretrain_llama.py", *flags(corpus, runs / "cache", first, *before[1:]), launcher=launcher(before[0]))
    rng_files = sorted(p for p in os.listdir(first / "checkpoints" / "step_3") if p.startswith("random_states"))
    assert rng_files == [f"random_states_{i}.pkl" for i in range(before[0])]  # one per process that wrote it
    resume_from(first, 3, resumed)
    run_script("pretrain_llama.py", *flags(corpus, runs / "cache", resumed, *after[1:], "--resume_from_checkpoint",
                                           "latest"), launcher=launcher(after[0]))
    reference, again = train_losses(runs / "reference"), train_losses(resumed)
    assert sorted(again) == [4, 5, 6]
    assert [again[s] for s in again] == pytest.approx([reference[s] for s in again], rel=LOSS_RTOL)
    difference = relative_weight_difference(resumed, runs / "reference")
    print(f"{name}: max |loss difference| {max(abs(again[s] - reference[s]) for s in again):.1e}, "
          f"max relative weight difference {difference:.1e}")
    assert difference <= WEIGHT_RTOL


def load_pretrain_module():
    spec = importlib.util.spec_from_file_location("pretrain_llama", os.path.join(SCRIPTS, "pretrain_llama.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def guard_error(capsys, corpus, runs, *changed: str, num_processes: int = 1, script: str = "pretrain_llama",
                tokenizer=None, steps_per_epoch: int | None = None) -> str | None:
    """Check a resume of the reference's step-3 checkpoint in-process as the script does: its flags when the run
    starts, then the tokenizer and the epoch length once the data is loaded (the checkpoint's own unless given).
    The error, or None."""
    from transformers import AutoTokenizer

    from types import SimpleNamespace

    from common.run_record import RunRecord, check_run_record

    pretrain = load_pretrain_module()
    checkpoint = runs / "reference" / "checkpoints" / "step_3"
    argv = flags(corpus, runs / "cache", runs / "guard", 4, 2, "--resume_from_checkpoint", str(checkpoint))
    for flag, value in zip(changed[::2], changed[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    args = pretrain.parse_args(argv)
    try:
        launch = SimpleNamespace(num_processes=num_processes, distributed_type="MULTI_CPU")
        run = RunRecord(args, script, launch, pretrain.load_config(args), pretrain.data_flags(args), None)
        saved = json.loads((checkpoint / "run.json").read_text())
        run.add_data(tokenizer or AutoTokenizer.from_pretrained(checkpoint / "tokenizer"),
                     steps_per_epoch or saved["steps_per_epoch"])
        check_run_record(str(checkpoint), run.fields)
    except SystemExit as exc:
        assert exc.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert err.startswith(f"error: --resume_from_checkpoint {checkpoint}: ")
        return err.split(f"{checkpoint}: ", 1)[1]
    return None


def test_a_resume_that_would_train_differently_is_refused_with_one_line(capsys, corpus, runs, tmp_path):
    from common.data import train_bpe_tokenizer

    def refused(*changed, **kwargs):
        return guard_error(capsys, corpus, runs, *changed, **kwargs)

    assert refused("--per_device_train_batch_size", "8") == (
        "the checkpoint was trained with global batch 8 (4 x 2 x 1 process), this run has 16 (8 x 2 x 1 process); "
        "keep per-device batch x accumulation x processes equal to the checkpoint's")
    assert refused(num_processes=2).startswith("the checkpoint was trained with global batch 8 (4 x 2 x 1 process), "
                                               "this run has 16 (4 x 2 x 2 processes)")
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "another corpus entirely"}\n' * 50)
    assert refused("--train_file", str(other)) == (
        f"the checkpoint was trained on --train_file train.jsonl ({os.path.getsize(corpus['train']):,} bytes), this "
        f"run has other.jsonl ({os.path.getsize(other):,} bytes)")
    assert refused("--block_size", "32") == ("the checkpoint was trained with --block_size 64, this run has "
                                             "--block_size 32")
    assert refused("--seed", "7") == "the checkpoint was trained with --seed 42, this run has --seed 7"
    assert refused("--tokenizer_vocab_size", "1024") == ("the checkpoint was trained with --tokenizer_vocab_size 512, "
                                                         "this run has --tokenizer_vocab_size 1024")
    assert refused("--model_preset", "small").startswith("the checkpoint holds another model (hidden_size 128 vs 256")
    assert refused(script="finetune_causal_lm") == ("the checkpoint was written by pretrain_llama, not by "
                                                    "finetune_causal_lm")
    another_tokenizer = train_bpe_tokenizer(["some other text to learn from"] * 20, vocab_size=300)
    assert refused(tokenizer=another_tokenizer).startswith("this run's tokenizer differs from the one the checkpoint "
                                                           "was trained with")
    assert refused(steps_per_epoch=5).startswith("an epoch of the checkpoint's run has")
    # The same global batch cut otherwise, and a run that only goes on for longer, continue.
    assert refused("--per_device_train_batch_size", "2", num_processes=2) is None
    assert refused("--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1", "--max_steps", "9") \
        is None


def test_refused_before_any_heavy_work(corpus, runs):
    """Through the script: the one line comes before the data is tokenized or the model built; nothing is written."""
    out = runs / "refused"
    proc = run_script("pretrain_llama.py", *flags(corpus, runs / "cache", out, 8, 2, "--resume_from_checkpoint",
                                                  str(runs / "reference" / "checkpoints" / "step_3")), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"error: --resume_from_checkpoint {runs / 'reference' / 'checkpoints' / 'step_3'}: the checkpoint was trained "
        "with global batch 8 (4 x 2 x 1 process), this run has 16 (8 x 2 x 1 process)")
    assert "Tokenizing" not in proc.stderr and not out.exists()


def test_export_names_the_tokenizer_special_tokens_and_generation_stops_at_end_of_text(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    out = runs / "reference"
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) == \
        ("<|endoftext|>", 0, 0, 1)
    for name in ("config.json", "generation_config.json"):
        saved = json.loads((out / name).read_text())
        assert (saved["eos_token_id"], saved["bos_token_id"], saved["pad_token_id"]) == (0, 0, 1), name

    class EndAfter(LogitsProcessor):
        """Make the model choose `<|endoftext|>` as its third new token."""

        def __init__(self, prompt_length: int) -> None:
            self.position = prompt_length + 2

        def __call__(self, input_ids, scores):
            if input_ids.shape[1] == self.position:
                scores[:, :] = -float("inf")
                scores[:, tokenizer.eos_token_id] = 0.0
            return scores

    model = AutoModelForCausalLM.from_pretrained(out)  # with the exported generation_config.json
    inputs = tokenizer("the model reads", return_tensors="pt")
    prompt_length = inputs["input_ids"].shape[1]
    out_ids = model.generate(**inputs, max_new_tokens=20, do_sample=False,
                             logits_processor=LogitsProcessorList([EndAfter(prompt_length)]))
    assert out_ids.shape[1] == prompt_length + 3 and out_ids[0, -1].item() == tokenizer.eos_token_id
    assert read_metrics(out)[-1]["step"] == 6
