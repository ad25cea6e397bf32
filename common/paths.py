"""The names of the files and folders a run writes into --output_dir, in one place (every module that reads or writes
one of them imports it from here)."""

CHECKPOINT_DIR = "checkpoints"  # <output_dir>/checkpoints/step_N: resumable training states
COMPLETE_MARKER = "checkpoint_complete.json"  # written last inside a checkpoint: the checkpoint is whole
LEFTOVER_PREFIX = ".tmp-"  # interrupted saves, prunes, overwrites and metrics trims: never resumed, removed at start
METRICS_FILE = "metrics.jsonl"  # one JSON object per logged step and evaluation
RESULTS_FILE = "all_results.json"  # the run's final figures
EXIT_STATUS_FILE = "exit_status.json"  # how the last command on the folder ended (common/features/exit_status.py)
RUN_RECORD = "run.json"  # inside a checkpoint: what a resume of it must agree with
TOKENIZER_DIR = "tokenizer"  # inside a checkpoint: the tokenizer it was trained with
LOCK_FILE = ".lock"  # held by the live run that owns the folder
LOGS_DIR = "logs"  # tracker logs (tensorboard, ...)
MERGED_DIR = "merged"  # --merge_adapter: the adapter merged into a full-precision copy of the base
