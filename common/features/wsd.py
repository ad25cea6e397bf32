"""--lr_scheduler_type warmup_stable_decay: warmup, a constant learning rate, and a decay over the run's last
--lr_decay_ratio of steps (transformers' `get_wsd_schedule`).

Its reason to exist: the stable phase has no fixed end. A run resumed from a stable-phase checkpoint with a larger
--max_steps trains exactly as a run planned that long from the start (the stable phase stretches, the decay moves to
the new end), and a decay can be branched from any stable-phase checkpoint into a new --output_dir by resuming it with
a --max_steps that ends the decay where wanted (docs/muon-and-wsd.md gives both commands). Give --warmup_steps
explicitly for that: the default warmup is 5% of the run, so a longer --max_steps would lengthen it too.
"""

from __future__ import annotations

import argparse

from common.errors import fail

WSD = "warmup_stable_decay"


def add_wsd_args(parser: argparse.ArgumentParser) -> None:
    """`warmup_stable_decay` becomes a choice of --lr_scheduler_type, with the decay's flags."""
    schedule = next(action for action in parser._actions if "--lr_scheduler_type" in action.option_strings)
    schedule.choices = (*schedule.choices, WSD)  # argparse has no public way to extend a flag's choices
    g = parser.add_argument_group("warmup-stable-decay")
    g.add_argument("--lr_decay_ratio", type=float, default=0.2,
                   help="warmup_stable_decay: share of the run's optimizer steps that decay (the last ones).")
    g.add_argument("--lr_decay_type", default="1-sqrt", choices=("1-sqrt", "linear", "cosine"),
                   help="warmup_stable_decay: the decay's shape.")
    g.add_argument("--min_lr_ratio", type=float, default=0.0,
                   help="warmup_stable_decay: the learning rate the decay ends at, as a share of the peak.")


def check_wsd_flags(args: argparse.Namespace) -> None:
    if not 0 < args.lr_decay_ratio <= 1:
        fail(f"--lr_decay_ratio must be in (0, 1] (got {args.lr_decay_ratio})")
    if not 0 <= args.min_lr_ratio <= 1:
        fail(f"--min_lr_ratio must be in [0, 1] (got {args.min_lr_ratio})")


def decay_steps(lr_decay_ratio: float, total_steps: int) -> int:
    return round(lr_decay_ratio * total_steps)


def wsd_schedule(args: argparse.Namespace, total_steps: int) -> dict | None:
    """The schedule's extra arguments for common/optim.py (None: another schedule)."""
    if args.lr_scheduler_type != WSD:
        return None
    return {"num_decay_steps": decay_steps(args.lr_decay_ratio, total_steps), "decay_type": args.lr_decay_type,
            "min_lr_ratio": args.min_lr_ratio}


def stable_phase_resume(saved: dict, current: dict, step: int) -> str | None:
    """One line when a resume changes only --max_steps (and the decay's flags) of a warmup-stable-decay run whose
    checkpoint is in its stable phase under both plans (None otherwise): the run continues as planned that way."""
    if not (saved.get("lr_scheduler_type") == current.get("lr_scheduler_type") == WSD and step
            and saved.get("max_steps", 0) > 0 and current.get("max_steps", 0) > 0):
        return None
    other = [name for name in current if name in saved and saved[name] != current[name]
             and name not in ("max_steps", "lr_decay_ratio", "lr_decay_type", "min_lr_ratio")]
    starts = [h["max_steps"] - decay_steps(h["lr_decay_ratio"], h["max_steps"]) for h in (saved, current)]
    if other or step > min(starts) or current.get("warmup_steps") is None:
        return None
    return (f"Warmup-stable-decay: the checkpoint at step {step} is in its stable phase; this run decays over steps "
            f"{starts[1]}-{current['max_steps']} (planned: {starts[0]}-{saved['max_steps']}), as a run planned with "
            f"--max_steps {current['max_steps']} from the start")
