"""Reinforcement learning with GRPO (scripts/finetune_grpo.py): the loss and its gradient against a transcription of
TRL's definitions for every loss type, reward scaling, clipping, KL weight and μ; sampling that depends only on a
completion's key; the same weights for 1 and 2 processes, for accumulation, and after a SIGKILL and a resume;
learning on a toy task; bad input in one line.

Tolerances: float32 throughout; a loss and its gradient computed two ways (one padded batch vs each sequence alone)
agree to 1e-6; weights after training to WEIGHT_TOL = 1e-5 (as tests/test_finetune_dpo.py), a resume exactly.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import SCRIPTS, launcher, read_metrics, run_script, train_losses, write_tiny_llama_task
from safetensors.torch import load_file
from test_finetune_causal_lm import load_script, max_difference

WEIGHT_TOL = 1e-5
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
REWARDS = '''
def letters(prompts, completions, **columns):
    """The share of the completion's characters that are lowercase letters: a toy reward a tiny model reaches."""
    return [sum(ch.isascii() and ch.islower() for ch in c) / max(len(c), 1) for c in completions]


def raises(prompts, completions, **columns):
    raise ValueError("no score today")


def unscored(completions, **kwargs):
    return [None] * len(completions)


def noted(completions, trainer_state, **kwargs):
    """letters(), and each call's process, steps done and completion count in calls.txt beside this file."""
    import os
    with open(os.path.join(os.path.dirname(__file__), "calls.txt"), "a") as f:
        f.write(f"{os.environ.get('RANK', '0')} {trainer_state.global_step} {len(completions)}\\n")
    return letters(None, completions)
