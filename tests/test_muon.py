"""--optim muon (common/features/muon.py) and --lr_scheduler_type warmup_stable_decay (common/features/wsd.py).

In process: Muon's update on a matrix equals a transcription of its definition (torch.optim.Muon's: momentum as a
lerp, Nesterov, 5 Newton-Schulz steps with Keller Jordan's coefficients, the learning-rate adjustment, decoupled weight
decay) to 1e-6, and the other parameters get torch's fused AdamW update exactly; the WSD learning rate at every step
equals its definition, for each decay shape.

Pretraining runs, Muon + WSD, attention dropout on (`dropout_config`), checkpoints every 2 steps:
- a 6-step run and a 4-step run (the decay: their last half); each logged learning rate is the definition's;
- the 6-step run's step-2 checkpoint branched into a new --output_dir with --max_steps 4 ends with the 4-step run's
  weights (0.0): a decay branched from the stable phase;
- the 4-step run's stable-phase checkpoint (step 2) resumed with --max_steps 6 (the resume says in one line that the
  stable phase stretches), SIGKILLed after a random number of steps and restarted (`auto`), ends with the 6-step run's
  weights (0.0): Muon's momentum buffers and AdamW's moments are saved and restored exactly.
fp32, the same global batch of 8 from one saved tiny model: 1 process x 8, 1 x 1 with 8 accumulation steps, 2
processes x 4 under DDP and FSDP2, and FSDP2 (2) x TP (2) on 4 processes end with the same weights (1e-5 relative;
Newton-Schulz runs in fp32 on CPU; under FSDP2 and TP each matrix is gathered and orthogonalized whole).
DeepSpeed's own ZeRO Muon, from the same flags (its groups give `match_rms_adamw`'s step sizes; clipping off): one
process x 8 under ZeRO-2 moves the matrices as ours does (7 %: its bf16 Newton-Schulz; the `original` scaling: 63 %);
2 processes x 4 under ZeRO-1, ZeRO-2 and ZeRO-3 log its losses (1e-5) and end with its weights (1e-3); the ZeRO-1 and
ZeRO-2 runs resumed from their step-2 checkpoints end with their weights exactly.
Kill and resume, attention dropout on: under DDP with async checkpoints, FSDP2, FSDP2 x TP and ZeRO-3, a run SIGKILLed
on every process after a drawn step and started again ends with the uninterrupted run's weights (0.0) and metric rows,
its checkpoints holding Muon's momentum for every matrix element.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, copy_checkpoints, launcher, read_metrics, run_script
from forked_runs import start_launched
from test_crash_safety import pretrain_command, rows_since, sigkill, start, wait_for, weights_diff
from test_distributed import exported_weights, init_model  # noqa: F401  (fixture)
from test_tensor_parallel import strip

from common.features.muon import create_muon_optimizer


def flags(**overrides) -> SimpleNamespace:
    values = dict(optim="muon", learning_rate=2e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                  adam_epsilon=1e-8, muon_momentum=0.95, muon_nesterov=True, muon_ns_steps=5,
                  muon_adjust_lr_fn="match_rms_adamw", muon_learning_rate=None, lr_scheduler_type="linear",
                  warmup_steps=0)
    return SimpleNamespace(**{**values, **overrides})


class Tiny(torch.nn.Module):
    """An embedding (AdamW, decayed), a tall and a wide hidden matrix (Muon), a bias (AdamW, not decayed), a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(11, 6)
        self.up = torch.nn.Linear(6, 10)
        self.down = torch.nn.Linear(10, 6, bias=False)
        self.head = torch.nn.Linear(6, 11, bias=False)

    def get_output_embeddings(self):
        return self.head

    def forward(self, ids):
        return self.head(self.down(torch.tanh(self.up(self.embed(ids))))).logsumexp(-1).mean()


