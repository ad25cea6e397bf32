"""Part 1, correctness on CUDA: one row per precision, optimizer, memory technique and launcher, and their checks."""

from __future__ import annotations

import json
import math
import os

from gpu_suite.checks import export_problems, loss_figure, loss_problems, verdict, weight_distance
from gpu_suite.suite import CLASSIFIER, DPO, FAIL, PRETRAIN, SFT, Outcome, Row, Suite

BF16_RTOL = 2e-2  # bf16 keeps 8 significant bits (0.4 % per rounding); a few steps of different summation orders


def pretrain_row(name: str, what: str, flags: list[str], config: str | None = None, cuda_only: str | None = None,
                 needs: tuple[str, ...] = (), slow: bool = False) -> Row:
    """A pretraining run with `flags` (under an accelerate config when given): loss finite and falling, export loads."""
    def check(suite: Suite) -> Outcome:
        run = suite.train(name, PRETRAIN, suite.pretrain_args() + flags, config)
        if run.error:
            return Outcome(FAIL, run.error)
        return verdict(loss_problems(run, suite.settings.steps) + export_problems(run.out),
                       loss_figure(run) + "; export loads")
    return Row(name, 1, what, check, cuda_only, needs, slow, flags=tuple(flags))


def check_bf16(suite: Suite) -> Outcome:
    run = suite.reference_run()
    if run.error:
        return Outcome(FAIL, run.error)
    return verdict(loss_problems(run, suite.settings.steps) + export_problems(run.out),
                   loss_figure(run) + "; export loads")


def check_fp16(suite: Suite) -> Outcome:
    """fp16 with loss scaling: a step whose gradients overflowed (non-finite norm) is skipped and so is its scheduler
    step (the next step's lr is the same), while every other step moves the schedule on (warmup + decay: every lr
    differs: cosine, not the default warmup-stable-decay, whose stable phase holds the lr)."""
    run = suite.train("fp16", PRETRAIN, suite.pretrain_args() + ["--fp16", "--warmup_steps", "4",
                                                                 "--lr_scheduler_type", "cosine"])
    if run.error:
        return Outcome(FAIL, run.error)
    steps = [r for r in run.metrics if "lr" in r]
    skipped = [r["step"] for r in steps if not math.isfinite(r["grad_norm"])]
    wrong = [a["step"] for a, b in zip(steps, steps[1:])
             if (a["step"] in skipped) != (b["lr"] == a["lr"])]
    problems = loss_problems(run, suite.settings.steps) + export_problems(run.out)
    if wrong:
        problems.append(f"the schedule moved on an overflowed step or stood still on a good one at steps {wrong}")
    note = f"{len(skipped)} overflowed step(s) {skipped} left the lr alone" if skipped else \
        "no step overflowed (schedule check not exercised)"
    return verdict(problems, f"{loss_figure(run)}; {note}", {"skipped_steps": skipped})


def check_eager(suite: Suite) -> Outcome:
    """Eager attention trains, and its first loss (same init, same batch) equals SDPA's within bf16 tolerance."""
    run = suite.train("eager", PRETRAIN, suite.pretrain_args() + ["--bf16", "--attn_implementation", "eager"])
    reference = suite.reference_run()
    if run.error or reference.error:
        return Outcome(FAIL, run.error or f"the bf16 reference run failed: {reference.error}")
    problems = loss_problems(run, suite.settings.steps) + export_problems(run.out)
    gap = abs(run.losses[0] - reference.losses[0]) / abs(reference.losses[0]) if run.losses and reference.losses \
        else math.inf
    if not gap <= BF16_RTOL:
        problems.append(f"first loss differs from SDPA's by {gap:.2e} (tolerance {BF16_RTOL})")
    return verdict(problems, f"{loss_figure(run)}; first loss vs SDPA {gap:.1e}", {"relative_gap": gap})


