"""Pieces shared by two or more scripts in `scripts/`. Each module has one job; none knows which script calls it."""
