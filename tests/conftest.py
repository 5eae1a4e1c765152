"""Shared fixtures: tiny random model families built on the fly (nothing is downloaded)."""

import os
import shutil

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """A random tiny Llama base, math/code experts (base + random delta) and their task-arithmetic
    merge made by mergekit itself. Returns a dict of paths: base, math, code, merged."""
    from mergekit_darts.tiny import make_family

    root = tmp_path_factory.mktemp("family")
    paths = make_family(str(root), arch="llama", domains=["math", "code"], seed=0)
    paths["merged"] = str(root / "merged")
    merge_tiny(paths, paths["merged"])
    return paths


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


@pytest.fixture
def merged_copy(tiny_family, tmp_path):
    """A fresh copy of the plain merged directory that a test may modify."""
    out = tmp_path / "merged"
    shutil.copytree(tiny_family["merged"], out)
    return str(out)
