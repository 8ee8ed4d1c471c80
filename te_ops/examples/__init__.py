"""Runnable examples; the main job is ``python -m te_ops.examples.train_moe``."""
