"""`python -m gpu_suite ...` (from the repository root): the suite's command line, gpu_suite/cli.py."""

import os
import sys

if "--dry-run" in sys.argv:  # the CPU plumbing check stays on the CPU even where a GPU is present (before torch)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from gpu_suite.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
