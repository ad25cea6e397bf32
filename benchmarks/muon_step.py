#!/usr/bin/env python
"""Seconds per step of fused AdamW and `--optim muon`, timed in pairs: Newton-Schulz's cost on this machine.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/muon_step.py --model_preset tiny --repeats 16
    git show 229129d:common/features/muon.py > /tmp/muon_before.py    # the same, beside an earlier Muon
    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/muon_step.py --baseline_muon /tmp/muon_before.py
    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/muon_step.py --whole_step --repeats 10   # forward + backward too

The optimizers run one after the other (A B A B ...), each for --steps steps per turn after one untimed step, on the
same model: with random gradients (the optimizer step alone), or with --whole_step the forward, backward and
optimizer step of a batch of --batch_size x --block_size random tokens, fp32. Prints each one's median over the turns
and every turn's seconds per step (a busy machine shows as spread).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import common.features.muon as muon  # noqa: E402
from common.flags import ArgumentParser  # noqa: E402
from common.inputs.modeling import LLAMA_PRESETS  # noqa: E402
from common.optim import param_groups  # noqa: E402


def parse_args():
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model_preset", default="tiny", choices=tuple(LLAMA_PRESETS), help="The model's shape.")
    parser.add_argument("--repeats", type=int, default=8, help="Turns per optimizer.")
    parser.add_argument("--steps", type=int, default=5, help="Timed steps per turn.")
    parser.add_argument("--whole_step", action="store_true", help="Time forward + backward + optimizer step.")
    parser.add_argument("--batch_size", type=int, default=8, help="--whole_step: sequences per step.")
    parser.add_argument("--block_size", type=int, default=256, help="--whole_step: tokens per sequence.")
    parser.add_argument("--baseline_muon", help="A muon.py of another commit, timed beside this one's.")
    return parser.parse_args()


def muon_optimizer(module, model: torch.nn.Module) -> torch.optim.Optimizer:
    """`--optim muon`'s optimizer (common/features/muon.py or an earlier copy of it), the recipe's defaults."""
    matrices = module.muon_matrices(model)
    groups = [{"params": [p for p in model.parameters() if id(p) in matrices], "use_muon": True}]
    groups += [{**g, "params": [p for p in g["params"] if id(p) not in matrices]} for g in param_groups(model, 0.1)]
    return module.MuonWithAdamW([g for g in groups if g["params"]], lr=1e-3)


def main() -> None:
    args = parse_args()
    contenders = {"adamw_torch_fused": lambda model: torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, fused=True),
                  "muon": lambda model: muon_optimizer(muon, model)}
    if args.baseline_muon:
        spec = importlib.util.spec_from_file_location("baseline_muon", args.baseline_muon)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
        contenders["muon (baseline)"] = lambda model: muon_optimizer(baseline, model)
    batch = torch.randint(0, 8192, (args.batch_size, args.block_size))
    runs = {}
    for name, build in contenders.items():
        torch.manual_seed(0)  # the same initial model for each
        model = LlamaForCausalLM(LlamaConfig(vocab_size=8192, **LLAMA_PRESETS[args.model_preset]))
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        runs[name] = (model, build(model))

    def step(model, optimizer) -> None:
        if args.whole_step:
            optimizer.zero_grad(set_to_none=True)
            model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()

    seconds = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, (model, optimizer) in runs.items():
            step(model, optimizer)
            began = time.perf_counter()
            for _ in range(args.steps):
                step(model, optimizer)
            seconds[name].append((time.perf_counter() - began) / args.steps)
    print(f"{args.model_preset} preset, {torch.get_num_threads()} thread(s), "
          f"{'whole step' if args.whole_step else 'optimizer step'}:")
    for name, turns in seconds.items():
        each = " ".join(f"{t * 1e3:.0f}" for t in turns)
        print(f"  {name}: median {statistics.median(turns) * 1e3:.1f} ms  [{each}]")


if __name__ == "__main__":
    main()
