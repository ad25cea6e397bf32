"""What a copier replaces with their own: the corpora and the embedded default data, the tokenizer, packing, the
model presets and how a model is built. Imports the core (`common.*`), never `common.features`."""
