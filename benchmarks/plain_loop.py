#!/usr/bin/env python
"""The reference loop for the benchmark: the pretraining job as the textbook PyTorch loop, without accelerate.

    python benchmarks/plain_loop.py --model_preset tiny --bf16 --max_steps 20 --logging_steps 10

Per optimizer step it does what a careful reader writes in ten lines, as nanoGPT does: forward with
`use_cache=False` (else transformers builds a KV cache in training and, compiled per layer, every decoder layer
recompiles on its `layer_idx`), `loss.backward()`, `optimizer.step()`, `scheduler.step()`, `zero_grad()` (under
autocast and a GradScaler when --bf16/--fp16 ask for it), with the recipe's optimizer (`--optim adamw_torch_fused`:
fused AdamW) and compilation (`--torch_compile`). No clipping (`--max_grad_norm` is ignored: compare with the recipe's
`--max_grad_norm 0` for the same work), no divergence guard, no stop signals. The loss is read only on
`--logging_steps` rows, before the timer stops: a row's time includes its steps' device work.

It shares the inputs of scripts/pretrain_llama.py: the same flags, data pipeline, tokenizer, blocks, shuffle and batch
(common/inputs/data.py), the same model and initialisation (common/inputs/modeling.py), optimizer and schedule
(common/optim.py). One process only; no evaluation, checkpoints or export; with --torch_compile, all_results.json
counts the graphs compiled. A row's loss is the step's last micro-batch's; with fixed-length blocks and without
clipping its losses equal the pretraining script's (tests/test_benchmark.py).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from accelerate import PartialState
from torch.utils.data import DataLoader, RandomSampler
from transformers import default_data_collator, get_scheduler, set_seed

from common.inputs.data import (HeldOut, Source, check_data_files, get_tokenizer, load_raw_datasets,
                               tokenize_and_pack)
from common.errors import fail
from common.flags import ArgumentParser, add_data_args, add_model_args, add_training_args
from common.metrics import (MetricsWriter, Throughput, peak_flops_per_device, peak_memory_bytes,
                            write_all_results)
from common.inputs.modeling import (PRESETS, build_causal_lm, check_block_size, count_parameters, flops_per_token,
                                    load_config)
from common.optim import create_optimizer, param_groups
from common.features.muon import add_muon_args, muon_matrices
from common.features.compile import add_compile_args, check_compile_flags, compile_counts, compile_model
from common.features.cpu_threads import use_all_cores
from common.flags import check_common_flags


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The pretraining job's flags, so that the benchmark gives both loops the same command line."""
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser, PRESETS)
    add_data_args(parser)
    add_training_args(parser)
    add_compile_args(parser)
    add_muon_args(parser)
    g = parser.add_argument_group("pretraining (as scripts/pretrain_llama.py)")
    g.add_argument("--block_size", type=int, default=256, help="Tokens per packed training sequence.")
    g.add_argument("--tokenizer_vocab_size", type=int, default=8192, help="Vocabulary of a tokenizer trained here.")
    g.add_argument("--streaming", action="store_true", help="Refused: this loop reads the map-style corpus.")
    g.add_argument("--sample_prompt", default="def ", help="Ignored (no sample here).")
    g.add_argument("--sample_max_new_tokens", type=int, default=64, help="Ignored (no sample here).")
    args = parser.parse_args(argv)
    check_common_flags(args)
    check_compile_flags(args)
    check_data_files(args.train_file, args.validation_file)
    if args.streaming:
        fail("--streaming is a scripts/pretrain_llama.py feature; this reference loop reads the map-style corpus")
    return args


