"""Throughput, MFU, memory, and the run's outputs: `metrics.jsonl` (one JSON object per logged step) and
`all_results.json` (final figures)."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from contextlib import contextmanager

import torch
from accelerate.logging import get_logger
from tqdm.auto import tqdm

from common.paths import CHECKPOINT_DIR, COMPLETE_MARKER, LEFTOVER_PREFIX, METRICS_FILE, RESULTS_FILE

logger = get_logger(__name__)

# Dense bf16 peak of one GPU (no sparsity), by a substring of its name.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def peak_flops_per_device() -> float | None:
    """Dense bf16 peak of this GPU, or None (CPU, or a GPU not in the table): MFU is then not reported."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def peak_memory_bytes() -> int:
    """Peak GPU memory allocated by this process; on CPU, the process's peak resident set size."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class Throughput:
    """Tokens and training seconds since the last report (all processes' tokens; evaluation time excluded)."""

    def __init__(self) -> None:
        self.start, self.tokens = time.perf_counter(), 0

    @contextmanager
    def untimed(self):
        """Time spent inside (evaluation, checkpointing) does not count as training time."""
        began = time.perf_counter()
        yield
        self.start += time.perf_counter() - began

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def report(self) -> float:
        """Tokens per second since the last call, then restart."""
        now = time.perf_counter()
        rate = self.tokens / max(now - self.start, 1e-9)
        self.start, self.tokens = now, 0
        return rate


class MetricsWriter:
    """Appends one JSON object per logged step to `<output_dir>/metrics.jsonl` (main process only)."""

    def __init__(self, output_dir: str, enabled: bool, resume_step: int = 0) -> None:
        self.path = os.path.join(output_dir, METRICS_FILE)
        self.enabled = enabled
        if enabled and os.path.isfile(self.path):
            self.keep_rows_before(resume_step, metrics_rows_at(output_dir, resume_step))

    def keep_rows_before(self, step: int, rows: int | None) -> None:
        """A resumed run re-logs what came after its checkpoint (a fresh start: everything): keep only the rows written
        before the checkpoint was saved (the first `rows`, as its marker recorded; else those up to `step`), so each
        step appears once. Replaced atomically: a kill here leaves the old file or the new one, never an empty one."""
        with open(self.path, encoding="utf-8") as f:
            lines = [line for line in f if line.endswith("\n")][:rows]  # a line cut short by a kill has no newline
        kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
        trimmed = os.path.join(os.path.dirname(self.path), f"{LEFTOVER_PREFIX}{METRICS_FILE}")
        with open(trimmed, "w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(trimmed, self.path)

    def write(self, record: dict) -> None:
        """`time` (Unix seconds) is added so that step times can be read back whatever a step's token count."""
        if self.enabled:
            row = (json.dumps(strict_json({**record, "time": round(time.time(), 4)}), allow_nan=False) + "\n").encode()
            with open(self.path, "ab", buffering=0) as f:
                size, done = f.tell(), 0
                try:
                    while done < len(row):  # a row whole or none: a full disk takes a part, then refuses the rest
                        done += f.write(row[done:])
                except OSError:
                    os.truncate(self.path, size)
                    raise


def write_all_results(output_dir: str, results: dict) -> None:
    with open(os.path.join(output_dir, RESULTS_FILE), "w", encoding="utf-8") as f:
        json.dump(strict_json(results), f, indent=2, allow_nan=False)


def strict_json(value):
    """NaN and infinities -> None (JSON null): Python's json would write `NaN`/`Infinity`, which is not JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


class StepLog:
    """What the loops log: loss, lr, grad norm, tokens/s, padding, memory (MFU on known GPUs), with a progress bar.

    `count_tokens(batch)` per micro-batch, `step(step, lr, checked)` per optimizer step (its `common/guard.py` check).
    Counts and losses stay on the device until a row is written (every `logging_steps` and at the end). A row's
    `loss` is the mean over its finite steps; `skipped_nonfinite_steps` counts the others (summed over the rows: the
    run's total, across resumes). Time inside `untimed()` (evaluation, checkpoints) is not training time.
    """

    def __init__(self, accelerator, output_dir: str, start_step: int, total_steps: int, steps_per_epoch: int | None,
                 logging_steps: int, flops_per_token: float | None = None, window: torch.Tensor | None = None) -> None:
        self.accelerator, self.total_steps, self.steps_per_epoch = accelerator, total_steps, steps_per_epoch
        self.logging_steps, self.flops_per_token = logging_steps, flops_per_token
        self.output_dir = output_dir
        self.writer = MetricsWriter(output_dir, accelerator.is_main_process, start_step)
        self.throughput = Throughput()
        self.untimed = self.throughput.untimed
        self.peak_flops = peak_flops_per_device() if flops_per_token else None
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", delay=1e-6,  # drawn from the first step:
                        disable=not accelerator.is_local_main_process)  # a frame now shares the "Model:" line
        self.last_row, self.row_extras, self.bar_keys = {}, dict, ()  # a recipe's row figures (collective), on the bar
        self.run_padding = self.run_positions = 0
        self._reset()
        self.carried = self.restored = torch.zeros(0, dtype=torch.float64, device=accelerator.device)  # see `carry`
        if window is not None:  # a resumed run's (`window_state`): the first process holds every process's sums
            self.losses.copy_(window[:3])
            self.restored = window[3:] * accelerator.is_main_process
            self.padding, self.positions = self.padding + int(self.restored[0]), int(self.restored[1])
            self.throughput.add(int(window[3]) - int(window[4]))  # tokens/s counts this run's tokens only

    def _reset(self) -> None:
        self.padding = torch.zeros((), dtype=torch.long, device=self.accelerator.device)
        # on the device: the window's finite-loss sum (float64, as Python sums floats), finite steps, skipped steps
        self.losses = torch.zeros(3, dtype=torch.float64, device=self.accelerator.device)
        self.positions = 0

    def window_state(self) -> torch.Tensor:
        """The window not yet logged, for a checkpoint, so that a resumed run logs the same rows (collective): its
        losses (the same on every process), then its padding, positions and `carried` sums over all processes."""
        own = torch.stack([self.padding, torch.full_like(self.padding, self.positions)]).double()  # exact counts
        return torch.cat([self.losses, self.accelerator.reduce(torch.cat([own, self.carried]), "sum")]).cpu()

    def carry(self, sums: torch.Tensor) -> None:
        """A recipe's own window sums on the device (DPO's rewards, each process's): they travel with the window."""
        self.carried = sums.copy_(self.restored[2:]) if len(self.restored) > 2 else sums

    def count_tokens(self, batch: dict) -> None:
        """One micro-batch's positions and padding positions (no host sync: the padding count stays on the device)."""
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        if mask is not None:  # packed batches carry no mask: no padding
            self.padding += ids.numel() - mask.sum()
        self.positions += ids.numel()

    @property
    def padding_fraction(self) -> float:
        """Share of padding positions over the logged rows so far (all processes)."""
        return self.run_padding / max(self.run_positions, 1)

    def writes_row(self, step: int) -> bool:
        """Whether `step(step, ...)` writes a row (every `logging_steps`, and the last step)."""
        return step % self.logging_steps == 0 or step == self.total_steps

    def step(self, step: int, lr: float, checked) -> None:
        """Optimizer step `step` is done (`checked`: its common/guard.py check, its figures on the device unless
        read; a row's step has been read): advance the bar; every `logging_steps` and at the end, write a row."""
        self.bar.update(1)
        loss, _, norm = checked.values.detach().double()
        finite = torch.isfinite(loss)
        skipped = ~(finite & torch.isfinite(norm)) if checked.has_norm else ~finite  # the guard or the scaler skipped it
        self.losses += torch.stack([torch.where(finite, loss, 0.0), finite.double(), skipped.double()])
        if not self.writes_row(step):
            return
        acc = self.accelerator
        counts = acc.reduce(torch.stack([self.padding, torch.full_like(self.padding, self.positions)]), "sum")
        # one read: the token counts (all processes) and the window's losses (already over all processes)
        padding, positions, loss_sum, loss_steps, skipped = torch.cat([counts.double(), self.losses]).tolist()
        padding, positions = int(padding), int(positions)
        self.run_padding, self.run_positions = self.run_padding + padding, self.run_positions + positions
        pc = acc.parallelism_config  # real tokens (padding is wasted work), once per tp group that shares them
        self.throughput.add((positions - padding) // (pc.tp_size if pc else 1))
        tokens_per_second = self.throughput.report()
        row = {"step": step, "epoch": round(step / self.steps_per_epoch, 4) if self.steps_per_epoch else None,
               "loss": loss_sum / loss_steps if loss_steps else None, "lr": lr, "grad_norm": checked.grad_norm,
               "skipped_nonfinite_steps": int(skipped),
               "tokens_per_second": tokens_per_second, "padding_fraction": padding / max(positions, 1),
               "peak_memory_bytes": peak_memory_bytes(), **self.row_extras()}
        if self.peak_flops:
            row["mfu"] = tokens_per_second / acc.num_processes * self.flops_per_token / self.peak_flops
        if torch.cuda.is_available():  # what the caching allocator holds: the process's real GPU footprint
            row["peak_memory_reserved_bytes"] = torch.cuda.max_memory_reserved()
        self.writer.write(row)
        acc.log({k: v for k, v in row.items() if v is not None}, step=step)
        shown_loss = math.nan if row["loss"] is None else row["loss"]
        self.bar.set_postfix(**{k: f"{row[k]:.3f}" for k in self.bar_keys if k in row}, loss=f"{shown_loss:.4f}",
                             lr=f"{lr:.2e}", tok_s=f"{tokens_per_second:,.0f}", pad=f"{row['padding_fraction']:.2f}")
        self.last_row = row
        self._reset()

    def write_eval(self, step: int, eval_metrics: dict) -> None:
        """An evaluation's figures: to metrics.jsonl, the trackers and the log."""
        logger.info(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))
        self.writer.write({"step": step, **eval_metrics})
        self.accelerator.log(eval_metrics, step=step)

    def close(self) -> None:
        self.bar.close()

    def write_results(self, results: dict) -> None:
        """The run's final figures to all_results.json (main process), with the last row's loss, the process count
        and the peak memory."""
        if self.accelerator.is_main_process:
            write_all_results(self.output_dir, {**results, "train_loss": self.last_row.get("loss"),
                                                "num_processes": self.accelerator.num_processes,
                                                "peak_memory_bytes": peak_memory_bytes()})
            logger.info(f"Model, tokenizer, metrics.jsonl and all_results.json are in {self.output_dir}")


def metrics_rows_at(output_dir: str, step: int) -> int | None:
    """How many metrics.jsonl rows had been written when checkpoint step_N was saved (None: unknown)."""
    marker = os.path.join(output_dir, CHECKPOINT_DIR, f"step_{step}", COMPLETE_MARKER)
    if not os.path.isfile(marker):
        return None
    with open(marker, encoding="utf-8") as f:
        return json.load(f).get("metrics_rows")


def count_rows(path: str) -> int:
    """Complete lines in a text file (0 when it does not exist)."""
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8") as f:
        return sum(line.endswith("\n") for line in f)
