"""Shared fixtures: tiny random model families built on the fly (nothing is downloaded)."""

import atexit
import os
import shutil
import tempfile

# `pytest -n 2` (the README's command) runs two worker processes: each gets its own cache of
# trust_remote_code modules (transformers copies the emitted modeling files there; two workers
# writing the same files at once could import a half-written one) and one torch thread, so the two
# workers share the two cores instead of oversubscribing them
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix=f"hf_modules_{os.environ['PYTEST_XDIST_WORKER']}_")
    atexit.register(shutil.rmtree, os.environ["HF_MODULES_CACHE"], True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from helpers import merge_tiny

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """A test that calls a script's main() (which sets torch's threads, e.g. to 2) must not leave the worker
    with them: a later in-process run would then differ in the last float bits from the same run in a
    subprocess, which keeps OMP_NUM_THREADS=1 (seen: an extract's held-out KL 6e-5 apart)."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


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


@pytest.fixture
def merged_copy(tiny_family, tmp_path):
    """A fresh copy of the plain merged directory that a test may modify."""
    out = tmp_path / "merged"
    shutil.copytree(tiny_family["merged"], out)
    return str(out)


@pytest.fixture(scope="session")
def tied_merged(tmp_path_factory):
    """A tiny Llama whose LM head is its input embedding matrix (stands in for a tied merge)."""
    from mergekit_darts.tiny import make_random_model

    path = tmp_path_factory.mktemp("tied") / "merged"
    make_random_model(str(path), seed=5, tie_word_embeddings=True)
    return str(path)
