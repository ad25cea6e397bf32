"""Guarded resume and exported special tokens (scripts/pretrain_llama.py; the guard is shared by all the recipes).

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

from conftest import (ROOT, SCRIPTS, assert_each_damage_is_named, copy_checkpoints, damage, read_metrics, run_script,
                      skip_line, train_losses)

CONFIGS = os.path.join(ROOT, "accelerate_configs")
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-5  # per tensor, |a - b| / |b| (Frobenius): summation order differs between geometries


def launcher(num_processes: int) -> list[str]:
    config = "cpu_2proc.yaml" if num_processes == 2 else "cpu_1proc.yaml"
    return [ACCELERATE, "launch", "--config_file", os.path.join(CONFIGS, config), "--num_processes",
            str(num_processes), "--main_process_port", "0"]


def flags(corpus, cache, output_dir, per_device: int, accumulation: int, *extra: str) -> list[str]:
    """AdamW + cosine (the hyperparameters below are AdamW's; a Muon resume: test_muon.py)."""
    return ["--optim", "adamw_torch", "--lr_scheduler_type", "cosine", "--train_file", corpus["train"],
            "--validation_file", corpus["validation"], "--tokenizer_vocab_size", "512", "--block_size", "64",
            "--cache_dir", str(cache), "--output_dir", str(output_dir),
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


@pytest.mark.parametrize("before,after,damaged", [((2, 4, 1), (1, 4, 2), ("random_states_1.pkl", "missing")),
                                                ((1, 8, 1), (2, 2, 2), ("model.safetensors", "flipped"))],
                         ids=["2-to-1-processes", "1-to-2-processes"])
def test_other_process_count_with_the_same_global_batch_continues_exactly(corpus, runs, before, after, damaged,
                                                                           tmp_path):
    """(processes, per-device batch, accumulation) before and after the interruption at step 3; global batch 8.

    The interrupted run's newer checkpoint (step 6) is damaged: a rank's RNG file lost, or a byte of the weights
    flipped. `--resume_from_checkpoint auto` says so in one line and resumes step 3 (on 2 processes each checks a
    share of the files: both must agree); `latest` stops with one line naming the file.
    """
    name = f"{before[0]}to{after[0]}"
    first, resumed = runs / f"{name}-first", runs / f"{name}-resumed"
    run_script("pretrain_llama.py", *flags(corpus, runs / "cache", first, *before[1:]), launcher=launcher(before[0]))
    rng_files = sorted(p for p in os.listdir(first / "checkpoints" / "step_3") if p.startswith("random_states"))
    assert rng_files == [f"random_states_{i}.pkl" for i in range(before[0])]  # one per process that wrote it
    if before[0] == 2:  # every process's files are recorded, and each damage is named
        assert_each_damage_is_named(first / "checkpoints" / "step_3", "random_states_1.pkl", tmp_path)
    copy_checkpoints(first, resumed, 3, 6)
    damaged_checkpoint = resumed / "checkpoints" / "step_6"
    problem = damage(damaged_checkpoint, *damaged)
    resume_flags = flags(corpus, runs / "cache", resumed, *after[1:], "--resume_from_checkpoint")
    if after[0] == 2:
        proc = run_script("pretrain_llama.py", *resume_flags, "latest", launcher=launcher(2), check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert errors == [f"error: --resume_from_checkpoint latest: {damaged_checkpoint} is damaged: {problem}; "
                          "--resume_from_checkpoint auto resumes the newest checkpoint that verifies"], proc.stderr
        assert "exitcode  : 2" in proc.stderr and not (resumed / "metrics.jsonl").exists()
    proc = run_script("pretrain_llama.py", *resume_flags, "auto", launcher=launcher(after[0]))
    assert [line.split("WARNING common.checkpoint: ")[1] for line in proc.stderr.splitlines()
            if "Skipping checkpoint" in line] == [skip_line(damaged_checkpoint, problem)]
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

    from common.features.resume_guard import RunRecord, check_run_record

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
        launch = SimpleNamespace(num_processes=num_processes, distributed_type="MULTI_CPU", mixed_precision="no")
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
    from common.inputs.data import train_bpe_tokenizer

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
        f"run has other.jsonl ({os.path.getsize(other):,} bytes); to continue a pretraining checkpoint on other data "
        "(a second stage), add --new_data_mixture")
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
    from common.features.resume_guard import check_run_length

    with pytest.raises(SystemExit):
        check_run_length(str(runs / "reference" / "checkpoints" / "step_3"), 2)
    assert capsys.readouterr().err.strip() == (
        f"error: --resume_from_checkpoint {runs / 'reference' / 'checkpoints' / 'step_3'}: the checkpoint is at "
        "optimizer step 3, beyond this run's --max_steps 2: resume with --max_steps 3 or more")
    assert refused("--optim", "adafactor") == (
        "the checkpoint was trained with --optim adamw_torch, this run has --optim adafactor; its optimizer state only "
        "fits adamw_torch: resume with --optim adamw_torch")
    assert refused("--optim", "muon").startswith("the checkpoint was trained with --optim adamw_torch, this run has "
                                                 "--optim muon;")  # the other way: tests/test_muon.py
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


# ---- hyperparameters on resume: the flags' values apply from the checkpoint's step on ---------------------------

BASE_FLAGS = dict(learning_rate=3e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
                  lr_scheduler_type="cosine", warmup_steps=2, max_steps=8, optim="adamw_torch")
NEW_VALUES = {"learning_rate": 1e-4, "weight_decay": 0.5, "adam_beta1": 0.5, "adam_beta2": 0.9, "adam_epsilon": 1e-3,
              "lr_scheduler_type": "linear", "warmup_steps": 5, "max_steps": 12}


def schedule(learning_rate: float, kind: str, warmup: int, total: int, steps) -> list[float]:
    """The learning rate each of `steps` (1-based optimizer steps) uses on a fresh schedule with these values."""
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=learning_rate)
    fresh = get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    lrs = []
    for _ in range(max(steps)):
        lrs.append(fresh.get_last_lr()[0])
        optimizer.step()
        fresh.step()
    return [lrs[step - 1] for step in steps]


def reset_accelerate_state() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture()
def fresh_state():
    """In-process Accelerators: none is left behind for the next test."""
    yield
    reset_accelerate_state()


def build(values: dict, seed: int):
    """A fresh Accelerator with a tiny model (a decayed matrix and an undecayed bias), and the optimizer and schedule
    the scripts build from these flag values, prepared."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    from common.optim import create_optimizer_and_scheduler

    reset_accelerate_state()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(seed)
    model = torch.nn.Linear(6, 3)
    optimizer, scheduler = create_optimizer_and_scheduler(SimpleNamespace(**values), model, accelerator,
                                                          values["max_steps"])
    return (accelerator, *accelerator.prepare(model, optimizer, scheduler))


def train_steps(model, optimizer, scheduler, count: int) -> list[float]:
    """`count` optimizer steps on fixed data; the learning rate each one used."""
    x = torch.linspace(-1, 1, 24).reshape(4, 6)
    lrs = []
    for _ in range(count):
        lrs.append(scheduler.get_last_lr()[0])
        model(x).pow(2).mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return lrs


@pytest.fixture(scope="module")
def saved_at_step_3(tmp_path_factory):
    """BASE_FLAGS, 3 steps, saved (accelerate's save_state); then 3 more: the uninterrupted weights at step 6."""
    path = str(tmp_path_factory.mktemp("hyper") / "step_3")
    accelerator, model, optimizer, scheduler = build(BASE_FLAGS, seed=0)
    train_steps(model, optimizer, scheduler, 3)
    accelerator.save_state(path)
    train_steps(model, optimizer, scheduler, 3)
    reset_accelerate_state()
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}


def resumed(values: dict, path: str):
    from common.features.resume_guard import keep_this_runs_hyperparameters

    accelerator, model, optimizer, scheduler = build(values, seed=1)  # other initial weights: the load replaces them
    with keep_this_runs_hyperparameters(accelerator):
        accelerator.load_state(path)
    return model, optimizer, scheduler


@pytest.mark.usefixtures("fresh_state")
def test_an_unchanged_resume_continues_bit_for_bit(saved_at_step_3):
    path, uninterrupted = saved_at_step_3
    model, optimizer, scheduler = resumed(BASE_FLAGS, path)
    train_steps(model, optimizer, scheduler, 3)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in uninterrupted.items())


