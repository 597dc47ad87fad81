"""Parallelism applied from outside the model: parallel dims and meshes, FSDP2 (and later TP/PP)."""
