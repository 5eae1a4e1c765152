"""Helpers shared by several test modules (fixtures live in conftest.py)."""

import os
import shutil


def merge_yaml(paths, domains=("math", "code"), dtype="float32"):
    lines = ["merge_method: task_arithmetic", f"base_model: {paths['base']}", "models:"]
    for domain in domains:
        lines += [f"  - model: {paths[domain]}", "    parameters: {weight: 0.5}"]
    lines.append(f"dtype: {dtype}")
    return "\n".join(lines) + "\n"


def merge_tiny(paths, out, domains=("math", "code")):
    """Merge with mergekit's own run_merge, the hook disabled (a plain merged directory)."""
    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    text = merge_yaml(paths, domains)
    config = MergeConfiguration.model_validate(yaml.safe_load(text))
    if os.path.exists(out):
        shutil.rmtree(out)
    run_merge(config, out, options=MergeOptions(quiet=True), config_source=text)
    return out
