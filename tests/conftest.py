"""Shared test fixtures. Tests never touch the network: the hub is switched off for them and their subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from forked_runs import forkable, launch_forked, run_forked

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
CONFIGS = os.path.join(ROOT, "accelerate_configs")
# The core's optimizer and schedule at the core's rate: what a run names where it compares with AdamW (a peer loop, an
# old checkpoint, a copy without features) or needs fp32-exact engines (DeepSpeed's Muon, the pretraining default, is
# bf16 inside).
CORE_OPTIMIZER = ("--optim", "adamw_torch_fused", "--lr_scheduler_type", "cosine", "--learning_rate", "5e-4")
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
sys.path.insert(0, ROOT)
# DeepSpeed JIT-builds its C++ ops on first use: a per-user cache lets later runs reuse them.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(
    os.path.expanduser("~"), ".cache", "torch_extensions", f"py{sys.version_info[0]}{sys.version_info[1]}_cpu"))


def pin_this_worker_to_its_cores() -> None:
    """Under pytest-xdist, give each worker its own share of the cores; the runs it starts inherit it.

    A one-process run uses every core it sees (common/features/cpu_threads.py). With two workers on two cores, two
    such runs (or one beside the other worker's 2-process run) put more threads than cores to work, and OpenMP's
    threads then spin waiting for each other: a tiny model's 60 training steps took 1.7 s instead of 0.39 s with two
    such runs side by side, 58 s instead of 0.55 s beside two busy processes (measured on the 2-core machine).
    Pinned, each worker's runs see its cores only and pick their thread count from them; what a run computes does not
    depend on it."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not worker or count < 2 or len(cores) < 2:
        return
    index = int(worker.removeprefix("gw"))
    share = max(1, len(cores) // count)  # more workers than cores: one core each, in turn
    mine = cores[index * share % len(cores):][:share]
    os.sched_setaffinity(0, mine)
    import torch

    torch.set_num_threads(len(mine))


pin_this_worker_to_its_cores()


def launcher(config: str, num_processes: int = 2) -> list[str]:
    """`accelerate launch` with a file of accelerate_configs/, on a free port (test runs may overlap)."""
    return [ACCELERATE, "launch", "--config_file", os.path.join(CONFIGS, config), "--num_processes",
            str(num_processes), "--main_process_port", "0"]


def run_script(script: str, *args: str, launcher: list[str] | None = None, env: dict | None = None,
               timeout: int = 600, check: bool = True,
               launcher_output: bool | None = None) -> subprocess.CompletedProcess:
    """Run `scripts/<script>`, or a tool given by its absolute path (with `python`, or `launcher` such as
    `accelerate launch ...`), and return the result. `launcher_output`: the test reads what the launcher itself
    prints or returns, so the real launcher runs (default: when `check` is off, a failure's report)."""
    cmd = (launcher or [sys.executable]) + [os.path.join(SCRIPTS, script), *args]
    launcher_output = not check if launcher_output is None else launcher_output
    proc = None
    # The same run, its processes forked from one that imported the training stack once (tests/forked_runs.py);
    # a launched run whose launcher output the test reads gets the real launcher. A copied recipe that imports this
    # checkout's common/ (PYTHONPATH: the checkout) is forked too: the server imported that common/.
    copy_of_this_checkout = env == {"PYTHONPATH": ROOT}
    if (env is None or copy_of_this_checkout) and launcher is None and forkable(cmd[1], copy_of_this_checkout):
        proc = run_forked(cmd[1:], cwd=ROOT, env={**os.environ, **(env or {})}, timeout=timeout)
    elif env is None and launcher and launcher[:2] == [ACCELERATE, "launch"] and not launcher_output:
        proc = launch_forked(cmd, cwd=ROOT, env=dict(os.environ), timeout=timeout)
    if proc is None:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_losses(output_dir: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(output_dir) if "loss" in r}


def write_tiny_llama_task(d, rows: list[dict], tokenizer_texts: list[str], max_positions: int) -> dict[str, str]:
    """`rows` as d/train.jsonl (the first 64) and d/validation.jsonl (the rest), and in d/base a tiny Llama (seed 0)
    with a byte-level BPE tokenizer of 300 entries trained on `tokenizer_texts`: {"dir", "train", "validation",
    "model"}."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.inputs.data import train_bpe_tokenizer

    paths = {"dir": str(d)}
    for split, part in (("train", rows[:64]), ("validation", rows[64:])):
        paths[split] = str(d / f"{split}.jsonl")
        with open(paths[split], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    tokenizer = train_bpe_tokenizer(tokenizer_texts, 300)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=max_positions,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    paths["model"] = str(d / "base")
    LlamaForCausalLM(config).save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    return paths


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict[str, str]:
    """A small text corpus in train/validation jsonl files (varied, so a tokenizer and a model can learn from it)."""
    d = tmp_path_factory.mktemp("corpus")
    import random

    rng = random.Random(0)
    words = ("the model reads tokens and learns to predict the next one while the optimizer updates weights "
             "with gradients from a loss over batches of text").split()
    rows = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 120))) for _ in range(600)]
    paths = {}
    for split, part in (("train", rows[:540]), ("validation", rows[540:])):
        paths[split] = str(d / f"{split}.jsonl")
        with open(paths[split], "w") as f:
            f.writelines(json.dumps({"text": r}) + "\n" for r in part)
    return paths


@pytest.fixture(scope="session")
def dropout_config(tmp_path_factory) -> str:
    """A folder for --config_name: the `tiny` preset with attention dropout 0.1 (the presets have none), so that a
    pretraining resume test also checks that the resumed run draws the uninterrupted run's dropout masks."""
    from transformers import LlamaConfig

    from common.inputs.modeling import LLAMA_PRESETS

    path = tmp_path_factory.mktemp("dropout_config")
    LlamaConfig(**LLAMA_PRESETS["tiny"], attention_dropout=0.1).save_pretrained(path)
    return str(path)


# ---- damaged checkpoints -------------------------------------------------------------------------------------------
DAMAGES = ("truncated", "missing", "flipped")


def damage(checkpoint, name: str, kind: str) -> str:
    """Damage one file of a checkpoint folder as disks and copies do: cut to half its size, deleted, or one byte in
    its middle flipped (same size). Returns what verification must say about it."""
    path = os.path.join(checkpoint, name)
    size = os.path.getsize(path)
    if kind == "truncated":
        os.truncate(path, size // 2)
        return f"{name} is truncated ({size // 2:,} of {size:,} bytes)"
    if kind == "missing":
        os.remove(path)
        return f"{name} is missing"
    with open(path, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)[0]
        f.seek(size // 2)
        f.write(bytes([byte ^ 0x01]))
    return f"{name} fails its checksum (content changed, same size)"


def assert_each_damage_is_named(checkpoint, name: str, scratch) -> None:
    """A copy of `checkpoint` with `name` truncated, missing or with a flipped byte fails verification, naming it."""
    from common.features.checksums import verify

    assert verify(str(checkpoint)) == (True, None)
    for kind in DAMAGES:
        copy = os.path.join(scratch, f"{os.path.basename(checkpoint)}-{kind}")
        shutil.copytree(checkpoint, copy)
        expected = damage(copy, name, kind)
        assert verify(copy) == (True, expected), kind
        shutil.rmtree(copy)


def copy_checkpoints(source_dir, target_dir, *steps: int) -> None:
    """A fresh output folder holding copies of `source_dir`'s checkpoints at `steps` (an interrupted run's state)."""
    for step in steps:
        shutil.copytree(os.path.join(source_dir, "checkpoints", f"step_{step}"),
                        os.path.join(target_dir, "checkpoints", f"step_{step}"))


def code_at(commit: str, folder):
    """The recipes and common/ as they were at `commit` (from git), unpacked into `folder`; the test is skipped in a
    checkout without that commit (a shallow clone)."""
    if subprocess.run(["git", "-C", ROOT, "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True).returncode:
        pytest.skip(f"this checkout has no commit {commit[:7]} (a shallow clone)")
    os.makedirs(folder)
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit, "scripts", "common"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def skip_line(checkpoint, problem: str) -> str:
    """The line `--resume_from_checkpoint auto` prints for a damaged checkpoint it passes over."""
    return f"Skipping checkpoint {checkpoint}: {problem}; trying the one before it"


# ---- tiers ---------------------------------------------------------------------------------------------------------
# The fast tier (`pytest -m "not slow"`, the edit-run loop): in-process tests of every area, a few minutes in all.
# Every other test is marked `slow`: it starts training runs (`accelerate launch`, several seconds of imports each).
# Listed by file: "*" for the whole file, else the test functions (parametrized cases included).
FAST = {
    "test_code_layout.py": "*", "test_loops.py": "*",
    "test_compile.py": {"test_each_repeated_block_is_compiled_in_place_and_nothing_else",
                        "test_compile_flags_without_torch_compile_are_one_line",
                        "test_zero3_is_refused_in_one_line", "test_a_fallback_to_eager_is_said_and_counted"},
    "test_docs.py": "*", "test_steps.py": "*", "test_chat_data.py": "*",
    "test_fsdp.py": {"test_fsdp2_configs_shard_any_architecture_by_its_decoder_layers"},
    "test_gpu_suite.py": {"test_the_pretraining_rows_left_out_pass_the_recipes_flag_checks"},
    "test_exit_status.py": {"test_the_end_of_a_run_is_recorded_in_its_folder",
                            "test_a_folder_without_a_run_gets_nothing_and_a_stale_record_goes_at_start"}, "test_device_skip.py": "*",
    "test_accumulation.py": "*", "test_optim_and_modeling.py": "*",
    "test_upstream.py": {"test_the_workarounds_were_written_for_the_pinned_and_installed_versions",
                         "test_accelerate_has_no_public_list_of_prepared_objects_or_hooks",
                         "test_torch_schedulers_have_no_setter_for_the_last_lr_and_the_private_one_works",
                         "test_torch_schedulers_cannot_undo_a_step_and_taking_back_the_count_restores_the_state",
                         "test_configs_and_datasets_keep_no_public_name_for_what_is_read",
                         "test_upstream_still_warns_where_the_recipes_silence_it",
                         "test_tqdm_still_redraws_a_finished_bar_and_data_bars_print_it_once"},
    "test_activation_memory.py": {"test_every_mode_gives_the_gradients_of_no_checkpointing",
                                  "test_a_value_the_model_cannot_serve_is_one_line"},
    "test_chunked_loss.py": {"test_loss_and_gradients_equal_the_unchunked_ones",
                             "test_head_gradients_equal_the_unchunked_ones"},
    "test_liger.py": {"test_an_unsupported_model_type_is_refused_with_the_supported_ones",
                      "test_the_fused_loss_is_refused_with_chunked_cross_entropy_and_under_zero3",
                      "test_a_missing_liger_or_triton_is_refused_with_the_install_command",
                      "test_the_patch_gets_the_model_and_the_loss_choice_and_transformers_is_put_back",
                      "test_liger_picks_the_patch_of_the_models_family",
                      "test_liger_own_patch_is_put_back_and_keeps_the_state_dict"},
    "test_crash_safety.py": {"test_leftovers_are_ignored_by_latest_and_cleaned_and_pruning_keeps_the_newest",
                             "test_a_damaged_checkpoint_is_skipped_by_auto_and_refused_by_latest",
                             "test_the_processes_share_the_checksums_evenly"},
    "test_bad_inputs.py": {"test_the_checks_only_check", "test_output_dir_holding_what_the_run_loads_is_one_line",
                           "test_bad_preference_rows_are_one_line_before_any_work",
                           "test_bad_sft_rows_are_one_line_before_any_work",
                           "test_a_chat_row_among_text_rows_is_one_line_however_datasets_hands_it_over",
                           "test_a_chat_template_that_fails_on_the_first_row_is_one_line"},
    "test_configs.py": {"test_deepspeed_json_is_all_auto_and_valid", "test_contradicting_json_fails_in_one_line",
                        "test_zero_partitioning_follows_the_paper", "test_activations",
                        "test_the_cpu_cores_warning_gives_advice_the_config_can_take"},
    "test_finetune_dpo.py": {"test_prompt_tokens_are_the_prompts_alone_and_padding_is_right",
                             "test_loss_and_gradient_equal_a_plain_torch_computation",
                             "test_chunked_head_gives_the_same_loss_and_gradient",
                             "test_the_disabled_adapter_is_the_base_model",
                             "test_an_entry_of_another_base_or_split_under_this_key_is_never_read"},
    "test_finetune_grpo.py": {"test_loss_and_gradient_equal_the_definitions",
                              "test_a_completion_depends_only_on_its_key_and_samples_the_distribution",
                              "test_the_default_rewards_and_a_misused_reward_are_one_line",
                              "test_trl_reward_functions_are_called_as_trl_calls_them",
                              "test_a_step_without_reward_logs_nan_and_warns_once",
                              "test_a_function_that_scored_nothing_has_no_std",
                              "test_a_users_omp_num_threads_is_kept",
                              "test_the_kl_and_dropout_flags_say_what_trl_does",
                              "test_bad_flags_are_one_line_before_any_work",
                              "test_bad_prompts_are_one_line_naming_the_row"},
    "test_finetune_vlm.py": {"test_exactly_the_assistant_tokens_carry_labels",
                             "test_the_gpu_suite_row_passes_the_recipe_s_flag_checks",
                             "test_a_blank_image_changes_no_loss_or_gradient",
                             "test_accumulation_equals_one_batch_in_process_for_qwen2_vl",
                             "test_the_freezing_flags_and_lora_targets_find_each_part"},
    "test_finetune_causal_lm.py": {"test_prompt_tokens_are_masked_and_eos_is_learned",
                                   "test_chat_template_trains_on_assistant_turns_only"},
    "test_lora.py": {"test_the_wrapped_model_starts_as_the_base", "test_estimator_counts_the_adapter_and_the_4bit_base",
                     "test_the_adapter_names_a_local_base_by_its_absolute_path",
                     "test_adapter_inputs_stay_16bit_and_train_the_same_adapter"},
    "test_streaming.py": {"test_each_block_once_per_pass_over_the_processes", "test_loader_resumes_at_every_batch"},
    "test_mixture.py": {"test_map_style_shares_hold_at_every_step_and_sources_repeat_reshuffled",
                        "test_streaming_shares_are_within_two_percent", "test_a_streamed_mixture_resumes_at_any_batch",
                        "test_a_bad_mixture_is_one_line_before_any_work",
                        "test_a_bad_mixture_file_is_one_line_naming_the_source",
                        "test_a_mixture_file_trains_as_the_flags_do_and_a_source_without_text_is_one_line"},
    "test_faults.py": {"test_a_tokenizer_cache_killed_while_written_is_rebuilt_whole",
                       "test_a_damaged_cache_entry_is_rebuilt_and_said_in_one_line",
                       "test_an_entry_under_another_key_is_rebuilt_and_said_in_one_line",
                       "test_two_runs_building_one_entry_both_end_with_a_whole_one",
                       "test_a_full_disk_under_the_cache_is_one_line_and_leaves_nothing",
                       "test_the_base_fingerprint_tells_a_base_edited_in_the_middle",
                       "test_copy_recipe_misuse_is_one_line_and_never_strips_the_recipe",
                       "test_estimate_memory_misuse_is_one_line_and_offload_is_bounded_by_host_memory",
                       "test_a_full_disk_during_the_merged_export_is_one_line_and_leaves_no_part_of_it",
                       "test_a_sharded_model_is_checked_through_its_index",
                       "test_a_metrics_row_the_disk_takes_only_in_part_is_not_written_at_all",
                       "test_a_full_disk_under_tensorboard_is_one_line_naming_its_file"},
    "test_async_checkpoint.py": {"test_deepspeed_is_refused_in_one_line"},
    "test_memory_estimate.py": {"test_the_answer_adds_up_reads_only_the_config_and_says_if_it_fits",
                                "test_each_flag_moves_its_part", "test_a_command_the_estimate_cannot_serve_is_one_line",
                                "test_tensor_parallel_states_are_16_bytes_a_held_parameter_and_wide_activations_split",
                                "test_a_tensor_parallel_command_gives_its_per_gpu_parts_and_refuses_lora",
                                "test_every_figure_the_estimator_prints_agrees_with_the_others",
                                "test_a_hub_id_the_machine_cannot_reach_is_one_line_at_once",
                                "test_the_vision_language_flags_move_their_parts"},
    "test_muon.py": {"test_muon_update_is_the_definition_and_the_rest_get_adamw",
                     "test_wsd_learning_rate_is_the_definition",
                     "test_the_memory_estimate_keeps_one_momentum_buffer_per_muon_matrix",
                     "test_muon_where_it_does_not_apply_is_one_line"},
    "test_tensor_parallel.py": {"test_what_tensor_parallelism_cannot_serve_is_one_line",
                                "test_the_upstream_lines_that_force_the_torch_path_still_hold",
                                "test_torch_still_prints_the_two_warnings_tensor_parallel_runs_silence"},
}


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: starts training runs; left out of the fast tier (-m 'not slow')")
    config.option.loadscopereorder = False  # = --no-loadscope-reorder: xdist keeps SLOWEST_FIRST's order


# The files by the time they take one worker (docs/tests.md), slowest first; the rest (under 12 s each) after them.
# `--dist loadfile` hands out files in this order (xdist's own order, by number of tests, is switched off below), so
# the two workers end on short files, together, not one on a 2-minute file alone.
SLOWEST_FIRST = ("test_gpu_suite.py", "test_multinode.py", "test_mixture.py", "test_slurm.py", "test_preemption.py",
                 "test_distributed.py",
                 "test_compile.py", "test_muon.py", "test_bad_inputs.py", "test_memory_estimate.py", "test_pretrain.py",
                 "test_crash_safety.py", "test_lora.py", "test_benchmark.py", "test_finetune_dpo.py",
                 "test_finetune_vlm.py", "test_async_checkpoint.py", "test_chunked_loss.py", "test_tensor_parallel.py",
                 "test_lora_engines.py",
                 "test_resume_guard.py", "test_faults.py", "test_init_parity.py",
                 "test_finetune_classifier.py", "test_fsdp.py", "test_resumed_rows.py", "test_finetune_grpo.py",
                 "test_activation_memory.py", "test_streaming.py")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        fast = FAST.get(item.path.name, set())
        if fast != "*" and item.originalname not in fast:
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order is kept