'''


@pytest.fixture(scope="module")
def grpo(tmp_path_factory) -> dict[str, str]:
    """A tiny Llama with its own byte-level BPE tokenizer, prompts of uneven lengths, and a reward file."""
    d = tmp_path_factory.mktemp("grpo")
    rng = random.Random(0)
    rows = [{"prompt": "Q: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))) + "\nA:",
             "answer": rng.choice(WORDS)} for _ in range(72)]
    (d / "rewards.py").write_text(REWARDS)
    paths = write_tiny_llama_task(d, rows, [" ".join(WORDS)] * 20 + [r["prompt"] for r in rows], max_positions=64)
    return {**paths, "rewards": str(d / "rewards.py")}


# ---- the loss is the formula -----------------------------------------------------------------------------------------
EOS, PAD, L = 2, 0, 5
PROMPTS = [[1, 7, 8, 9, 10, 11], [1, 12, 13]]
# (prompt, completion): G = 3 per prompt, split over two micro-batches; one completion truncated (no EOS)
COMPLETIONS = [(0, [20, 21, EOS]), (0, [22, EOS]), (1, [23, 24, 25, 26, EOS]),
               (0, [27, 28, 29, 30, 31]), (1, [32, EOS]), (1, [33, 34, 35, EOS])]
REWARDS_GIVEN = [1.0, 0.25, None, 0.5, 2.0, -1.0]


def tiny_policy():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))


def sampled(rows: list[tuple[int, list[int]]]) -> dict:
    """What common/inputs/sampling.py `sample` returns for these completions (left-padded prompts, pad after EOS)."""
    prompts = [PROMPTS[p] for p, _ in rows]
    width, length = max(map(len, prompts)), max(len(c) for _, c in rows)
    return {"prompt_ids": torch.tensor([[PAD] * (width - len(p)) + p for p in prompts]),
            "prompt_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]),
            "completion_ids": torch.tensor([c + [PAD] * (length - len(c)) for _, c in rows]),
            "completion_mask": torch.tensor([[1] * len(c) + [0] * (length - len(c)) for _, c in rows]),
            "truncated": torch.tensor([EOS not in c for _, c in rows])}


def shift(i: int, t: int, kind: str) -> float:
    """A fixed, uneven offset: the sampling policy's (old) or the reference's log-probability minus the policy's."""
    return 0.4 * math.sin(3 * i + t + 1) if kind == "old" else 0.3 * math.cos(2 * i + t)


def plain_advantages(scale: str) -> list[float]:
    """TRL's definitions, written out: per group of G, mean and sample std over the rewards that are not None."""
    scored = [r for r in REWARDS_GIVEN if r is not None]
    advantages = []
    for (p, _), r in zip(COMPLETIONS, REWARDS_GIVEN):
        group = [x for (q, _), x in zip(COMPLETIONS, REWARDS_GIVEN) if q == p and x is not None]
        if r is None:
            advantages.append(0.0)
            continue
        std = {"group": statistics.stdev(group) + 1e-4, "batch": statistics.stdev(scored) + 1e-4, "none": 1}[scale]
        advantages.append((r - statistics.mean(group)) / std)
    return advantages


def plain_loss(model, case: dict, advantages: list[float], micro_batches: list[list[int]]) -> torch.Tensor:
    """Each completion alone through the model; per token -min(ratio A, clip(ratio) A) + beta k3 (x ratio); then the
    loss type's aggregation over the micro-batches of one optimizer step (divided by the accumulation steps)."""
    losses, masks = [], []
    for i, (p, completion) in enumerate(COMPLETIONS):
        ids = torch.tensor([PROMPTS[p] + completion])
        logits = model(input_ids=ids).logits[0] / case["temperature"]
        per_token = []
        for t, token in enumerate(completion):
            logp = torch.log_softmax(logits[len(PROMPTS[p]) - 1 + t], -1)[token]
            old = logp.detach() + shift(i, t, "old") if case["mu"] == 2 else logp.detach()
            ratio = torch.exp(logp - old)
            clipped = torch.clamp(ratio, 1 - case["epsilon"], 1 + case["epsilon_high"])
            loss = -torch.min(ratio * advantages[i], clipped * advantages[i])
            if case["beta"]:  # TRL 1.16's default use_bias_correction_kl: the k3 KL times the ratio
                ref = logp.detach() + shift(i, t, "ref")
                k3 = torch.exp(ref - logp) - (ref - logp) - 1
                loss = loss + case["beta"] * (k3 * ratio if case["bias_correction_kl"] else k3)
            per_token.append(loss)
        losses.append(torch.stack(per_token))
        masks.append(0.0 if case["mask_truncated"] and EOS not in completion else 1.0)
    ga, kind = len(micro_batches), case["loss_type"]
    if kind == "dapo":
        return sum(losses[i].sum() * masks[i] for i in range(6)) / sum(len(losses[i]) * masks[i] for i in range(6))
    total = 0
    for mb in micro_batches:
        if kind == "grpo":
            total += sum(losses[i].sum() * masks[i] / max(len(losses[i]) * masks[i], 1) for i in mb) / len(mb) / ga
        elif kind == "dr_grpo":
            total += sum(losses[i].sum() * masks[i] for i in mb) / (len(mb) * L) / ga
        else:
            total += sum(losses[i].sum() * masks[i] for i in mb) / sum(len(losses[i]) * masks[i] for i in mb) / ga
    return total


def recipe_loss(grpo_script, model, case: dict, advantages: torch.Tensor, micro_batches: list[list[int]]):
    """The recipe's path: the padded micro-batches, `count_items` over the step, `grpo_forward` each (the loss
    `backward_loss` scales by accumulation x processes and accelerate divides by accumulation: net, as is)."""
    from common.inputs.rollouts import training_batch

    args = SimpleNamespace(temperature=case["temperature"], epsilon=case["epsilon"],
                           epsilon_high=case["epsilon_high"], beta=case["beta"], loss_type=case["loss_type"],
                           max_completion_length=L, use_bias_correction_kl=case["bias_correction_kl"])
    batches = []
    for mb in micro_batches:
        batch = training_batch(sampled([COMPLETIONS[i] for i in mb]), [COMPLETIONS[i][0] for i in mb],
                               case["mask_truncated"])
        batch["advantages"] = advantages[mb].float()
        with torch.no_grad():
            logps = grpo_script.completion_logps(model, batch, case["temperature"])
        offsets = {kind: torch.tensor([[shift(i, t, kind) for t in range(logps.shape[1])] for i in mb])
                   for kind in ("old", "ref")}
        if case["mu"] == 2:
            batch["old_logps"] = logps + offsets["old"]
        if case["beta"]:
            batch["ref_logps"] = logps + offsets["ref"]
        batches.append(batch)
    accelerator = SimpleNamespace(reduce=lambda t, reduction: t, device=torch.device("cpu"))
    num_items = grpo_script.count_items(batches, case["loss_type"], accelerator)
    return sum(grpo_script.grpo_forward(model, batch, args, num_items).loss for batch in batches)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_loss_and_gradient_equal_the_definitions(loss_type):
    """The advantages of each reward scaling equal mean and stdev written out (a None reward is left out of its
    group and gets advantage 0). For μ = 1 (ratio 1, no clipping) and μ = 2 with clipping on (epsilon 0.2 / 0.28:
    some tokens clipped) and off, each with beta 0 and 0.04 (k3 KL to the reference, times the ratio as TRL 1.16's
    default use_bias_correction_kl, and plain with masked truncated completions) and truncated completions kept or
    masked, each scaling in turn: the recipe's loss and gradient on two micro-batches whose groups span both
    equal TRL's definitions written out one sequence at a time (1e-6)."""
    from common.inputs.rollouts import group_advantages

    grpo_script = load_script("finetune_grpo")
    model = tiny_policy()
    micro_batches = [[0, 1, 2], [3, 4, 5]]
    groups = torch.tensor([p for p, _ in COMPLETIONS])
    rewards = torch.tensor([math.nan if r is None else r for r in REWARDS_GIVEN], dtype=torch.float64)
    advantages = {}
    for scale in ("group", "batch", "none"):
        advantages[scale], _ = group_advantages(rewards, groups, scale)
        assert advantages[scale].tolist() == pytest.approx(plain_advantages(scale), abs=1e-9)
    clipped_somewhere = False
    cases = [(mu, epsilon, epsilon_high, beta, mask_truncated, not mask_truncated)  # bias-corrected KL, or plain k3
             for mu, epsilon, epsilon_high in ((1, 0.2, 0.2), (2, 0.2, 0.28), (2, 1e3, 1e3))
             for beta, mask_truncated in ((0.0, False), (0.04, False), (0.04, True))]
    for number, (mu, epsilon, epsilon_high, beta, mask_truncated, bias_correction_kl) in enumerate(cases):
        scale = ("group", "batch", "none")[number % 3]  # each scaling meets every μ and clipping case once
        case = dict(loss_type=loss_type, mu=mu, epsilon=epsilon, epsilon_high=epsilon_high, beta=beta,
                    mask_truncated=mask_truncated, temperature=0.7, scale=scale, bias_correction_kl=bias_correction_kl)
        model.zero_grad()
        expected = plain_loss(model, case, plain_advantages(scale), micro_batches)
        expected.backward()
        want = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        got = recipe_loss(grpo_script, model, case, advantages[scale], micro_batches)
        got.backward()
        assert got.item() == pytest.approx(expected.item(), abs=1e-6), case
        assert max((p.grad - w).abs().max().item() for p, w in zip(model.parameters(), want)) < 1e-6, case
        if mu == 2 and epsilon < 1:
            unclipped = recipe_loss(grpo_script, model, {**case, "epsilon": 1e3, "epsilon_high": 1e3},
                                    advantages[scale], micro_batches)
            clipped_somewhere |= abs(got.item() - unclipped.item()) > 1e-4
    assert clipped_somewhere  # the clipped cases did clip


# ---- deterministic sampling ------------------------------------------------------------------------------------------
def test_a_completion_depends_only_on_its_key_and_samples_the_distribution():
    """The same key gives the same completion alone or beside other prompts, in any row; other keys give others.
    The next-token rule (inverse CDF at the key's uniform) draws each token with its filtered probability."""
    from transformers.generation.logits_process import TopKLogitsWarper

    from common.inputs.sampling import SeededSampling, sample, warpers

    model = tiny_policy()
    filters = warpers(0.9, 20, 0.95, 0.01)
    prompts = [PROMPTS[0], PROMPTS[1], [1, 5], [1, 6, 7, 8, 9, 10, 11, 12, 13]]
    keys = [("train", 0, 1, 7, g) for g in range(4)]
    together = sample(model, prompts, keys, 12, filters, PAD, EOS)
    for row in (0, 3):
        alone = sample(model, [prompts[row]], [keys[row]], 12, filters, PAD, EOS)
        n = int(alone["completion_mask"].sum())
        assert n == int(together["completion_mask"][row].sum())
        assert alone["completion_ids"][0, :n].tolist() == together["completion_ids"][row, :n].tolist()
    again = sample(model, [prompts[0]] * 4, keys, 12, filters, PAD, EOS)["completion_ids"]
    assert len({tuple(row.tolist()) for row in again}) > 1  # each generation index its own noise
    scores = torch.randn(1, 40).expand(20000, 40)
    uniforms = torch.rand(20000, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    picked = SeededSampling(uniforms, 0, [TopKLogitsWarper(5)])(torch.zeros(20000, 0, dtype=torch.long), scores)
    frequencies = torch.bincount(picked.argmax(1), minlength=40) / 20000
    expected = TopKLogitsWarper(5)(None, scores[:1].clone()).softmax(-1)[0]
    assert (frequencies - expected).abs().max() < 0.015


# ---- rewards and bad input ------------------------------------------------------------------------------------------
def test_the_default_rewards_and_a_misused_reward_are_one_line():
    """The default rewards on examples. A reward that raises names each failing prompt's row once (a group's G
    completions share it), one that miscounts or returns text or infinity is one line; None and NaN are unscored."""
    from common.inputs.rewards import RewardError, RewardFunctions, compiles, stays_in_function

    prompt = 'def f(x):\n    """Twice x."""\n'
    completions = ["    return 2 * x\n", "    return (2 * x\n", "return x\n", "    y = x\nprint(y)\n"]
    assert compiles([prompt] * 4, completions) == [1.0, 0.0, 0.0, 1.0]
    assert stays_in_function([prompt] * 4, completions) == [1.0, 1.0, 0.0, 0.0]
    rows = [{"prompt": prompt, "answer": "a", "__index__": i} for i in (4, 4, 9, 9)]

    def answer_length(prompts, completions, answer, **columns):
        return [len(a) for a in answer[:2]] + [None, math.nan]
    got = RewardFunctions([answer_length], "prompt")(rows, list("wxyz"), [[1]] * 4, "train")
    assert got[:2].tolist() == [[1.0], [1.0]] and got[2:].isnan().all()
    for func, message in ((lambda prompts, completions, **kw: 1 / 0, "raised ZeroDivisionError: division by zero "
                           "(on rows 5, 10 of the train split's prompts)"),
                          (lambda prompts, completions, **kw: [1.0], "returned 1 values for 4 completions"),
                          (lambda prompts, completions, **kw: [1.0, 2, 3, "good"],
                           "returned 'good' for row 10 of the train split's"),
                          (lambda prompts, completions, **kw: [1.0, math.inf, 3, 4], "returned inf for row 5")):
        with pytest.raises(RewardError, match=message.replace("(", r"\(").replace(")", r"\)")):
            RewardFunctions([func], "prompt")(rows, list("wxyz"), [[1]] * 4, "train")
    with pytest.raises(RewardError, match=r"\(on row 5 of the validation split's prompts\)$"):  # was "rows 5"
        RewardFunctions([lambda completions, **kw: 1 / 0], "prompt")(rows[:2], list("wx"), [[1]] * 2, "validation")


TRL_SHAPES = '''
import asyncio
import functools
import re