def definition(weight, grads, lr, weight_decay, momentum, nesterov, ns_steps, adjust_lr_fn):
    """torch.optim.Muon's update rule written out for one matrix over several steps (Newton-Schulz in float64)."""
    w, buf = weight.double().clone(), torch.zeros_like(weight, dtype=torch.float64)
    a, b, c = 3.4445, -4.775, 2.0315
    for g in grads:
        g = g.double()
        buf = momentum * buf + (1 - momentum) * g
        u = (1 - momentum) * g + momentum * buf if nesterov else buf
        x = u.T if u.shape[0] > u.shape[1] else u
        x = x / max(x.norm().item(), 1e-7)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        o = x.T if u.shape[0] > u.shape[1] else x
        rows, cols = weight.shape
        scale = (0.2 * math.sqrt(max(rows, cols)) if adjust_lr_fn == "match_rms_adamw" else
                 math.sqrt(max(1, rows / cols)))
        w = w * (1 - lr * weight_decay) - lr * scale * o
    return w, buf


@pytest.mark.parametrize("adjust_lr_fn,nesterov", [("match_rms_adamw", True), ("original", False)])
def test_muon_update_is_the_definition_and_the_rest_get_adamw(adjust_lr_fn, nesterov):
    model, twin = Tiny(), Tiny()
    optimizer = create_muon_optimizer(flags(muon_adjust_lr_fn=adjust_lr_fn, muon_nesterov=nesterov), model)
    assert [(g["use_muon"], len(g["params"]), g["weight_decay"]) for g in optimizer.param_groups] == \
        [(True, 2, 0.1), (False, 2, 0.1), (False, 1, 0.0)]  # up/down; embed/head; the bias
    adamw = torch.optim.AdamW([{"params": [twin.embed.weight, twin.head.weight], "weight_decay": 0.1},
                               {"params": [twin.up.bias], "weight_decay": 0.0}], lr=2e-2, betas=(0.9, 0.95),
                              eps=1e-8, fused=True)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = {"up.weight": [], "down.weight": []}
    for step in range(3):
        ids = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(step))
        for m, opt in ((model, optimizer), (twin, adamw)):
            m(ids).backward()
            if m is model:
                for name in grads:
                    grads[name].append(m.get_parameter(name).grad.clone())
            opt.step()
            opt.zero_grad()
        with torch.no_grad():  # the twin's matrices follow Muon's: its AdamW parameters see the same gradients
            twin.up.weight.copy_(model.up.weight)
            twin.down.weight.copy_(model.down.weight)
    for name in grads:
        want, want_buf = definition(start[name], grads[name], 2e-2, 0.1, 0.95, nesterov, 5, adjust_lr_fn)
        got = model.get_parameter(name)
        assert (got.double() - want).abs().max().item() < 1e-6, name
        assert (optimizer.state[got]["momentum_buffer"].double() - want_buf).abs().max().item() < 1e-6, name
    for name in ("embed.weight", "head.weight", "up.bias"):  # AdamW's update exactly, with its state
        assert torch.equal(model.get_parameter(name), twin.get_parameter(name)), name
    state = optimizer.state_dict()["state"]
    assert sorted(len(s) for s in state.values()) == [1, 1, 3, 3, 3]  # a momentum buffer; step and two moments


@pytest.mark.parametrize("decay_type", ["1-sqrt", "linear", "cosine"])
def test_wsd_learning_rate_is_the_definition(decay_type):
    from accelerate import Accelerator

    from common.features.wsd import wsd_schedule
    from common.optim import create_optimizer_and_scheduler

    args = flags(optim="adamw_torch", lr_scheduler_type="warmup_stable_decay", warmup_steps=3, lr_decay_ratio=0.3,
                 lr_decay_type=decay_type, min_lr_ratio=0.1, learning_rate=1.0)
    total = 20  # warmup 0-2, stable 3-13, decay 14-19 (round(0.3 * 20) = 6 steps)
    _, scheduler = create_optimizer_and_scheduler(args, torch.nn.Linear(2, 2), Accelerator(cpu=True), total,
                                                  schedule_kwargs=wsd_schedule(args, total))
    shape = {"1-sqrt": lambda x: 1 - math.sqrt(x), "linear": lambda x: 1 - x,
             "cosine": lambda x: 0.5 * (1 + math.cos(math.pi * x))}[decay_type]
    for step in range(total + 2):
        if step < 3:
            want = 0.1 + 0.9 * step / 3
        elif step < 14:
            want = 1.0
        else:
            want = 0.1 + 0.9 * shape((step - 14) / 6) if step < 20 else 0.1
        assert scheduler.get_last_lr()[0] == pytest.approx(want, abs=1e-12), step
        scheduler.optimizer.step()
        scheduler.step()


