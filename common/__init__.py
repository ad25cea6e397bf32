"""The core the three recipes share: what any training loop needs on any engine (DDP, ZeRO, FSDP2).

Its modules import only each other, and only downwards; optional pieces live in two subpackages that the core never
imports: `common/inputs/` (what a copier replaces: corpora, tokenizer, model presets) and `common/features/` (each
optional feature, wired into a recipe in a few lines under its flag). See docs/layout.md.
"""
