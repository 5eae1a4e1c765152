"""The package as PyPI would ship it: the wheel's metadata, and the built wheel installed in a fresh
virtualenv running ``--help`` and the README's offline example from there (not from this checkout).

One wheel build and one install for the whole module: the install is ``--no-deps`` with this
environment's site-packages appended as a plain path (its .pth files, this checkout's editable
install and hook included, are not processed there), so it costs seconds, not a download.
"""

import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import mergekit_darts

REPO = Path(__file__).resolve().parents[1]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MERGEKIT_DARTS_DISABLE")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    from hatchling.builders.wheel import WheelBuilder

    dist = tmp_path_factory.mktemp("dist")
    return next(WheelBuilder(str(REPO)).build(directory=str(dist), versions=["standard"]))


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    """A fresh virtualenv with only the wheel installed; returns its bin directory."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "env")], check=True)
    python = root / "env" / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                              "--no-index", "-q", wheel], capture_output=True, text=True, env=_env(), cwd=root)
    assert install.returncode == 0, install.stderr[-2000:]
    return root / "env" / "bin"


def _metadata(wheel):
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(archive.read(name).decode()), archive.namelist()


def test_wheel_metadata_is_ready_for_pypi(wheel):
    meta, names = _metadata(wheel)
    assert meta["Name"] == "mergekit-darts" and meta["Version"] == mergekit_darts.__version__
    assert meta["License-Expression"] == "LGPL-3.0-only" and meta["Requires-Python"] == ">=3.11"
    assert set(meta.get_all("License-File")) == {"LICENSE", "COPYING"}
    classifiers = meta.get_all("Classifier")
    assert "Programming Language :: Python :: 3.11" in classifiers and any(c.startswith("Topic ::") for c in classifiers)
    assert not any(c.startswith("License ::") for c in classifiers)  # PEP 639: the expression only
    assert {"eval", "data", "sweep", "test"} <= set(meta.get_all("Provides-Extra"))
    assert meta["Description-Content-Type"] == "text/markdown"
    assert meta.get_payload().strip() == (REPO / "README.md").read_text().strip()
    # what the commands need at run time ships; the tests and the checkout's own files do not
    for shipped in ("mergekit_darts/demo/tiny_offline.yml", "mergekit_darts/demo/math_prompts.jsonl",
                    "mergekit_darts/remote_code/modeling_darts.py", "mergekit_darts_hook.pth",
                    "mergekit_darts/evaluation/lmeval_tasks/gsm8k_darts.yaml"):
        assert shipped in names, shipped
    assert not any(n.startswith(("tests/", "benchmarks/", "examples/")) for n in names)


def test_sdist_holds_the_sources_and_nothing_generated(tmp_path):
    from hatchling.builders.sdist import SdistBuilder

    sdist = next(SdistBuilder(str(REPO)).build(directory=str(tmp_path)))
    with tarfile.open(sdist) as archive:
        names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "LICENSE", "constraints.txt", "hooks/mergekit_darts_hook.pth",
            "mergekit_darts/cli/__init__.py"} <= names
    assert not any(n.startswith(("benchmarks/", ".venv", "tiny_out", "darts_demo")) for n in names)


def test_the_installed_wheel_runs_help_and_the_offline_example(venv, wheel, tmp_path):
    """From a directory that is not the checkout: --help, then the README's offline example
    (`mergekit-darts example`, `mergekit-yaml tiny_offline.yml out`, `info`) with the wheel's code."""
    python, cli = str(venv / "python"), str(venv / "mergekit-darts")

    def run(args, **kwargs):
        result = subprocess.run(args, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600, **kwargs)
        assert result.returncode == 0, (args, result.stdout[-2000:], result.stderr[-3000:])
        return result

    where = run([python, "-c", "import mergekit_darts; print(mergekit_darts.__file__)"]).stdout.strip()
    assert where.startswith(str(venv.parent)) and not where.startswith(str(REPO))
    assert "Commands:" in run([cli, "--help"]).stdout
    assert run([cli, "--version"]).stdout.strip() == f"mergekit-darts, version {mergekit_darts.__version__}"
    run([cli, "example"])
    # mergekit-yaml as its console script runs it (mergekit is one of the appended dependencies)
    merge = run([python, "-c", "import sys; from mergekit.scripts.run_yaml import main; "
                 "sys.argv = ['mergekit-yaml', 'tiny_offline.yml', 'out']; main()"])
    assert "torch_dtype" not in merge.stderr
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DartsLlamaForCausalLM"]  # the wheel's start-up hook ran the surgery
    info = run([cli, "info", "out"]).stdout
    assert "domain math:" in info and "domain code:" in info
    # an extra's install hint names this installation: the wheel file it came from
    hint = run([python, "-c", "from mergekit_darts.extras import install_command; print(install_command('eval'))"])
    assert hint.stdout.strip() == f"pip install '{wheel}[eval]'"


def test_install_hints_follow_how_the_package_was_installed(monkeypatch, tmp_path):
    from mergekit_darts import extras

    # this checkout's own editable install (what the README's set-up commands make)
    assert extras.install_command("eval", cwd=str(REPO)) == 'pip install -c constraints.txt -e ".[eval]"'
    assert extras.install_command("eval", cwd=str(tmp_path)) == (
        f"pip install -c {REPO / 'constraints.txt'} -e '{REPO}[eval]'")
    cases = [
        ((True, None), "pip install 'mergekit-darts[eval]'"),  # from an index: no direct URL
        ((False, None), 'pip install -c constraints.txt -e ".[eval]"'),  # a checkout on PYTHONPATH
        ((True, {"url": f"file://{REPO}", "dir_info": {}}), 'pip install -c constraints.txt ".[eval]"'),
        ((True, {"url": "https://github.com/o/r", "vcs_info": {"vcs": "git", "commit_id": "abc"}}),
         "pip install 'mergekit-darts[eval] @ git+https://github.com/o/r'"),
    ]
    for installation, expected in cases:
        monkeypatch.setattr(extras, "_installation", lambda installation=installation: installation)
        assert extras.install_command("eval", cwd=str(REPO)) == expected, installation
    monkeypatch.setattr(extras, "_installation", lambda: (True, None))
    assert extras.needs("mergekit-darts sweep (Ray)", "sweep") == (
        "mergekit-darts sweep (Ray) needs the [sweep] extra: pip install 'mergekit-darts[sweep]'")
