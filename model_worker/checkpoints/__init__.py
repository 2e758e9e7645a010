"""Model resolution and checkpoints: names to directories, the model cache, GGUF conversion and the
tiny seeded model."""
