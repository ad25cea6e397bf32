"""The core the recipes share: what any training loop needs on any engine. It never imports its two tiers,
`common/inputs/` (what a copier replaces) and `common/features/` (optional features). See docs/layout.md."""