def check_accumulation(suite: Suite) -> Outcome:
    """2 x 4 accumulation sees the same 8 sequences per optimizer step as 8 x 1: the same losses and weights within
    bf16 tolerance."""
    batch = suite.settings.batch
    flags = ["--bf16", "--per_device_train_batch_size", str(batch // 4), "--gradient_accumulation_steps", "4"]
    run = suite.train("accumulation", PRETRAIN, suite.pretrain_args() + flags)
    reference = suite.reference_run()
    if run.error or reference.error:
        return Outcome(FAIL, run.error or f"the bf16 (8 x 1) run failed: {reference.error}")
    problems, loss_gap, weight_gap = same_training(run, reference, suite.settings.steps, "8 x 1")
    return verdict(problems, f"{batch // 4}x4 vs {batch}x1: losses within {loss_gap:.1e}, weights {weight_gap:.1e}",
                   {"loss_gap": loss_gap, "weight_gap": weight_gap})


def same_training(run, reference, steps: int, of: str) -> tuple[list[str], float, float]:
    """(problems, largest relative loss gap, relative weight distance) of `run` against `reference`'s, both within
    bf16 tolerance."""
    problems = loss_problems(run, steps)
    gaps = [abs(a - b) / abs(b) for a, b in zip(run.losses, reference.losses)]
    loss_gap = max(gaps) if gaps and len(run.losses) == len(reference.losses) else math.inf
    weight_gap = weight_distance(reference.out, run.out)
    if not loss_gap <= BF16_RTOL:
        problems.append(f"losses differ from {of}'s by up to {loss_gap:.2e} (tolerance {BF16_RTOL})")
    if not weight_gap <= BF16_RTOL:
        problems.append(f"weights differ from {of}'s by {weight_gap:.2e} relative (tolerance {BF16_RTOL})")
    return problems, loss_gap, weight_gap


def sft_run(suite: Suite, name: str, flags: list[str]):
    """scripts/finetune_causal_lm.py from a tiny Llama on the suite's prompt/completion pairs, bf16, 8 rows a step."""
    return suite.train(name, SFT, ["--model_name_or_path", suite.data["sft_model"], "--train_file",
                                   suite.data["sft_train"], "--validation_file", suite.data["sft_validation"],
                                   "--max_seq_length", "256", "--learning_rate", "1e-3", "--max_steps",
                                   str(suite.settings.steps), "--per_device_train_batch_size", "8",
                                   "--logging_steps", "1", "--seed", "0", "--bf16", *flags])


def sft_reference_run(suite: Suite):
    """The `sft` row's run (8 x 1, transformers' layers and loss): what the Liger row compares with."""
    return suite.memo("sft", lambda: sft_run(suite, "sft", []))


def check_sft(suite: Suite) -> Outcome:
    """scripts/finetune_causal_lm.py on prompt/completion pairs (loss on the completions) from a tiny base model."""
    run = sft_reference_run(suite)
    if run.error:
        return Outcome(FAIL, run.error)
    return verdict(loss_problems(run, suite.settings.steps) + export_problems(run.out),
                   loss_figure(run) + "; export loads")


def dpo_run(suite: Suite, name: str, flags: list[str], config: str | None = None):
    """scripts/finetune_dpo.py from the SFT row's tiny Llama on the suite's preference pairs, bf16, 8 pairs a step."""
    return suite.train(name, DPO, ["--model_name_or_path", suite.data["sft_model"], "--train_file",
                                   suite.data["dpo_train"], "--validation_file", suite.data["dpo_validation"],
                                   "--max_seq_length", "256", "--learning_rate", "1e-3", "--max_steps",
                                   str(suite.settings.steps), "--per_device_train_batch_size", "8",
                                   "--logging_steps", "1", "--seed", "0", "--bf16", *flags], config)


def dpo_reference_run(suite: Suite):
    """The `dpo` row's run (live frozen reference): what the precomputed row compares with."""
    return suite.memo("dpo", lambda: dpo_run(suite, "dpo", []))


def dpo_accuracy(run) -> float:
    """The held-out pairs' rewards/accuracies after training (all_results.json), NaN when absent."""
    path = os.path.join(run.out, "all_results.json")
    if not os.path.isfile(path):
        return math.nan
    with open(path, encoding="utf-8") as f:
        return json.load(f).get("eval_rewards/accuracies", math.nan)


def check_dpo(suite: Suite, name: str = "dpo", flags: tuple[str, ...] = (), config: str | None = None) -> Outcome:
    """A DPO run: loss finite and falling from log 2, held-out rewards/accuracies above 0.5, the export loads."""
    run = dpo_reference_run(suite) if name == "dpo" else dpo_run(suite, name, list(flags), config)
    if run.error:
        return Outcome(FAIL, run.error)
    accuracy = dpo_accuracy(run)
    problems = loss_problems(run, suite.settings.steps) + export_problems(run.out)
    if not accuracy > 0.5:
        problems.append(f"held-out rewards/accuracies {accuracy:.3f}, not above 0.5")
    return verdict(problems, f"{loss_figure(run)}; held-out rewards/accuracies {accuracy:.2f}; export loads",
                   {"eval_rewards/accuracies": accuracy})


def check_dpo_precomputed(suite: Suite) -> Outcome:
    """--precompute_ref_log_probs (one reference pass before training, then freed) trains as the live reference
    does: the same losses and weights within bf16 tolerance (TRL#6403: precomputed values that crashed)."""
    run, reference = dpo_run(suite, "dpo_precomputed", ["--precompute_ref_log_probs"]), dpo_reference_run(suite)
    if run.error or reference.error:
        return Outcome(FAIL, run.error or f"the dpo (live reference) run failed: {reference.error}")
    problems, loss_gap, weight_gap = same_training(run, reference, suite.settings.steps, "the live reference")
    return verdict(problems, f"vs live reference: losses within {loss_gap:.1e}, weights {weight_gap:.1e}",
                   {"loss_gap": loss_gap, "weight_gap": weight_gap})


LIGER = ["--use_liger_kernel"]


def same_as(run, reference, of: str, steps: int) -> Outcome:
    """`run` trained as `reference` did: the same losses and weights within bf16 tolerance; its export loads."""
    if run.error or reference.error:
        return Outcome(FAIL, run.error or f"{of}'s run failed: {reference.error}")
    problems, loss_gap, weight_gap = same_training(run, reference, steps, of)
    return verdict(problems + export_problems(run.out),
                   f"vs {of}: losses within {loss_gap:.1e}, weights {weight_gap:.1e}; export loads",
                   {"loss_gap": loss_gap, "weight_gap": weight_gap})


def check_liger(suite: Suite) -> Outcome:
    """Pretraining with Liger's kernels and fused loss = the bf16 row; the sample is generated after they are put
    back (on the CPU, where Triton cannot run)."""
    run = suite.train("liger", PRETRAIN, suite.pretrain_args() + ["--bf16"] + LIGER)
    return same_as(run, suite.reference_run(), "the bf16 row", suite.settings.steps)


def check_sft_liger(suite: Suite) -> Outcome:
    """SFT 4 x 2 with Liger = the sft row's 8 x 1: the fused loss honours num_items_in_batch (a mean per micro-batch
    would log about twice the loss)."""
    run = sft_run(suite, "sft_liger", LIGER + ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps",
                                               "2"])
    return same_as(run, sft_reference_run(suite), "the sft row (8 x 1)", suite.settings.steps)


def check_dpo_liger(suite: Suite) -> Outcome:
    """DPO with Liger's rope, RMSNorm and SwiGLU in the policy and the reference (no fused loss) = the dpo row."""
    return same_as(dpo_run(suite, "dpo_liger", LIGER), dpo_reference_run(suite), "the dpo row", suite.settings.steps)


def check_tp(suite: Suite) -> Outcome:
    """accelerate_configs/tp.yaml on 2 GPUs (tensor parallel 2, both GPUs read the same 8 sequences) = the bf16 row's
    one GPU, within bf16 tolerance; the export (full tensors) loads on one process."""
    run = suite.train("tp", PRETRAIN, suite.pretrain_args() + ["--bf16"], config="tp.yaml", processes=2)
    return same_as(run, suite.reference_run(), "the bf16 row (one GPU)", suite.settings.steps)


CHANCE_LOSS = math.log(2)  # two balanced labels: what a classifier that learned nothing scores


def check_classifier(suite: Suite) -> Outcome:
    """scripts/finetune_classifier.py learns: accuracy >= 0.9 where chance is 0.5 (64 balanced rows: 58 right by
    chance has odds of about 1e-11), an evaluation loss at most 0.6, below chance's ln 2 = 0.693 by more than noise,
    and a falling training loss. The packaged MiniLM in one epoch (6 steps: accuracy 1.0, loss 0.48 on the CPU), as
    in tests/test_finetune_classifier.py; a tiny BERT from scratch (where the package is absent) in 15 (90 steps at
    3e-3: accuracy 1.0, loss 0.001 on the CPU; with the MiniLM's 6 steps it scored 0.5 and 0.695 on an H200)."""
    precision = ["--bf16"] if suite.cuda else []
    minilm = suite.data["cls_model_name"] == "all-MiniLM-L6-v2"
    schedule = (["--num_train_epochs", "1", "--learning_rate", "2e-4", "--freeze_embeddings"] if minilm else
                ["--num_train_epochs", "15", "--learning_rate", "3e-3"])
    run = suite.train("classifier", CLASSIFIER, [
        "--model_name_or_path", suite.data["cls_model"], "--train_file", suite.data["cls_train"],
        "--validation_file", suite.data["cls_validation"], "--per_device_train_batch_size", "16", "--group_by_length",
        "--logging_steps", "1", "--seed", "0", *schedule, *precision])
    if run.error:
        return Outcome(FAIL, run.error)
    with open(os.path.join(run.out, "all_results.json"), encoding="utf-8") as f:
        results = json.load(f)
    accuracy, eval_loss = results.get("eval_accuracy", math.nan), results.get("eval_loss", math.nan)
    problems = loss_problems(run, 6 if minilm else 90) + export_problems(run.out, head="classifier")
    if not accuracy >= 0.9:
        problems.append(f"accuracy {accuracy:.3f} < 0.9 (chance: 0.5)")
    if not eval_loss <= 0.6:
        problems.append(f"eval loss {eval_loss:.3f} > 0.6 (chance: {CHANCE_LOSS:.3f})")
    return verdict(problems, f"{suite.data['cls_model_name']}: accuracy {accuracy:.3f}, eval loss {eval_loss:.3f}, "
                   f"{loss_figure(run)}", {"eval_accuracy": accuracy, "eval_loss": eval_loss})


def part1_rows() -> list[Row]:
    bnb, ds = ("bitsandbytes",), ("deepspeed",)
    one_gpu = "DeepSpeed on one GPU"
    rows = [
        Row("bf16", 1, "bf16 autocast, SDPA attention, 8 x 1 (the reference of eager and accumulation)", check_bf16),
        Row("fp16", 1, "fp16 with loss scaling; an overflowed step leaves the schedule alone", check_fp16,
            cuda_only="fp16 loss scaling needs CUDA (the scripts refuse it on a CPU)"),
        pretrain_row("tf32", "fp32 weights, TF32 matmuls (--tf32)", ["--mixed_precision", "no", "--tf32"],
                     cuda_only="TF32 needs an NVIDIA GPU (Ampere or newer)"),
        Row("eager", 1, "eager attention; first loss equals SDPA's", check_eager),
        pretrain_row("compile", "--torch_compile (inductor), bf16; the export has no _orig_mod. keys",
                     ["--bf16", "--torch_compile"], slow=True),
        pretrain_row("fused_adamw", "--optim adamw_torch_fused, bf16", ["--bf16", "--optim", "adamw_torch_fused"]),
        pretrain_row("adamw_8bit", "--optim adamw_8bit (bitsandbytes), bf16", ["--bf16", "--optim", "adamw_8bit"],
                     needs=bnb),
        pretrain_row("paged_adamw_8bit", "--optim paged_adamw_8bit (non-paged fallback on a CPU), bf16",
                     ["--bf16", "--optim", "paged_adamw_8bit"], needs=bnb),
        pretrain_row("adafactor", "--optim adafactor, bf16", ["--bf16", "--optim", "adafactor"]),
        pretrain_row("gradient_checkpointing", "--gradient_checkpointing, bf16",
                     ["--bf16", "--gradient_checkpointing"]),
        pretrain_row("moe", "--model_preset moe-tiny (Mixtral-style top-2 of 4 experts), bf16",
                     ["--bf16", "--model_preset", "moe-tiny"]),
        Row("accumulation", 1, "2 x 4 accumulation = 8 x 1 within bf16 tolerance (losses and weights)",
            check_accumulation),
    ]
    for stage in ("zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"):
        rows.append(pretrain_row(stage, f"DeepSpeed {stage.replace('_', ' + ')} ({one_gpu}), bf16, export gathered",
                                 ["--bf16"], config=f"deepspeed_{stage}.yaml", needs=ds, slow="offload" in stage))
    rows += [
        pretrain_row("fsdp2", "FSDP2 full shard on one process (fsdp2.yaml, bf16), export gathered", [],
                     config="fsdp2.yaml"),
        Row("tp", 1, "tensor parallel 2 (tp.yaml, 2 GPUs) = the bf16 row within bf16 tolerance, export gathered",
            check_tp, cuda_only="tensor parallelism over NCCL needs 2 GPUs (tests/test_tensor_parallel.py: gloo)",
            gpus=2),
        pretrain_row("fp8", "FP8 matmuls through torchao (fp8.yaml)", [], config="fp8.yaml", needs=("torchao",),
                     cuda_only="FP8 matmuls need an NVIDIA GPU of compute capability 8.9+ (H100/H200)", slow=True),
        Row("sft", 1, "scripts/finetune_causal_lm.py: prompt/completion SFT of a tiny Llama, bf16", check_sft),
        Row("dpo", 1, "scripts/finetune_dpo.py: DPO of the SFT row's tiny Llama, live reference, bf16", check_dpo),
        Row("dpo_precomputed", 1, "DPO with --precompute_ref_log_probs = the live reference (bf16 tolerance)",
            check_dpo_precomputed),
        Row("dpo_zero3", 1, "DPO under DeepSpeed ZeRO-3 (the reference partitioned, not deep-copied), export gathered",
            lambda suite: check_dpo(suite, "dpo_zero3", config="deepspeed_zero3.yaml"), needs=ds),
        Row("classifier", 1, "scripts/finetune_classifier.py learns: accuracy >= 0.9, eval loss <= 0.6 (chance 0.693)",
            check_classifier),
    ]
    cuda = "Liger kernels are Triton: CUDA only (--use_liger_kernel refuses a CPU)"
    rows += [Row("liger", 1, "--use_liger_kernel, pretraining, bf16 = the bf16 row (losses, weights)", check_liger,
                 cuda, ("liger_kernel",)),
             Row("sft_liger", 1, "--use_liger_kernel, SFT 4 x 2 = the sft row's 8 x 1 (bf16 tolerance)",
                 check_sft_liger, cuda, ("liger_kernel",)),
             Row("dpo_liger", 1, "--use_liger_kernel in DPO (no fused loss) = the dpo row (bf16 tolerance)",
                 check_dpo_liger, cuda, ("liger_kernel",))]
    return rows
