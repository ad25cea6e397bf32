"""Optional features, one module each, imported only by the recipes (never by the core): a recipe wires a feature in
a few lines marked `# feature: <name>`, so a copier sees which lines to delete. May import the core and
`common.inputs`."""