@pytest.mark.usefixtures("fresh_state")
@pytest.mark.parametrize("flag", sorted(NEW_VALUES))
def test_a_changed_flag_applies_from_the_checkpoint_step_with_its_moments(saved_at_step_3, flag):
    """Resumed at step 3 with one flag changed: each group holds the flag's value, the learning rate of steps 4-8 is
    the new schedule's exactly, and the next update is AdamW's with these values and the checkpoint's moments (a
    reference AdamW given the saved moments by hand). A plain `load_state` keeps the checkpoint's values."""
    path, _ = saved_at_step_3
    values = {**BASE_FLAGS, flag: NEW_VALUES[flag]}
    expected_lrs = schedule(values["learning_rate"], values["lr_scheduler_type"], values["warmup_steps"],
                            values["max_steps"], range(4, 9))
    model, optimizer, scheduler = resumed(values, path)
    decayed, undecayed = optimizer.param_groups
    assert (decayed["weight_decay"], undecayed["weight_decay"]) == (values["weight_decay"], 0.0)
    for group in (decayed, undecayed):
        assert group["betas"] == (values["adam_beta1"], values["adam_beta2"]) and group["eps"] == values["adam_epsilon"]
        assert group["lr"] == expected_lrs[0] and group["initial_lr"] == values["learning_rate"]

    saved = torch.load(os.path.join(path, "optimizer.bin"), weights_only=True)
    params = [p.detach().clone().requires_grad_() for p in (decayed["params"][0], undecayed["params"][0])]
    reference = torch.optim.AdamW([{"params": [params[0]], "weight_decay": values["weight_decay"]},
                                   {"params": [params[1]], "weight_decay": 0.0}], lr=expected_lrs[0],
                                  betas=(values["adam_beta1"], values["adam_beta2"]), eps=values["adam_epsilon"])
    for index, param in enumerate(params):
        reference.state[param] = {k: v.clone() for k, v in saved["state"][index].items()}
    x = torch.linspace(-1, 1, 24).reshape(4, 6)
    torch.nn.functional.linear(x, *params).pow(2).mean().backward()
    reference.step()
    lrs = train_steps(model, optimizer, scheduler, 1)
    assert torch.equal(model.weight, params[0]) and torch.equal(model.bias, params[1])
    assert lrs + train_steps(model, optimizer, scheduler, 4) == expected_lrs

    accelerator, *_ = build(values, seed=1)  # the trap: load_state alone restores the checkpoint's settings
    accelerator.load_state(path)
    restored = accelerator._optimizers[0].param_groups[0]
    assert (restored["weight_decay"], restored["betas"], restored["eps"], restored["initial_lr"]) == (
        BASE_FLAGS["weight_decay"], (BASE_FLAGS["adam_beta1"], BASE_FLAGS["adam_beta2"]), BASE_FLAGS["adam_epsilon"],
        BASE_FLAGS["learning_rate"])


