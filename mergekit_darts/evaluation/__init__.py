"""Scoring repaired models: lm-eval tasks, multi-seed comparison statistics, the code sandbox."""