import numpy as np


def quick_start(completions, **kwargs):  # TRL's quick-start shape
    return [float(len(c[0]["content"])) for c in completions]


def exact(prompts, completions, answer, **kwargs):  # a column by name
    return [float(c[0]["content"].endswith(a)) for c, a in zip(completions, answer)]


def shaped(completions, trainer_state, log_metric, log_extra, **kwargs):  # progress-dependent, logs a metric
    log_metric("shaped/progress", trainer_state.global_step / trainer_state.max_steps)
    log_extra("note", ["seen"] * len(completions))
    return [trainer_state.global_step / trainer_state.max_steps] * len(completions)


async def judge(prompts, completions, **kwargs):  # an LLM judge's shape
    await asyncio.sleep(0)
    return [np.float32(0.5)] * len(completions)


class AsyncJudge:
    async def __call__(self, completions, **kwargs):
        await asyncio.sleep(0)
        return [True, False]


async_judge = AsyncJudge()


def scaled(completions, factor, **kwargs):
    return [factor] * len(completions)


half = functools.partial(scaled, factor=0.5)


# trl.rewards' signatures (TRL 1.16), with bodies of their kind
def accuracy_reward(completions, solution, log_extra=None, **kwargs):
    return [None if s is None else float(c[0]["content"].endswith(s)) for c, s in zip(completions, solution)]