# ---- pretraining runs -------------------------------------------------------------------------------------------
WSD_FLAGS = ("--optim", "muon", "--lr_scheduler_type", "warmup_stable_decay", "--warmup_steps", "1",
             "--lr_decay_ratio", "0.5", "--checkpointing_steps", "2", "--save_total_limit", "5", "--max_train_samples",
             "40", "--max_eval_samples", "4", "--eval_steps", "100")


@pytest.fixture(scope="module")
def wsd_runs(corpus, dropout_config, tmp_path_factory):
    d = tmp_path_factory.mktemp("wsd")

    def command(out, steps, *extra):
        return pretrain_command(corpus, d / "cache", d / out, *WSD_FLAGS, "--config_name", dropout_config,
                                "--max_steps", str(steps), *extra)

    def run(out, steps, *extra):
        return run_script("pretrain_llama.py", *command(out, steps, *extra)[2:])

    run("six", 6)
    run("four", 4)
    run("branch", 4, "--resume_from_checkpoint", str(d / "six" / "checkpoints" / "step_2"))
    # The 4-step run's stable-phase checkpoint resumed with --max_steps 6, SIGKILLed after a drawn number of rows
    # (from step 3 on: its next checkpoint may or may not be written), and started again with the same command.
    copy_checkpoints(d / "four", d / "longer", 2)
    began, cmd, log = time.time(), command("longer", 6, "--resume_from_checkpoint", "auto"), str(d / "longer.log")
    proc = start(cmd, log)
    rows = random.Random(56).randint(1, 3)
    assert wait_for(proc, lambda: len(rows_since(d / "longer", began)) >= rows), open(log).read()[-3000:]
    sigkill(proc)
    assert start(cmd, log).wait(timeout=600) == 0, open(log).read()[-3000:]
    with open(log) as f:
        return d, f.read(), rows


def wsd_lr(step: int, total: int, peak: float = 3e-3) -> float:
    """The rate the row of optimizer step `step` used (the schedule at step - 1): warmup 1, decay the last half,
    1-sqrt down to 0."""
    s, start = step - 1, total - round(0.5 * total)
    return peak * (0.0 if s < 1 else 1.0 if s < start else 1 - math.sqrt((s - start) / round(0.5 * total)))


def test_wsd_runs_stretch_branch_and_survive_a_kill(wsd_runs):
    d, longer_log, kill_rows = wsd_runs
    for name, total in (("six", 6), ("four", 4)):
        rows = [r for r in read_metrics(str(d / name)) if "loss" in r]
        assert [r["step"] for r in rows] == list(range(1, total + 1))
        for r in rows:
            assert r["lr"] == pytest.approx(wsd_lr(r["step"], total), rel=1e-12, abs=1e-15), (name, r["step"])
    assert "in its stable phase; this run decays over steps 3-6" in longer_log
    # stable phase stretched, killed and resumed = planned 6 from the start
    assert weights_diff(d / "longer", d / "six") == 0.0, f"killed after {kill_rows} rows"
    assert weights_diff(d / "branch", d / "four") == 0.0  # decay branched at step 2 = planned 4 from the start


