"""Benchmarks: time a training script under each speed/memory technique, against a plain PyTorch loop.

    python benchmarks/benchmark.py --quick        # the table: tokens/s, peak memory, MFU, loss per method
    python benchmarks/plain_loop.py --help        # the reference loop (the pretraining job without accelerate)
    python benchmarks/grpo_vs_trl.py --help       # one GRPO step beside TRL's GRPOTrainer (TRL in its own venv)
"""
