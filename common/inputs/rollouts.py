"""GRPO's rewards summed, its advantages and group statistics (nan-aware: an unscorable completion is left out of its
group's mean and std) and its metrics rows (TRL's names), for scripts/finetune_grpo.py."""

from __future__ import annotations

import math

import torch
from accelerate.logging import get_logger

from common.errors import fail_on_every_rank

logger = get_logger(__name__)

TOKEN_FIGURES = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl", "entropy")


def training_batch(out: dict, prompt_index: list[int], mask_truncated: bool) -> dict:
    """Sampled completions (common/inputs/sampling.py `sample`) -> the rows the loss reads: the left-padded prompt
    then the completion, position ids counted from the first real token (as `generate` counted them), labels on the
    completion's tokens through its EOS; `completion_mask` leaves truncated completions out with `mask_truncated`."""
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    labels = torch.cat([torch.full_like(out["prompt_ids"], -100),
                        out["completion_ids"].masked_fill(out["completion_mask"] == 0, -100)], 1)
    completion_mask = out["completion_mask"]
    if mask_truncated:
        completion_mask = completion_mask * (~out["truncated"]).unsqueeze(1)
    return {"input_ids": torch.cat([out["prompt_ids"], out["completion_ids"]], 1), "attention_mask": mask,
            "position_ids": (mask.cumsum(1) - 1).clamp(min=0), "labels": labels,
            "prompt_length": out["prompt_ids"].shape[1], "completion_mask": completion_mask,
            "truncated": out["truncated"], "prompt_index": torch.tensor(prompt_index, device=mask.device)}


