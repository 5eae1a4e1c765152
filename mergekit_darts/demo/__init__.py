"""The built-in demo: a tiny model family trained on the CPU, merged, repaired and scored."""
