"""Reward functions (scripts/finetune_grpo.py), named on the command line, checked before any work and called as TRL
1.16's `GRPOTrainer._calculate_rewards` calls them, so that a function written for TRL works here unchanged.

TRL calls each function with keywords only: `prompts` (as the rows hold them: text or chat turns), `completions`
(text; chat prompts: `[{"role": "assistant", "content": ...}]`), `completion_ids`, every other column of the rows by
its name (but `completion` and `completion_ids`, which TRL leaves out), `trainer_state` (transformers' `TrainerState`:
`global_step`, the optimizer steps done, and `max_steps`), `log_extra(column, values)` and `log_metric(name, value)`.
An `async def` function (or an object whose `__call__` is one, or a `functools.partial` of one) is awaited; a batch's
async functions run together on one event loop kept for the run, as TRL's. A function returns one value per
completion: a number (bools and numpy numbers as well), or None for a completion it cannot score (NaN is the same, as
in TRL, which turns None into NaN).

So `f(completions, **kwargs)`, `f(prompts, completions, answer, **kwargs)`, functions taking `trainer_state` or
`log_metric`, `trl.rewards`' functions (`accuracy_reward(completions, solution, **kwargs)`, the callables that
`get_soft_overlong_punishment(...)` returns) all work. Refused in one line, as TRL would fail on them: a function
that cannot take those keywords (no `**kwargs` and one of them not named, or a required positional-only
parameter), before any model or data work; one that requires a column the data lacks, once the data is read.
`log_metric` values are averaged over the calls since the last metrics row (and over processes) and logged under
their name (`eval_<name>` in evaluations), as TRL logs them; `log_extra` is accepted and its values dropped: TRL
adds them to its table of completions, which this recipe does not keep.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
from collections import defaultdict
from collections.abc import Callable

import torch
from accelerate.utils import gather_object
from transformers import TrainerState

from common.errors import fail

FIXED_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
LEFT_OUT_COLUMNS = ("completion", "completion_ids", "__index__")  # TRL's (with the prompt's); ours: the row's place


# ---- the default task's rewards: programs anyone can read ----------------------------------------------------------
def compiles(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """1 when the prompt (a signature and docstring) followed by the completion compiles as Python (nothing runs)."""
    scores = []
    for prompt, completion in zip(prompts, completions):
        try:
            compile(prompt + completion, "<completion>", "exec")
            scores.append(1.0)
        except (SyntaxError, ValueError):
            scores.append(0.0)
    return scores


def stays_in_function(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """1 when the completion is a function body: it has a line of code, and every line that is not blank is indented
    (nothing after the function: no second definition, no text at the module's level)."""
    scores = []
    for completion in completions:
        lines = [line for line in completion.splitlines() if line.strip()]
        scores.append(float(bool(lines) and all(line[0] in " \t" for line in lines)))
    return scores


DEFAULT_REWARDS = (compiles, stays_in_function)


class RewardError(Exception):
    """A reward function's misuse, said in one line by the recipe on every process."""


def load_reward_funcs(specs: list[str]) -> list[Callable]:
    """`FILE.py:NAME` or `package.module:NAME` -> the functions, each checked to take TRL's keywords; one line naming
    the spec otherwise (before any model or data work)."""
    funcs = []
    for spec in specs:
        where, _, name = spec.rpartition(":")
        if not where or not name:
            fail(f"--reward_funcs {spec}: give FILE.py:NAME or package.module:NAME")
        if where.endswith(".py"):
            if not os.path.isfile(where):
                fail(f"--reward_funcs {spec}: no such file {where}")
            module_name = f"reward_{hashlib.sha256(os.path.abspath(where).encode()).hexdigest()[:8]}"
            loaded = importlib.util.spec_from_file_location(module_name, where)
            module = importlib.util.module_from_spec(loaded)
            sys.modules[module_name] = module  # dataclasses and pickling look a module up there
            load = lambda: loaded.loader.exec_module(module)  # noqa: E731
        else:
            module = None
            load = lambda: importlib.import_module(where)  # noqa: E731
        try:
            module = load() or module
        except Exception as e:  # the user's code: say which file and why, in one line
            fail(f"--reward_funcs {spec}: importing {where} failed ({type(e).__name__}: {e})")
        func = getattr(module, name, None)
        if not callable(func):
            fail(f"--reward_funcs {spec}: {where} has no function {name!r}")
        problem = keyword_problem(func)
        if problem:
            fail(f"--reward_funcs {spec}: {problem}")
        funcs.append(func)
    return funcs


def keyword_problem(func: Callable) -> str | None:
    """Why TRL's call `func(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=...,
    log_extra=..., log_metric=...)` would fail whatever the columns, or None."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): let the call decide
        return None
    takes = f"{callable_name(func)}{inspect.signature(func)}"
    required_positional = [p.name for p in parameters if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if required_positional:
        return (f"{takes} requires the positional-only parameter {required_positional[0]!r}; TRL passes keywords "
                f"only ({', '.join(FIXED_KEYWORDS)} and the data's columns)")
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [k for k in FIXED_KEYWORDS if k not in named]
    return (f"{takes} cannot take the keyword {missing[0]!r}, which TRL passes to every reward function with "
            f"{', '.join(k for k in FIXED_KEYWORDS if k != missing[0])} and the data's columns: add **kwargs"
            ) if missing else None


def check_reward_columns(funcs: list[Callable], columns: list[str], source: str) -> None:
    """One line for a column named as one of TRL's own keywords, and for a reward function that requires a column
    the data lacks (TRL: a TypeError at the first step)."""
    columns = [c for c in columns if c not in LEFT_OUT_COLUMNS]
    clash = [c for c in columns if c in FIXED_KEYWORDS]
    if clash:
        fail(f"{source} has a column {clash[0]!r}, the name of a keyword TRL passes to reward functions itself: "
             "rename the column")
    keywords = dict.fromkeys([*FIXED_KEYWORDS, *columns])
    for func in funcs:
        try:
            inspect.signature(func).bind(**keywords)
        except ValueError:  # no signature to read
            continue
        except TypeError as e:
            fail(f"reward function {callable_name(func)} cannot be called with the columns of {source} "
                 f"({', '.join(columns) or 'none'}): {e}")


def callable_name(func: Callable) -> str:
    """A function's name, a partial's function's, an object's class's (TRL's names for the metrics)."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def is_async_callable(func: Callable) -> bool:
    """A call returns a coroutine: an `async def`, a partial of one, or an object whose `__call__` is one."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


class RewardFunctions:
    """The run's reward functions and what TRL hands them besides the rows: `__call__` scores a micro-batch."""

    def __init__(self, funcs: list[Callable], prompt_column: str) -> None:
        self.funcs, self.prompt_column = funcs, prompt_column
        self.names = [callable_name(f) for f in funcs]
        self.trainer_state = TrainerState()  # global_step, max_steps, epoch: set by the recipe
        self.split = "train"
        self.logged = {"train": defaultdict(lambda: [0.0, 0]), "eval": defaultdict(lambda: [0.0, 0])}
        self.loop = asyncio.new_event_loop() if any(map(is_async_callable, funcs)) else None

    def log_metric(self, name: str, value: float) -> None:
        total = self.logged["eval" if self.split != "train" else "train"][name]
        total[0], total[1] = total[0] + float(value), total[1] + 1

    def log_extra(self, column: str, values: list) -> None:
        """TRL adds the values to its table of completions; this recipe keeps none."""

    def logged_metrics(self, accelerator, mode: str = "train") -> dict[str, float]:
        """`log_metric`'s means since the last call, over all processes (collective)."""
        logged = self.logged[mode]
        names = sorted(set(gather_object(list(logged)))) if accelerator.num_processes > 1 else sorted(logged)
        if not names:
            return {}
        sums = torch.tensor([logged[n] if n in logged else [0.0, 0] for n in names], dtype=torch.float64,
                            device=accelerator.device)
        logged.clear()
        sums = accelerator.reduce(sums, "sum").tolist()
        prefix = "eval_" if mode == "eval" else ""
        return {f"{prefix}{name}": total / count if count else math.nan for name, (total, count) in zip(names, sums)}

    def __call__(self, rows: list[dict], completions: list, completion_ids: list[list[int]], split: str
                 ) -> torch.Tensor:
        """(completions x functions) rewards, NaN where a function returned None (or NaN); one line naming the
        function and the prompts' rows when one raises, returns the wrong count or a value that is not a number."""
        self.split = split
        prompts = [row[self.prompt_column] for row in rows]
        columns = {key: [row[key] for row in rows] for key in rows[0]
                   if key != self.prompt_column and key not in LEFT_OUT_COLUMNS}
        kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns,
                      trainer_state=self.trainer_state, log_extra=self.log_extra, log_metric=self.log_metric)
        numbers = [str(i + 1) for i in dict.fromkeys(row["__index__"] for row in rows)]  # each prompt once
        where = f"{'row' if len(numbers) == 1 else 'rows'} {', '.join(numbers)} of the {split} split's prompts"
        outputs = {}
        for j, func in enumerate(self.funcs):
            if not is_async_callable(func):
                outputs[j] = self.call(func, j, kwargs, where)
        waiting = [j for j, func in enumerate(self.funcs) if is_async_callable(func)]
        if waiting:
            async def together():  # the loop's own gather, as TRL's `asyncio.gather` on its loop
                return await asyncio.gather(*(self.await_one(j, kwargs, where) for j in waiting))
            outputs.update(zip(waiting, self.loop.run_until_complete(together())))
        scores = torch.full((len(rows), len(self.funcs)), math.nan, dtype=torch.float64)
        for j, values in sorted(outputs.items()):
            scores[:, j] = self.checked(j, values, rows)
        return scores

    def call(self, func: Callable, j: int, kwargs: dict, where: str):
        try:
            return func(**kwargs)
        except Exception as e:
            raise RewardError(f"reward function {self.names[j]} raised {type(e).__name__}: {e} (on {where})") from e

    async def await_one(self, j: int, kwargs: dict, where: str):
        try:
            return await self.funcs[j](**kwargs)
        except Exception as e:
            raise RewardError(f"reward function {self.names[j]} raised {type(e).__name__}: {e} (on {where})") from e

    def checked(self, j: int, values, rows: list[dict]) -> torch.Tensor:
        """One function's values as floats (None and NaN: NaN); what TRL could not turn into a tensor, or an
        infinite value (it would make every advantage NaN), is refused in one line."""
        name = self.names[j]
        if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or len(values) != len(rows):
            count = len(values) if hasattr(values, "__len__") else type(values).__name__
            raise RewardError(f"reward function {name} returned {count} values for {len(rows)} completions")
        out = []
        for value, row in zip(values, rows):
            if torch.is_tensor(value) and value.numel() == 1:
                value = value.item()
            if value is not None and (not isinstance(value, numbers.Real) or math.isinf(value)):
                raise RewardError(f"reward function {name} returned {value!r} for row {row['__index__'] + 1} of "
                                  f"the {self.split} split's prompts: give a finite number, or None for a "
                                  "completion it cannot score")
            out.append(math.nan if value is None else float(value))
        return torch.tensor(out, dtype=torch.float64)


def reward_functions(args: argparse.Namespace) -> RewardFunctions:
    """--reward_funcs loaded and checked (the default task's two rewards without data flags), --reward_weights
    counted against them: one line otherwise, before any model or data work."""
    if not args.reward_funcs and (args.train_file or args.dataset_name):
        fail("no reward function: pass --reward_funcs FILE.py:NAME ... (the built-in rewards score the default task)")
    funcs = load_reward_funcs(args.reward_funcs) if args.reward_funcs else list(DEFAULT_REWARDS)
    if args.reward_weights and len(args.reward_weights) != len(funcs):
        fail(f"--reward_weights has {len(args.reward_weights)} weights for {len(funcs)} reward functions")
    return RewardFunctions(funcs, args.prompt_column)