@pytest.fixture(scope="module")
def parity_runs(corpus, init_model, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("muon_parity")

    def run(name, per_device, accumulation, config="cpu_1proc.yaml", processes=1, *extra):
        run_script("pretrain_llama.py", "--model_name_or_path", init_model, "--train_file", corpus["train"],
                   "--validation_file", corpus["validation"], "--block_size", "64", "--cache_dir", str(d / "cache"),
                   "--output_dir", str(d / name), "--max_steps", "3", "--logging_steps", "1", "--optim", "muon",
                   "--per_device_train_batch_size", str(per_device), "--gradient_accumulation_steps",
                   str(accumulation), "--mixed_precision", "no", "--learning_rate", "1e-2", "--max_eval_samples", "4",
                   "--sample_max_new_tokens", "0", "--adam_epsilon", "1e-6", *extra,
                   launcher=[*launcher(config, processes), "--mixed_precision", "no"])
        return exported_weights(d / name)

    # AdamW's epsilon 1e-6 (test_tensor_parallel.py says why: at 1e-8 fp32 summation noise of TP's other reduction
    # order moves elements with tiny gradients by ~2e-5 relative, in AdamW's parameters, not in Muon's).
    return {"one": run("one", 8, 1), "unclipped": run("unclipped", 8, 1, "cpu_1proc.yaml", 1, "--max_grad_norm", "0",
                                                               "--learning_rate", "1e-3"),
            "accumulated": run("accumulated", 1, 8), "ddp": run("ddp", 4, 1, "cpu_2proc.yaml",
            2), "fsdp2": run("fsdp2", 4, 1, "fsdp2.yaml", 2), "fsdp2_tp": run("fsdp2_tp", 4, 1, "fsdp2_tp.yaml", 4)}


@pytest.mark.parametrize("name", ["accumulated", "ddp", "fsdp2", "fsdp2_tp"])
def test_muon_accumulation_and_two_processes_equal_one_big_batch(parity_runs, name):
    one, other = parity_runs["one"], parity_runs[name]
    errors = {k: (torch.linalg.norm(other[k] - v) / torch.linalg.norm(v)).item() for k, v in one.items()}
    worst = max(errors, key=errors.get)
    print(f"{name}: max relative weight difference {errors[worst]:.1e} ({worst})")
    assert errors[worst] <= 1e-5, f"{worst}: {errors[worst]:.1e}"


def test_the_memory_estimate_keeps_one_momentum_buffer_per_muon_matrix():
    """tools/estimate_memory.py: Muon's matrices hold 4 bytes of state, not AdamW's 8 (the rest keeps 8), on one GPU
    and sharded over FSDP2's processes."""
    from tools import estimate_memory

    recipe = ["scripts/pretrain_llama.py", "--model_preset", "1b", "--bf16"]
    fsdp2 = ["accelerate", "launch", "--config_file", "accelerate_configs/fsdp2.yaml", "--num_processes", "8"]
    shape = estimate_memory.model_shape(SimpleNamespace(params=None, config_name=None, model_preset="1b",
                                                        vocab_size=8192))
    for launch, key, processes in (([], "optimizer states", 1), (fsdp2, "model states (FSDP2 full shard, 8 GPUs)", 8)):
        adamw, muon = (estimate_memory.command_answer(launch + recipe + ["--optim", optim], 80)["parts"][key]
                       for optim in ("adamw_torch_fused", "muon"))
        assert adamw - muon == pytest.approx(4 * shape.linear / processes, rel=1e-6), launch


def test_muon_where_it_does_not_apply_is_one_line(capsys, monkeypatch, tmp_path):
    """The fine-tuning recipes do not offer it (argparse's one line); under DeepSpeed, whose ZeRO Muon has Nesterov
    momentum and 5 Newton-Schulz steps built in, other values are refused before any work, and clipping (which
    DeepSpeed would apply to the orthogonalized update) is turned off in one line."""
    from test_bad_inputs import load_script, one_line_error, pretrain

    with pytest.raises(SystemExit) as exc:
        load_script("finetune_causal_lm").parse_args(["--optim", "muon", "--output_dir", str(tmp_path / "sft")])
    assert exc.value.code == 2 and "argument --optim: invalid choice: 'muon'" in capsys.readouterr().err
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert "keep --muon_nesterov true and --muon_ns_steps 5" in one_line_error(
        capsys, ["--muon_ns_steps", "3", "--output_dir", str(tmp_path / "out")])
    assert pretrain.parse_args(["--output_dir", str(tmp_path / "ds")]).max_grad_norm == 0.0
    assert capsys.readouterr().out.startswith("--optim muon under DeepSpeed: no gradient clipping (--max_grad_norm")


@pytest.fixture(scope="module")
def zero_muon_runs(corpus, init_model, tmp_path_factory):  # noqa: F811
    """DeepSpeed's own ZeRO Muon (`--optim muon`, the default scaling `match_rms_adamw` through its groups), fp32, 3
    steps, global batch 8: one process x 8 under ZeRO-2 (the reference: DeepSpeed's Muon too), 2 processes x 4 under
    ZeRO-1, ZeRO-2 and ZeRO-3, and the ZeRO-1 and ZeRO-2 runs' step-2 checkpoints resumed (the same command, in a copy).
    Eager (`eager_deepspeed`)."""
    d = tmp_path_factory.mktemp("zero_muon")

    def run(name, config, processes, per_device, *extra):
        run_script("pretrain_llama.py", "--model_name_or_path", init_model, "--train_file", corpus["train"],
                   "--validation_file", corpus["validation"], "--block_size", "64", "--cache_dir", str(d / "cache"),
                   "--output_dir", str(d / name), "--max_steps", "3", "--logging_steps", "1", "--optim", "muon",
                   "--per_device_train_batch_size", str(per_device),
                   "--learning_rate", "1e-3", "--adam_epsilon", "1e-6", "--max_eval_samples", "4",
                   "--sample_max_new_tokens", "0", *extra, launcher=launcher(config, processes))
        losses = {r["step"]: r["loss"] for r in read_metrics(str(d / name)) if "loss" in r}
        return losses, exported_weights(d / name)

    runs = {}
    with eager_deepspeed():
        runs["one"] = run("one", "deepspeed_zero2.yaml", 1, 8)
        runs["zero3"] = run("zero3", "deepspeed_zero3.yaml", 2, 4)
        for stage in ("zero1", "zero2"):
            runs[stage] = run(stage, f"deepspeed_{stage}.yaml", 2, 4, "--checkpointing_steps", "2")
            copy_checkpoints(d / stage, d / f"{stage}_resumed", 2)
            runs[f"{stage}_resumed"] = run(f"{stage}_resumed", f"deepspeed_{stage}.yaml", 2, 4,
                                           "--resume_from_checkpoint", "auto")
    return runs


@contextlib.contextmanager
def eager_deepspeed():
    """TORCH_COMPILE_DISABLE=1 for the runs started inside: DeepSpeed `torch.compile`s its Muon update (~80 s a
    process on this CPU); here the same arithmetic runs eager. A forked run sets it from its own environment."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_COMPILE_DISABLE", "1")
        yield


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3"])
def test_deepspeed_zero_muon_two_processes_equal_one(zero_muon_runs, name):
    """2 processes under ZeRO-1, ZeRO-2 and ZeRO-3 log one process's losses (1e-5 relative) and end with its weights
    (1e-3 relative; measured 4.6e-4 ZeRO-1/2, 7.5e-4 ZeRO-3): DeepSpeed's Muon orthogonalizes each whole matrix
    (ZeRO-1/2 all-reduce a matrix split across partitions to the processes holding it, ZeRO-3 all-reduces whole
    gradients), not a process's flattened partition (which would differ by the whole update). Its Newton-Schulz runs in
    bf16 (as DeepSpeed does on any bf16 device, CPU included) and lifts a gradient's near-null directions toward 1, so
    another summation order (~1e-7) flipping a few bf16 roundings moves the weights ~1e-4 in 3 steps."""
    (one_losses, one), (losses, weights) = zero_muon_runs["one"], zero_muon_runs[name]
    assert sorted(losses) == [1, 2, 3] and losses == pytest.approx(one_losses, rel=1e-5)
    errors = {k: (torch.linalg.norm(weights[k] - v) / torch.linalg.norm(v)).item() for k, v in one.items()}
    worst = max(errors, key=errors.get)
    print(f"{name}: max relative weight difference {errors[worst]:.1e} ({worst})")
    assert errors[worst] <= 1e-3, f"{worst}: {errors[worst]:.1e}"


def test_deepspeed_zero_muon_takes_our_muons_steps(parity_runs, zero_muon_runs, init_model):  # noqa: F811
    """The same flags on DeepSpeed's ZeRO Muon (one process, ZeRO-2) and on ours (no DeepSpeed) move the hidden
    matrices alike: its groups turn its built-in `original` scaling into `match_rms_adamw` (0.2 sqrt(max(rows, cols)):
    2.3x and 4.5x `original` on these matrices). The change of all the matrices differs by 7.4 % (DeepSpeed's
    Newton-Schulz in bf16 against ours in fp32 on CPU); with `original` it differs by 63 %. Under DeepSpeed the recipe
    turns clipping off (DeepSpeed would clip the orthogonalized update), so ours runs with --max_grad_norm 0."""
    ours, theirs, init = parity_runs["unclipped"], zero_muon_runs["one"][1], exported_weights(init_model)
    matrices = [k for k, v in ours.items() if v.ndim == 2 and "embed" not in k and "lm_head" not in k]
    ours_change = torch.cat([(ours[k] - init[k]).flatten() for k in matrices])
    difference = torch.cat([(theirs[k] - ours[k]).flatten() for k in matrices])
    error = (difference.norm() / ours_change.norm()).item()
    print(f"DeepSpeed's Muon against ours: the matrices' change differs by {error:.1e} relative")
    assert error <= 0.15


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_deepspeed_zero_muon_resumes_from_a_checkpoint_exactly(zero_muon_runs, name):
    """ZeRO-1 and ZeRO-2 resumed from their step-2 checkpoints log the uninterrupted run's step-3 loss and end with its
    weights (0.0): DeepSpeed's partitioned Muon momentum is saved and restored (step 3's update is made of it). ZeRO-3
    is killed and resumed below."""
    (losses, weights), (resumed_losses, resumed) = zero_muon_runs[name], zero_muon_runs[f"{name}_resumed"]
    assert resumed_losses == {3: losses[3]}
    assert all(torch.equal(resumed[k], v) for k, v in weights.items())


# ---- kill and resume on every engine -------------------------------------------------------------------------------
# (accelerate config, processes, flags). ZeRO-1 and ZeRO-2 are resumed from a checkpoint above; ZeRO-3 is killed.
KILLED = {"ddp_async": ("cpu_2proc.yaml", 2, ("--async_checkpointing",)), "fsdp2": ("fsdp2.yaml", 2, ()),
          "fsdp2_tp": ("fsdp2_tp.yaml", 4, ()),
          "zero3": ("deepspeed_zero3.yaml", 2, ())}
KILL_STEPS, KILL_EVERY = 5, 2


@pytest.fixture(scope="module", params=sorted(KILLED))
def killed_runs(request, corpus, dropout_config, tmp_path_factory):
    """One engine's Muon run (the tiny preset with attention dropout, fp32, global batch 8, 5 steps, checkpoints at 2
    and 4) uninterrupted, and the same command with every process SIGKILLed once the row of a step drawn from a fixed
    seed (3 or 4: after a checkpoint, maybe while the next one is written) is in metrics.jsonl, then started again
    (`--resume_from_checkpoint auto`). All forked; ZeRO-3 eager."""
    name = request.param
    config, count, extra = KILLED[name]
    d = tmp_path_factory.mktemp(f"muon_killed_{name}")
    launch = launcher(config, count)
    if not config.startswith("deepspeed"):  # a precision beside a DeepSpeed JSON is refused; it is fp32 there
        launch += ["--mixed_precision", "no"]

    def args(out):
        return pretrain_command(corpus, d / "cache", d / out, "--config_name", dropout_config, "--optim", "muon",
                                "--max_steps", str(KILL_STEPS), "--checkpointing_steps", str(KILL_EVERY),
                                "--resume_from_checkpoint", "auto", *extra)[2:]

    at, log = random.Random(name).randint(KILL_EVERY + 1, KILL_STEPS - 1), d / "killed.log"
    with eager_deepspeed() if name == "zero3" else contextlib.nullcontext():
        run_script("pretrain_llama.py", *args("full"), launcher=launch)
        processes = start_launched([*launch, os.path.join(ROOT, "scripts", "pretrain_llama.py"), *args("killed")],
                                   ROOT, str(log))
        deadline = time.monotonic() + 300
        while not any(r.get("step") == at for r in rows_since(d / "killed", 0)):
            assert all(p.poll() is None for p in processes) and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.005)
        for process in processes:
            os.kill(process.pid, signal.SIGKILL)
        assert all(process.wait() == -signal.SIGKILL for process in processes)
        run_script("pretrain_llama.py", *args("killed"), launcher=launch)
    return d, at


def test_muon_killed_and_resumed_ends_as_the_uninterrupted_run(killed_runs, capsys):
    """The same weights (0.0) and the same metric rows (the losses and gradient norms of the steps run again included:
    data order and dropout masks restored on every process). Each checkpoint holds a Muon momentum buffer for every
    element of every hidden matrix (with the buffers zeroed after loading, DDP, FSDP2 and FSDP2 x TP ended 3.1e-3 to
    3.4e-3 away: tried by hand), and its run.json refuses a resume with AdamW in one line."""
    from common.features.resume_guard import check_run_record

    d, at = killed_runs
    assert weights_diff(d / "killed", d / "full") == 0.0, f"killed after step {at}"
    assert [strip(r) for r in read_metrics(str(d / "killed"))] == [strip(r) for r in read_metrics(str(d / "full"))]
    checkpoint = d / "killed" / "checkpoints" / "step_4"
    weights = load_file(d / "killed" / "model.safetensors")
    assert momentum_elements(checkpoint) == sum(v.numel() for k, v in weights.items() if k.endswith("_proj.weight"))
    with pytest.raises(SystemExit):
        check_run_record(str(checkpoint), {"optim": "adamw_torch"})
    assert capsys.readouterr().err.strip() == (
        f"error: --resume_from_checkpoint {checkpoint}: the checkpoint was trained with --optim muon, this run has "
        "--optim adamw_torch; its optimizer state only fits muon: resume with --optim muon")


def momentum_elements(checkpoint) -> int:
    """The elements of Muon momentum a checkpoint holds, all processes together: in optimizer.bin (DDP), in the DCP
    metadata (FSDP2, TP), in DeepSpeed's flat partitions (ZeRO)."""
    if (checkpoint / "optimizer.bin").exists():
        state = torch.load(checkpoint / "optimizer.bin", weights_only=True)["state"].values()
        return sum(s["momentum_buffer"].numel() for s in state if "momentum_buffer" in s)
    if (checkpoint / "optimizer_0").exists():
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(checkpoint / "optimizer_0")).read_metadata().state_dict_metadata
        return sum(math.prod(m.size) for k, m in metadata.items() if k.endswith(".momentum_buffer"))
    partitions = [torch.load(f, weights_only=False)["optimizer_state_dict"]["optimizer_state_dict"]["state"]
                  for f in (checkpoint / "pytorch_model").glob("*_optim_states.pt")]  # DeepSpeed pickles objects
    return sum(s["momentum_buffer"].numel() for state in partitions for s in state.values() if "momentum_buffer" in s)