def textbook_muon(args: argparse.Namespace, model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """--optim muon as torch's documentation writes it: torch.optim.Muon on the hidden matrices (the recipe's choice
    of them), AdamW on the rest, two optimizers stepped one after the other."""
    matrices = muon_matrices(model)
    muon = torch.optim.Muon([p for p in model.parameters() if id(p) in matrices], lr=args.muon_learning_rate or
                            args.learning_rate, weight_decay=args.weight_decay, momentum=args.muon_momentum,
                            nesterov=args.muon_nesterov, ns_steps=args.muon_ns_steps,
                            adjust_lr_fn=args.muon_adjust_lr_fn)
    rest = [{**group, "params": [p for p in group["params"] if id(p) not in matrices]}
            for group in param_groups(model, args.weight_decay)]
    adamw = torch.optim.AdamW([group for group in rest if group["params"]], lr=args.learning_rate,
                              betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, fused=True)
    return [muon, adamw]


def main() -> None:
    args = parse_args()
    config = load_config(args)
    check_block_size(config, args.block_size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        use_all_cores()  # the recipes' thread policy on CPUs
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    set_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    ga = args.gradient_accumulation_steps

    # common/inputs/data.py logs through accelerate and orders processes with `main_process_first()`: it gets the
    # single-process state, nothing else here uses accelerate.
    state = PartialState()
    source = Source.from_flags(args)
    raw = load_raw_datasets(source, HeldOut.from_flags(args), args.cache_dir)
    tokenizer = get_tokenizer(args, state, raw, None, args.tokenizer_vocab_size, source.text_column)
    data = tokenize_and_pack(state, raw, source, tokenizer, args.block_size, args.preprocessing_num_workers)["train"]
    sampler = RandomSampler(data, generator=torch.Generator())  # reseeded per epoch below, as accelerate does
    loader = DataLoader(data, sampler=sampler, batch_size=args.per_device_train_batch_size,
                        collate_fn=default_data_collator, num_workers=args.dataloader_num_workers,
                        pin_memory=args.dataloader_pin_memory and device.type == "cuda")
    steps_per_epoch = len(loader) // ga
    total_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)

    model = build_causal_lm(args, config, len(tokenizer)).to(device)
    _, total_params = count_parameters(model)
    step_flops = flops_per_token(model.config, total_params, model.get_input_embeddings().weight.numel(),
                                 args.block_size)
    optimizers = textbook_muon(args, model) if args.optim == "muon" else [create_optimizer(args, model)]
    warmup = args.warmup_steps if args.warmup_steps is not None else int(0.05 * total_steps)
    extra = {"scheduler_specific_kwargs": {"min_lr_rate": 0.1}} if args.lr_scheduler_type == "cosine_with_min_lr" \
        else {}
    schedulers = [get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                                num_training_steps=total_steps, **extra) for optimizer in optimizers]
    scheduler = schedulers[-1]  # AdamW's: the rate the rows log
    if args.torch_compile:  # the recipe's compilation: each decoder layer once (or the whole model, flagged)
        compile_model(model, args.torch_compile_whole_model, args.torch_compile_backend, args.torch_compile_mode)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.mixed_precision)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    metrics = MetricsWriter(args.output_dir, True)
    peak_flops = peak_flops_per_device()
    throughput = Throughput()
    step, row = 0, {}
    model.train()
    for epoch in range(math.ceil(total_steps / steps_per_epoch)):
        sampler.generator.manual_seed(args.seed + epoch)
        batches = iter(loader)
        for _ in range(min(steps_per_epoch, total_steps - step)):
            lr = scheduler.get_last_lr()[0]  # the step's learning rate, as the recipes log it
            for _ in range(ga):
                batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
                with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                    loss = model(**batch, use_cache=False).loss / ga  # training: no KV cache
                scaler.scale(loss).backward()
            for optimizer, each_scheduler in zip(optimizers, schedulers):
                scaler.step(optimizer)
                each_scheduler.step()
            scaler.update()
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            step += 1
            throughput.add(ga * batch["input_ids"].numel())
            if step % args.logging_steps == 0 or step == total_steps:
                step_loss = loss.item() * ga  # the only read: it waits for the device, then the timer stops
                tokens_per_second = throughput.report()
                row = {"step": step, "epoch": round(step / steps_per_epoch, 4), "loss": step_loss,
                       "lr": lr, "tokens_per_second": tokens_per_second,
                       "peak_memory_bytes": peak_memory_bytes()}
                if peak_flops:
                    row["mfu"] = tokens_per_second * step_flops / peak_flops
                if device.type == "cuda":
                    row["peak_memory_reserved_bytes"] = torch.cuda.max_memory_reserved()
                metrics.write(row)
                print(f"step {step}: loss {row['loss']:.4f} tok/s {tokens_per_second:,.0f}", flush=True)
    write_all_results(args.output_dir, {"train_loss": row.get("loss"), "train_steps": step, "num_processes": 1,
                                        "num_parameters": total_params, "peak_memory_bytes": peak_memory_bytes(),
                                        **(compile_counts() if args.torch_compile else {})})


if __name__ == "__main__":
    main()