def weighted_sum(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per completion: the weighted sum of the functions that scored it (NaN where none did), as TRL sums them."""
    total = (rewards.nan_to_num() * weights.to(rewards.device)).sum(1)
    return total.masked_fill(rewards.isnan().all(1), math.nan)


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, scale_rewards: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, each completion's group std): reward minus its group's mean, divided by the group's std + 1e-4
    (`group`), the batch's (`batch`) or 1 (`none`); NaN rewards are left out of the statistics, their advantage 0."""
    mean, std = nan_group_stats(rewards, groups.unique(return_inverse=True)[1])
    scale = {"group": std + 1e-4, "batch": nan_std(rewards) + 1e-4, "none": torch.ones_like(std)}[scale_rewards]
    return ((rewards - mean) / scale).nan_to_num(0.0), std


def nan_group_stats(values: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element: its group's mean and unbiased std over the group's values that are not NaN."""
    known = ~values.isnan()
    count = torch.zeros(int(group.max()) + 1, dtype=values.dtype, device=values.device).index_add_(0, group,
                                                                                                    known.double())
    sums = torch.zeros_like(count).index_add_(0, group, values.nan_to_num())
    mean = (sums / count)[group]
    squares = torch.zeros_like(count).index_add_(0, group, ((values - mean) ** 2).nan_to_num())
    return mean, (squares / (count - 1)).sqrt()[group]


def nan_std(values: torch.Tensor) -> torch.Tensor:
    """The unbiased std of the values that are not NaN."""
    known = values[~values.isnan()]
    return known.std() if len(known) > 1 else values.new_tensor(math.nan)


class GroupMetrics:
    """The metrics (TRL's names) since the last logged row, summed on the device: token figures from the loss on
    every process; rewards, lengths and generation time from the rollouts (rewards gathered: the main process
    alone adds them); what the reward functions logged (`log_metric`). `row()` is the step log's `row_extras`
    (collective)."""

    def __init__(self, accelerator, rewards, beta: float) -> None:
        self.accelerator, self.beta, self.rewards = accelerator, beta, rewards
        self.names, self.rewarded, self.warned = rewards.names, False, False
        # tokens + TOKEN_FIGURES; completions, lengths, truncated, seconds; scored, reward sum, groups, group std
        # sum, zero-std groups; per function: scored, sum, sum of squares
        self.sums = torch.zeros(6 + 4 + 5 + 3 * len(self.names), dtype=torch.float64, device=accelerator.device)
        self.extremes = torch.tensor([math.inf, -math.inf], device=accelerator.device)  # lengths (not carried)

    def check_scored(self, total: torch.Tensor, step: int) -> None:
        """A step whose completions no function scored: the run stops in one line when no step of this run had a
        reward yet; after one had, a warning, once (its reward is logged as NaN, as TRL's, and it trains nothing)."""
        if not total.isnan().all():
            self.rewarded = True
        elif not self.rewarded:
            fail_on_every_rank(self.accelerator, f"no reward in step {step}, the first of this run: every reward "
                               "function returned None for every completion")
        elif not self.warned:
            self.warned = True
            logger.warning(f"step {step}: every reward function returned None for every completion; its reward is "
                           "logged as NaN and it trains nothing (advantages 0). Warned once.")

    def add(self, outputs) -> None:
        self.sums[:6] += outputs.figures

    def add_generation(self, batches: list[dict], seconds: float) -> None:
        lengths = torch.cat([b["completion_mask"].sum(1) for b in batches]).double()
        truncated = torch.cat([b["truncated"] for b in batches]).double()
        self.sums[6:10] += torch.stack([lengths.new_tensor(len(lengths)), lengths.sum(), truncated.sum(),
                                        lengths.new_tensor(seconds)])
        self.extremes = torch.stack([self.extremes[0].minimum(lengths.min()), self.extremes[1].maximum(lengths.max())])

    def add_rewards(self, rewards: torch.Tensor, total: torch.Tensor, std: torch.Tensor, group: torch.Tensor) -> None:
        if not self.accelerator.is_main_process:
            return
        known = ~total.isnan()
        first = torch.zeros(int(group.max()) + 1, dtype=torch.long, device=group.device).scatter_(
            0, group.flip(0), torch.arange(len(group), device=group.device).flip(0))  # one element per group
        group_std = std[first]
        figures = [known.sum(), total.nan_to_num().sum(), total.new_tensor(len(first)), group_std.nan_to_num().sum(),
                   (group_std.nan_to_num() < 1e-8).sum()]
        for j in range(rewards.shape[1]):
            scored = rewards[:, j][~rewards[:, j].isnan()]
            figures += [scored.new_tensor(len(scored)), scored.sum(), (scored ** 2).sum()]
        self.sums[10:] += torch.stack([f.double() for f in figures])

    def row(self) -> dict:
        tokens, low, high, region, kl, entropy, completions, length, truncated, seconds, scored, reward, groups, \
            group_std, zero_std, *per_function = self.accelerator.reduce(self.sums, "sum").tolist()
        extremes = self.accelerator.gather(self.extremes).view(-1, 2)
        self.sums.zero_()
        self.extremes = torch.tensor([math.inf, -math.inf], device=self.accelerator.device)
        row = {name: value / max(tokens, 1) for name, value in zip(TOKEN_FIGURES, (low, high, region, kl, entropy))
               if name != "kl" or self.beta}
        row.update(self.rewards.logged_metrics(self.accelerator))
        if not completions:  # steps 2..μ of a round generate nothing (TRL logs no rollout figures for them)
            return row
        row.update({"reward": reward / scored if scored else math.nan, "reward_std": group_std / max(groups, 1),
                    "frac_reward_zero_std": zero_std / max(groups, 1)})
        for name, (n, total, squares) in zip(self.names, zip(*[iter(per_function)] * 3)):
            mean = total / n if n else math.nan
            row[f"rewards/{name}/mean"] = mean
            # TRL's nanstd: NaN for fewer than 2 scored values (a function that scored nothing has no spread of 0)
            row[f"rewards/{name}/std"] = math.sqrt(max(squares - n * mean ** 2, 0) / (n - 1)) if n > 1 else math.nan
        seconds /= self.accelerator.num_processes  # each process's own generation time, summed
        return {**row, "completions/mean_length": length / completions,
                "completions/min_length": extremes[:, 0].min().item(),
                "completions/max_length": extremes[:, 1].max().item(),
                "completions/clipped_ratio": truncated / completions, "generation_seconds": seconds,
                "generation_tokens_per_second": length / max(seconds, 1e-9)}
