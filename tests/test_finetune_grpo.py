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
    """Each completion alone through the model; per token -min(ratio A, clip(ratio) A) + beta k3; then the loss
    type's aggregation over the micro-batches of one optimizer step (divided by the accumulation steps)."""
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
            if case["beta"]:
                ref = logp.detach() + shift(i, t, "ref")
                loss = loss + case["beta"] * (torch.exp(ref - logp) - (ref - logp) - 1)
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
                           max_completion_length=L)
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
    some tokens clipped) and off, each with beta 0 and 0.04 (k3 KL to the reference) and truncated completions
    kept or masked, each scaling in turn: the recipe's loss and gradient on two micro-batches whose groups span both
    equal TRL's definitions written out one sequence at a time (1e-6)."""
    grpo_script = load_script("finetune_grpo")
    model = tiny_policy()
    micro_batches = [[0, 1, 2], [3, 4, 5]]
    groups = torch.tensor([p for p, _ in COMPLETIONS])
    rewards = torch.tensor([math.nan if r is None else r for r in REWARDS_GIVEN], dtype=torch.float64)
    advantages = {}
    for scale in ("group", "batch", "none"):
        advantages[scale], _ = grpo_script.group_advantages(rewards, groups, scale)
        assert advantages[scale].tolist() == pytest.approx(plain_advantages(scale), abs=1e-9)
    clipped_somewhere = False
    cases = [(mu, epsilon, epsilon_high, beta, mask_truncated)
             for mu, epsilon, epsilon_high in ((1, 0.2, 0.2), (2, 0.2, 0.28), (2, 1e3, 1e3))
             for beta, mask_truncated in ((0.0, False), (0.04, False), (0.04, True))]
    for number, (mu, epsilon, epsilon_high, beta, mask_truncated) in enumerate(cases):
        scale = ("group", "batch", "none")[number % 3]  # each scaling meets every μ and clipping case once
        case = dict(loss_type=loss_type, mu=mu, epsilon=epsilon, epsilon_high=epsilon_high, beta=beta,
                    mask_truncated=mask_truncated, temperature=0.7, scale=scale)
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
    from common.inputs.prompts import RewardError, compiles, score, stays_in_function

    prompt = 'def f(x):\n    """Twice x."""\n'
    completions = ["    return 2 * x\n", "    return (2 * x\n", "return x\n", "    y = x\nprint(y)\n"]
    assert compiles([prompt] * 4, completions) == [1.0, 0.0, 0.0, 1.0]
    assert stays_in_function([prompt] * 4, completions) == [1.0, 1.0, 0.0, 0.0]
    rows = [{"prompt": prompt, "answer": "a", "__index__": i} for i in (4, 9)]

    def answer_length(prompts, completions, answer, **columns):
        return [len(a) for a in answer]
    assert score([answer_length], rows, "prompt", ["x", "y"], [[1], [2]]).tolist() == [[1.0], [1.0]]
    for func, message in ((lambda prompts, completions, **kw: 1 / 0, "raised ZeroDivisionError: division by zero "
                           "(on rows 5, 10 of the prompts)"),
                          (lambda prompts, completions, **kw: [1.0], "returned 1 values for 2 completions"),
                          (lambda prompts, completions, **kw: [1.0, "good"], "returned 'good' for row 10")):
        with pytest.raises(RewardError, match=message.replace("(", r"\(").replace(")", r"\)")):
            score([func], rows, "prompt", ["x", "y"], [[1], [2]])


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
}


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
    train the same weights, losses and rewards as 1 x 8; with beta 0.1 the KL is finite, logged, and grows from 0."""
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


def test_a_reward_function_that_raises_stops_the_run_in_one_line_before_any_update(grpo, tmp_path):
    out = str(tmp_path / "raises")
    command = grpo_command(grpo, out, 2)
    command[command.index(f"{grpo['rewards']}:letters")] = f"{grpo['rewards']}:raises"
    proc = run_script("finetune_grpo.py", *command[2:], "--per_device_train_batch_size", "8", check=False)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("error: reward function raises raised ValueError: no score "
                                                     "today (on rows "), errors
    assert not os.path.exists(os.path.join(out, "metrics.jsonl"))  # no step was taken