def test_deepspeed_gradient_clipping_restored_from_a_checkpoint_is_put_back():
    """DeepSpeed ZeRO-1/2 restore `clip_grad` (the JSON's gradient_clipping, from --max_grad_norm) from the
    checkpoint: a stand-in optimizer whose load does the same keeps this run's value."""
    from types import SimpleNamespace

    from common.features.resume_guard import keep_this_runs_hyperparameters

    zero = SimpleNamespace(clip_grad=0.5, param_groups=[{"weight_decay": 0.0, "lr": 1.0}])
    accelerator = SimpleNamespace(_optimizers=[SimpleNamespace(optimizer=zero)], _schedulers=[])
    with keep_this_runs_hyperparameters(accelerator):
        zero.clip_grad, zero.param_groups[0]["weight_decay"] = 1.0, 0.1  # what the checkpoint held
    assert zero.clip_grad == 0.5 and zero.param_groups[0]["weight_decay"] == 0.0


def test_new_hyperparameters_through_the_script(corpus, runs):
    """Resume the reference's step-3 checkpoint (cosine, peak 3e-3, 6 steps) with every hyperparameter changed: one
    line names them, the learning rate logged at steps 4-8 is the new schedule's exactly, and the checkpoint the
    resumed run saves at step 6 holds the new optimizer settings and peak."""
    out = runs / "new-hyperparameters"
    resume_from(runs / "reference", 3, out)
    changed = {"--learning_rate": "1e-3", "--lr_scheduler_type": "linear", "--warmup_steps": "5", "--max_steps": "8",
               "--weight_decay": "0.01", "--adam_beta1": "0.8", "--adam_beta2": "0.99", "--adam_epsilon": "1e-6",
               "--max_grad_norm": "0.5"}
    argv = flags(corpus, runs / "cache", out, 4, 2, "--resume_from_checkpoint", "latest")
    for flag, value in changed.items():
        argv += [flag, value]  # argparse keeps the last value of a flag given twice
    proc = run_script("pretrain_llama.py", *argv)
    line = next(line for line in proc.stderr.splitlines() if "with new hyperparameters" in line)
    assert line.split("WARNING common.features.resume_guard: [RANK 0] ")[1] == (
        f"Resuming {out / 'checkpoints' / 'step_3'} with new hyperparameters: --learning_rate 0.001 (was 0.003), "
        "--lr_scheduler_type linear (was cosine), --warmup_steps 5 (was None), --max_steps 8 (was 6), "
        "--weight_decay 0.01 (was 0.1), --adam_beta1 0.8 (was 0.9), --adam_beta2 0.99 (was 0.95), --adam_epsilon "
        "1e-06 (was 1e-08), --max_grad_norm 0.5 (was 1.0); the learning-rate schedule is this run's from the "
        "checkpoint's step on, the optimizer's moments are the checkpoint's")
    logged = {r["step"]: r["lr"] for r in read_metrics(out) if "lr" in r}
    assert sorted(logged) == [4, 5, 6, 7, 8]
    assert [logged[s] for s in range(4, 9)] == schedule(1e-3, "linear", 5, 8, range(4, 9))
    checkpoint = out / "checkpoints" / "step_6"
    groups = torch.load(checkpoint / "optimizer.bin", weights_only=True)["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    assert all(g["betas"] == (0.8, 0.99) and g["eps"] == 1e-6 and g["initial_lr"] == 1e-3 for g in groups)
    assert torch.load(checkpoint / "scheduler.bin", weights_only=False)["base_lrs"] == [1e-3, 1e-3]
    assert json.loads((checkpoint / "run.json").read_text())["hyperparameters"]["max_grad_norm"] == 0.5


def test_an_epoch_length_that_the_accumulation_changes_is_refused_saying_why(capsys, corpus, runs):
    """The same global batch cut with other accumulation steps: an epoch whose last global batch is partial can gain
    or lose that step (a trailing partial accumulation window is dropped), so the epoch's step count differs and the
    resume is refused. The line said only "the data or the way per-device batch x accumulation cuts it differs"; it
    now says why and which accumulation steps resume."""
    from torch.utils.data import DataLoader

    from common.steps import count_optimizer_steps

    def steps_per_epoch(blocks: int, per_device: int, accumulation: int, processes: int, drop_last=False) -> int:
        loader = DataLoader(range(blocks), batch_size=per_device, drop_last=drop_last)
        return count_optimizer_steps(loader, accumulation, processes, 0, 1)[0]

    # docs/fault-tolerance.md's example, global batch 4: only the accumulation steps decide the epoch's length
    assert steps_per_epoch(1393, 4, 1, 1) == steps_per_epoch(1393, 2, 1, 2) == steps_per_epoch(1393, 1, 1, 4) == 349
    assert steps_per_epoch(1393, 2, 2, 1) == steps_per_epoch(1393, 1, 2, 2) == 348
    assert steps_per_epoch(1393, 4, 1, 1, True) == steps_per_epoch(1393, 2, 2, 1, True) == 348  # the classifier's
    saved = json.loads((runs / "reference" / "checkpoints" / "step_3" / "run.json").read_text())["steps_per_epoch"]
    assert guard_error(capsys, corpus, runs, "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",
                       steps_per_epoch=saved + 1) == (
        f"an epoch of the checkpoint's run has {saved} optimizer steps, this run's has {saved + 1}: the epoch does not "
        "end on a whole global batch, and whether its last, partial one makes a step depends on the accumulation "
        "steps (2 in the checkpoint, 1 now); resume with --gradient_accumulation_steps 2 (the per-device batch and "
        "the process count may change if the global batch stays 8)")


def test_another_precision_on_resume_is_one_warning_line(corpus, runs):
    """`--bf16` on the fp32 reference's step-3 checkpoint was accepted without a word. It still is, with one line."""
    out = runs / "bf16-resumed"
    resume_from(runs / "reference", 3, out)
    checkpoint = out / "checkpoints" / "step_3"
    assert json.loads((checkpoint / "run.json").read_text())["mixed_precision"] == "no"
    proc = run_script("pretrain_llama.py", *flags(corpus, runs / "cache", out, 4, 2, "--resume_from_checkpoint",
                                                  "latest", "--bf16"))
    lines = [line.split("WARNING common.features.resume_guard: [RANK 0] ")[1] for line in proc.stderr.splitlines()
             if "WARNING common.features.resume_guard" in line]
    assert lines == [f"Resuming {checkpoint} in bf16 mixed precision; the checkpoint was trained in fp32: the run goes "
                     "on from the checkpoint's state, but its losses will not continue the fp32 run's exactly"]
    assert json.loads((out / "checkpoints" / "step_6" / "run.json").read_text())["mixed_precision"] == "bf16"