def think_format_reward(completions, **kwargs):
    return [1.0 if re.match(r"^<think>.*?</think>", c[0]["content"], re.DOTALL) else 0.0 for c in completions]


class _SoftOverlongPunishment:  # what get_soft_overlong_punishment(max_completion_len, soft_punish_cache) returns
    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len, soft_punish_cache):
        self.max_completion_len, self.soft_punish_cache = max_completion_len, soft_punish_cache

    def __call__(self, completion_ids, **kwargs):
        return [max(-1.0, min(0.0, (self.max_completion_len - self.soft_punish_cache - len(ids))
                              / self.soft_punish_cache)) for ids in completion_ids]


overlong = _SoftOverlongPunishment(4, 2)


def no_kwargs(prompts, completions):
    return [1.0] * len(completions)


def positional_only(completions, /, **kwargs):
    return [1.0] * len(completions)
'''


def test_trl_reward_functions_are_called_as_trl_calls_them(tmp_path, capsys):
    """Every shape TRL 1.16's GRPOTrainer accepts is loaded and called with TRL's keywords (prompts, completions,
    completion_ids, the columns, trainer_state, log_extra, log_metric): `f(completions, **kwargs)`, named columns,
    trainer_state and log_metric, `async def`, an object with an async `__call__`, a partial, and trl.rewards'
    signatures (accuracy_reward's None, think_format_reward, the soft overlong punishment's callable object); names
    as TRL's metrics name them; log_metric's means under their name (eval_ in evaluations). What TRL fails on is one
    line: no **kwargs, a required positional-only parameter, a column the rows lack, a column named as a keyword."""
    from common.inputs.rewards import RewardFunctions, check_reward_columns, load_reward_funcs

    path = tmp_path / "trl_shapes.py"
    path.write_text(TRL_SHAPES)
    names = ["quick_start", "exact", "shaped", "judge", "async_judge", "half", "accuracy_reward",
             "think_format_reward", "overlong"]
    rewards = RewardFunctions(load_reward_funcs([f"{path}:{name}" for name in names]), "prompt")
    assert rewards.names == names[:4] + ["AsyncJudge", "scaled"] + names[6:8] + ["soft_overlong_punishment_reward"]
    check_reward_columns(rewards.funcs, ["answer", "solution"], "the train split")
    rewards.trainer_state.global_step, rewards.trainer_state.max_steps = 1, 4
    rows = [{"prompt": [{"role": "user", "content": "2 + 2?"}], "answer": "4", "solution": solution,
             "__index__": 0} for solution in ("4", None)]
    completions = [[{"role": "assistant", "content": "<think>sum</think>4"}], [{"role": "assistant", "content": "5"}]]
    got = rewards(rows, completions, [[5, 6, 7], [5, 6, 7, 8, 9]], "train")
    expected = [[19.0, 1.0, 0.25, 0.5, 1.0, 0.5, 1.0, 1.0, -0.5], [1.0, 0.0, 0.25, 0.5, 0.0, 0.5, math.nan, 0.0, -1.0]]
    assert got.tolist()[0] == expected[0] and got[1].nan_to_num(-9).tolist() == [-9 if math.isnan(x) else x
                                                                                 for x in expected[1]]
    accelerator = SimpleNamespace(num_processes=1, device=torch.device("cpu"), reduce=lambda t, reduction: t)
    rewards.trainer_state.global_step = 3
    rewards(rows, completions, [[5], [5]], "train")
    assert rewards.logged_metrics(accelerator) == {"shaped/progress": 0.5}  # (1/4 + 3/4) / 2
    rewards(rows, completions, [[5], [5]], "validation")
    assert rewards.logged_metrics(accelerator) == {}
    assert rewards.logged_metrics(accelerator, "eval") == {"eval_shaped/progress": 0.75}
    for name, line in (("no_kwargs", "no_kwargs(prompts, completions) cannot take the keyword 'completion_ids', "
                                     "which TRL passes to every reward function"),
                       ("positional_only", "positional_only(completions, /, **kwargs) requires the positional-only "
                                           "parameter 'completions'")):
        with pytest.raises(SystemExit):
            load_reward_funcs([f"{path}:{name}"])
        errors = [text for text in capsys.readouterr().err.splitlines() if "error:" in text]
        assert len(errors) == 1 and errors[0].startswith(f"error: --reward_funcs {path}:{name}: {line}"), errors
    with pytest.raises(SystemExit):
        check_reward_columns(rewards.funcs, ["answer"], "the train split")
    errors = [text for text in capsys.readouterr().err.splitlines() if "error:" in text]
    assert errors == ["error: reward function accuracy_reward cannot be called with the columns of the train split "
                      "(answer): missing a required argument: 'solution'"], errors
    with pytest.raises(SystemExit):
        check_reward_columns(rewards.funcs, ["answer", "solution", "completions"], "the train split")
    errors = [text for text in capsys.readouterr().err.splitlines() if "error:" in text]
    assert errors == ["error: the train split has a column 'completions', the name of a keyword TRL passes to "
                      "reward functions itself: rename the column"], errors


def test_a_step_without_reward_logs_nan_and_warns_once(caplog):
    """A step whose completions no function scored, after steps that had rewards: its row's reward (and the
    function's mean) is NaN, as TRL's nan-aware mean gives, not 0.0; a warning once, not at every such step. (A run
    whose first step has none stops: the forked test above.)"""
    from accelerate import PartialState

    from common.inputs.rollouts import GroupMetrics

    fresh = not PartialState._shared_state
    PartialState()
    accelerator = SimpleNamespace(device=torch.device("cpu"), reduce=lambda t, reduction: t, gather=lambda t: t,
                                  is_main_process=True, num_processes=1, wait_for_everyone=lambda: None)
    rewards = SimpleNamespace(names=["f"], logged_metrics=lambda accelerator: {})
    metrics = GroupMetrics(accelerator, rewards, beta=0.0)
    batch = {"completion_mask": torch.ones(4, 3), "truncated": torch.zeros(4, dtype=torch.bool)}
    group = torch.tensor([0, 0, 1, 1])
    try:
        metrics.check_scored(torch.tensor([1.0, 0.0, math.nan, 1.0]), 1)
        with caplog.at_level("WARNING"):
            for step in (2, 3):
                unscored = torch.full((4,), math.nan)
                metrics.check_scored(unscored, step)
                metrics.add_generation([batch], 0.1)
                metrics.add_rewards(unscored.unsqueeze(1), unscored, unscored, group)
                row = metrics.row()
                assert math.isnan(row["reward"]) and math.isnan(row["rewards/f/mean"]), row
        warnings = [r.getMessage() for r in caplog.records if "returned None for every completion" in r.getMessage()]
        assert len(warnings) == 1 and "step 2: every reward function" in warnings[0], warnings
    finally:
        if fresh:
            PartialState._reset_state()


def test_a_users_omp_num_threads_is_kept(monkeypatch):
    """common/features/cpu_threads.py gives a CPU run's processes the cores (4 here, each process a share) unless
    the user set OMP_NUM_THREADS: a 1 the user set is kept, without a launcher (this process's environment) and
    under one (the launcher's own environment: a process started with it stands in for the launcher); under a
    launcher whose environment has none, its 1 is replaced."""
    import subprocess

    from common.features.cpu_threads import use_all_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    clean = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    threads, found = torch.get_num_threads(), []
    try:
        for launched, users in ((False, True), (True, True), (True, False)):
            environment = {**clean, **({"OMP_NUM_THREADS": "1"} if users else {})}
            stand_in = subprocess.Popen(["sh", "-c", "echo started; read line"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=environment)
            stand_in.stdout.readline()  # running: its environment is in place (during an exec it reads empty)
            monkeypatch.setattr(os, "getppid", lambda: stand_in.pid)
            monkeypatch.setenv("OMP_NUM_THREADS", "1")
            if launched:
                monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "no")
            else:
                monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
            torch.set_num_threads(1)
            use_all_cores()
            found.append(torch.get_num_threads())
            stand_in.kill()
            stand_in.communicate()
    finally:
        torch.set_num_threads(threads)
    assert found == [1, 1, 4], found


BAD = {
    "no-reward": ([], "no reward function: pass --reward_funcs"),
    "no-file": (["--reward_funcs", "missing.py:f"], "--reward_funcs missing.py:f: no such file missing.py"),
    "no-name": (["--reward_funcs", "{rewards}:nothing"], "--reward_funcs {rewards}:nothing: {rewards} has no "
                "function 'nothing'"),
    "no-module": (["--reward_funcs", "no_such_pkg.mod:f"], "--reward_funcs no_such_pkg.mod:f: importing "
                  "no_such_pkg.mod failed (ModuleNotFoundError"),
    "weights": (["--reward_funcs", "{rewards}:letters", "--reward_weights", "1", "2"],
                "--reward_weights has 2 weights for 1 reward functions"),
    "one-generation": (["--num_generations", "1"], "--num_generations must be at least 2 (got 1)"),
    "indivisible": (["--num_generations", "3", "--per_device_train_batch_size", "4"],
                    "the global batch (4 completions x 1 accumulation x 1 processes = 4) must be a multiple of "
                    "--num_generations 3"),
    "epsilon": (["--epsilon", "0"], "--epsilon and --epsilon_high must be finite numbers > 0 (got 0.0, 0.0)"),
    "beta-negative": (["--beta", "-0.1"], "--beta must be a finite number >= 0 (got -0.1)"),
    "beta-nan": (["--beta", "nan"], "--beta must be a finite number >= 0 (got nan)"),
    "temperature": (["--temperature", "0"], "--temperature must be a finite number > 0 (got 0.0)"),
    "loss-type": (["--loss_type", "ppo"], "argument --loss_type: invalid choice: 'ppo'"),
    "bias-correction": (["--use_bias_correction_kl", "maybe"],
                        "argument --use_bias_correction_kl: give true or false (got 'maybe')"),
    "text-column": (["--text_column", "question"], "--text_column does not apply: the prompts are read from "
                    "--prompt_column"),
}


def test_a_function_that_scored_nothing_has_no_std():
    """A step where one function returned None for every completion: its `rewards/<func>/mean` was NaN but its std
    0.0 (TRL's nanstd: NaN); the other function's figures stand."""
    from accelerate import Accelerator

    from common.inputs.rollouts import GroupMetrics

    rewards = SimpleNamespace(names=["silent", "scored"], logged_metrics=lambda accelerator: {})
    metrics = GroupMetrics(Accelerator(cpu=True), rewards, beta=0.0)
    metrics.add_generation([{"completion_mask": torch.ones(4, 3), "truncated": torch.zeros(4)}], 1.0)
    scores = torch.tensor([[math.nan, 1.0], [math.nan, 2.0], [math.nan, 3.0], [math.nan, 4.0]], dtype=torch.float64)
    total = scores.nansum(1)
    metrics.add_rewards(scores, total, torch.full((4,), total.std().item()), torch.zeros(4, dtype=torch.long))
    row = metrics.row()
    assert math.isnan(row["rewards/silent/mean"]) and math.isnan(row["rewards/silent/std"])
    assert row["rewards/scored/mean"] == 2.5 and row["rewards/scored/std"] == pytest.approx(total.std().item())


def test_the_kl_and_dropout_flags_say_what_trl_does(grpo, capsys, monkeypatch, tmp_path):
    """TRL 1.16's GRPOConfig: use_bias_correction_kl True by default (false turns it off, as HfArgumentParser reads
    it); disable_dropout False, which --keep_dropout's help says (the recipe's default differs: docs/grpo.md). From
    a folder whose outputs/run holds a run (this test failed there)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    output_dir = a_used_default_output_dir(monkeypatch, tmp_path)
    grpo_script = load_script("finetune_grpo")
    flags = ["--model_name_or_path", grpo["model"], "--train_file", grpo["train"], "--num_generations", "4",
             "--reward_funcs", f"{grpo['rewards']}:letters", "--output_dir", output_dir]
    assert grpo_script.parse_args(flags).use_bias_correction_kl is True
    assert grpo_script.parse_args(flags + ["--use_bias_correction_kl"]).use_bias_correction_kl is True
    assert grpo_script.parse_args(flags + ["--use_bias_correction_kl", "false"]).use_bias_correction_kl is False
    with pytest.raises(SystemExit):
        grpo_script.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Keep the model's dropout, as TRL does by default (disable_dropout=False)" in help_text
    assert "--text_column" not in help_text and "a prompt longer than this minus --max_completion_length" in help_text


def a_used_default_output_dir(monkeypatch, tmp_path) -> str:
    """Run from a folder whose `outputs/run` (the default --output_dir) holds a run, as a checkout does after the
    Quick start: a test must not depend on it (these tests failed there). Returns an --output_dir of the test's own."""
    (tmp_path / "outputs" / "run").mkdir(parents=True)
    (tmp_path / "outputs" / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    monkeypatch.chdir(tmp_path)
    return str(tmp_path / "out")


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_flags_are_one_line_before_any_work(grpo, capsys, monkeypatch, tmp_path, case):
    """Each refused while the flags are parsed (no model, no data): one line, exit status 2."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    output_dir = a_used_default_output_dir(monkeypatch, tmp_path)
    flags, line = BAD[case]
    flags = [f.format(rewards=grpo["rewards"]) for f in flags]
    if case != "no-reward" and "--reward_funcs" not in flags:
        flags += ["--reward_funcs", f"{grpo['rewards']}:letters"]
    grpo_script = load_script("finetune_grpo")
    with pytest.raises(SystemExit) as stop:
        grpo_script.parse_args(["--model_name_or_path", grpo["model"], "--train_file", grpo["train"],
                                "--output_dir", output_dir, "--num_generations", "4", *flags])
    errors = [text for text in capsys.readouterr().err.splitlines() if "error:" in text]
    assert stop.value.code == 2 and len(errors) == 1, errors
    assert line.format(rewards=grpo["rewards"]) in errors[0]


@pytest.mark.parametrize("case", ["empty-prompt", "prompt-too-long"])
def test_bad_prompts_are_one_line_naming_the_row(grpo, tmp_path, capsys, monkeypatch, case):
    """An empty prompt: refused before the tokenizer loads. A prompt that leaves less than --max_completion_length
    of the context: refused with its row before any model is built."""
    from transformers import AutoConfig

    from common.inputs.prompts import load_prompt_data

    rows = [{"prompt": "Q: alpha\nA:"}, {"prompt": " " if case == "empty-prompt" else "Q:" + " alpha" * 40}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    output_dir = a_used_default_output_dir(monkeypatch, tmp_path)
    args = load_script("finetune_grpo").parse_args([
        "--model_name_or_path", grpo["model"], "--train_file", str(path), "--validation_file", str(path),
        "--output_dir", output_dir,
        "--reward_funcs", f"{grpo['rewards']}:letters", "--num_generations", "2", "--max_completion_length", "16",
        "--cache_dir", str(tmp_path / "cache")])
    accelerator = SimpleNamespace(main_process_first=lambda: __import__("contextlib").nullcontext())
    with pytest.raises(SystemExit):
        load_prompt_data(args, accelerator, AutoConfig.from_pretrained(grpo["model"]), None)
    errors = [text for text in capsys.readouterr().err.splitlines() if text.startswith("error:")]
    expected = (f"--train_file {path}: row 2 has an empty 'prompt'" if case == "empty-prompt" else
                "train row 2: its prompt has")
    assert len(errors) == 1 and errors[0].startswith(f"error: {expected}"), errors


# ---- training runs: equal weights, exact resume, learning -------------------------------------------------------------
FLAGS = ["--reward_funcs", "{rewards}:letters", "--num_generations", "4", "--max_completion_length", "8",
         "--learning_rate", "1e-3", "--lr_scheduler_type", "constant", "--logging_steps", "1", "--seed", "0",
         "--num_iterations", "2", "--beta", "0.1", "--checkpointing_steps", "3"]


def train_grpo(grpo: dict, out: str, *args: str, launcher: list[str] | None = None, steps: int = 6) -> str:
    run_script("finetune_grpo.py", *grpo_command(grpo, out, steps)[2:], *args, launcher=launcher)
    return out


def grpo_command(grpo: dict, out: str, steps: int) -> list[str]:
    return [sys.executable, os.path.join(SCRIPTS, "finetune_grpo.py"), "--model_name_or_path", grpo["model"],
            "--train_file", grpo["train"], "--validation_file", grpo["validation"], "--output_dir", out,
            "--max_steps", str(steps), *(f.format(rewards=grpo["rewards"]) for f in FLAGS)]


def weights(folder: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "model.safetensors"))


def rows(out: str) -> list[dict]:
    return [r for r in read_metrics(out) if "loss" in r]


@pytest.fixture(scope="module")
def one_process(grpo) -> str:
    """6 steps of 8 completions (2 prompts x G 4), μ 2, beta 0.1, one process: what the others must equal."""
    return train_grpo(grpo, os.path.join(grpo["dir"], "b8"), "--per_device_train_batch_size", "8")


def test_processes_and_accumulation_train_the_same_weights(grpo, one_process):
    """2 processes x 4 and 1 process x 2 x 4 accumulation sample the same completions (each from its own key) and
    train the same weights, losses and rewards as 1 x 8; with beta 0.1 the KL is finite, logged, and grows from 0.
    Over 6 steps this holds on these data (no token's draw falls within the fp32 noise of a CDF boundary), not on all
    data: what holds in general is the test below (docs/grpo.md, Determinism)."""
    d = grpo["dir"]
    runs = {"2 processes x 4": train_grpo(grpo, f"{d}/ddp", "--per_device_train_batch_size", "4",
                                          launcher=launcher("cpu_2proc.yaml")),
            "1 process x 2 x 4": train_grpo(grpo, f"{d}/ga4", "--per_device_train_batch_size", "2",
                                            "--gradient_accumulation_steps", "4")}
    reference = rows(one_process)
    assert len(reference) == 6 and reference[0]["kl"] == 0 and all(0 < r["kl"] < math.inf for r in reference[1:])
    for name, out in runs.items():
        assert max_difference(weights(out), weights(one_process)) < WEIGHT_TOL, name
        assert train_losses(out) == pytest.approx(train_losses(one_process), abs=1e-6), name
        for key in ("reward", "kl", "entropy", "completions/mean_length", "clip_ratio/region_mean"):
            assert [r.get(key) for r in rows(out)] == pytest.approx([r.get(key) for r in reference], abs=1e-5), key


def test_equal_weights_give_equal_steps_on_any_process_count(grpo, tmp_path):
    """What holds across process counts (docs/grpo.md): a step's completions are a function of the weights and
    their keys, so equal weights give equal steps. The model's distributions are flat (random weights over 300
    tokens: entropy above 5 nats of log 300 = 5.7), 16 tokens, lr 2e-3, μ 1, β 0.1. 2 processes x 4 train 3 steps
    with a checkpoint at step 2; one process x 8 resumes from it: its step 3 has the same completions (the same
    rewards and lengths, exactly), loss and KL (1e-6) and grad norm (1e-5), and ends within 1e-5 of the same weights.
    Besides: the held-out prompts are split over the processes (each scored once, 4 per process), reward functions
    see trainer_state (steps done, max_steps), and the progress bar shows the reward."""
    import shutil

    shutil.copy(grpo["rewards"], tmp_path / "noted.py")
    flags = ["--reward_funcs", f"{tmp_path / 'noted.py'}:noted", "--num_iterations", "1", "--learning_rate", "2e-3",
             "--max_completion_length", "16", "--checkpointing_steps", "2"]
    ddp = str(tmp_path / "ddp")
    proc = run_script("finetune_grpo.py", *grpo_command(grpo, ddp, 3)[2:], *flags, "--per_device_train_batch_size",
                      "4", launcher=launcher("cpu_2proc.yaml"))
    calls = [tuple(map(int, line.split())) for line in (tmp_path / "calls.txt").read_text().splitlines()]
    assert sorted({step for _, step, _ in calls}) == [0, 1, 2, 3]  # steps done at each step's generation, then eval
    assert sorted((rank, n) for rank, step, n in calls if step == 3) == [(0, 4), (1, 4)]  # 8 held out, each once
    assert "reward=" in proc.stderr
    one = str(tmp_path / "one")
    shutil.copytree(ddp, one)
    run_script("finetune_grpo.py", *grpo_command(grpo, one, 3)[2:], *flags, "--per_device_train_batch_size", "8",
               "--resume_from_checkpoint", "latest")
    two, single = rows(ddp), rows(one)
    assert two[0]["entropy"] > 5 and [r["step"] for r in single] == [1, 2, 3]
    for key in ("reward", "completions/mean_length", "completions/max_length", "rewards/noted/std"):
        assert single[2][key] == two[2][key], key
    assert single[2]["loss"] == pytest.approx(two[2]["loss"], abs=1e-6)
    assert single[2]["kl"] == pytest.approx(two[2]["kl"], abs=1e-6)
    assert single[2]["grad_norm"] == pytest.approx(two[2]["grad_norm"], abs=1e-5)
    assert max_difference(weights(one), weights(ddp)) < WEIGHT_TOL


def test_a_killed_run_resumes_exactly(grpo, one_process):
    """SIGKILL after the checkpoint of step 3, in the middle of a round of μ = 2 (its completions and sampling
    log-probabilities travel with the checkpoint), then --resume_from_checkpoint latest: the uninterrupted run's
    weights (0.0) and metric rows."""
    from test_crash_safety import newest_complete_step, sigkill, start, wait_for

    out = f"{grpo['dir']}/killed"
    proc = start(grpo_command(grpo, out, 6) + ["--per_device_train_batch_size", "8"], f"{out}.log")
    assert wait_for(proc, lambda: newest_complete_step(out) >= 3), open(f"{out}.log").read()[-3000:]
    sigkill(proc)
    assert newest_complete_step(out) < 6
    train_grpo(grpo, out, "--per_device_train_batch_size", "8", "--resume_from_checkpoint", "latest")
    assert max_difference(weights(out), weights(one_process)) == 0.0
    got, want = rows(out), rows(one_process)
    assert [r["step"] for r in got] == list(range(1, 7))
    for key in ("loss", "reward", "kl", "entropy", "grad_norm"):
        assert [r.get(key) for r in got] == [r.get(key) for r in want], key


def test_the_toy_task_is_learned(grpo):
    """The share of lowercase letters in a completion (random bytes at first: about 0.1): 10 steps of 4 prompts x
    G 8 with μ 1 raise the mean reward of the last two steps above the first two's by more than 0.25, about ten
    times the spread of a step's mean over its 32 completions (std ~0.14 / sqrt(32) ~ 0.025); the held-out
    prompts' reward (sampled, fixed noise) ends above 0.3."""
    out = train_grpo(grpo, f"{grpo['dir']}/learn", "--per_device_train_batch_size", "16", "--learning_rate", "3e-2",
                     "--gradient_accumulation_steps", "2", "--num_generations", "8", "--num_iterations", "1",
                     "--beta", "0", steps=10)
    rewards = [r["reward"] for r in rows(out)]
    assert sum(rewards[-2:]) / 2 - sum(rewards[:2]) / 2 > 0.25, rewards
    with open(os.path.join(out, "all_results.json")) as f:
        assert json.load(f)["eval_reward"] > 0.3


def test_a_copy_without_its_features_trains_exactly_as_the_original(grpo, one_process, tmp_path):
    """tools/copy_recipe.py removes every `# feature:` line: the copy imports no feature and trains bit for bit as
    the original does without those flags."""
    from tools.copy_recipe import common_modules, strip_features

    copy = tmp_path / "my_grpo.py"
    copy.write_text(strip_features(open(os.path.join(SCRIPTS, "finetune_grpo.py")).read()))
    assert not any(".features" in name for name in common_modules(copy.read_text()))
    out = str(tmp_path / "copy")
    command = grpo_command(grpo, out, 6)
    run_script(str(copy), *command[2:], "--per_device_train_batch_size", "8",
               env={"PYTHONPATH": os.path.dirname(SCRIPTS)})
    assert train_losses(out) == train_losses(one_process)
    assert max_difference(weights(out), weights(one_process)) == 0


@pytest.mark.parametrize("reward", ["raises", "unscored"])
def test_a_reward_function_that_raises_or_scores_nothing_stops_the_run_in_one_line_before_any_update(grpo, tmp_path,
                                                                                                     reward):
    """A function that raises: one line naming it and each failing prompt's row once. One that returns None for
    every completion of the run's first step: one line (TRL would log a NaN reward and learn nothing, silently)."""
    out = str(tmp_path / reward)
    command = grpo_command(grpo, out, 2)
    command[command.index(f"{grpo['rewards']}:letters")] = f"{grpo['rewards']}:{reward}"
    proc = run_script("finetune_grpo.py", *command[2:], "--per_device_train_batch_size", "8", check=False)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if reward == "raises":
        assert len(errors) == 1 and errors[0].startswith("error: reward function raises raised ValueError: no score "
                                                         "today (on rows "), errors
        rows_named = errors[0].split("(on rows ")[1].split(" of")[0].split(", ")
        assert len(rows_named) == 2 and len(set(rows_named)) == 2, errors  # 2 prompts x G 4: each row once
    else:
        assert errors == ["error: no reward in step 1, the first of this run: every reward function returned None "
                          "for every completion"], errors
    assert not os.path.exists(os.path.join(out, "metrics.jsonl"))  # no step was taken
