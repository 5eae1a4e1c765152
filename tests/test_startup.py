"""The .pth start-up hook and the command line's start-up: cheap, disable-able, and never able to
break plain mergekit (issue 13 "Start-up cost", issue 14 "import error ... must never break mergekit").

Every case is a real subprocess; the hook line is this checkout's hooks/mergekit_darts_hook.pth,
processed by ``site.addsitedir`` exactly as ``site`` processes an installed one.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from helpers import merge_yaml

REPO = Path(__file__).resolve().parents[1]
HOOK = REPO / "hooks" / "mergekit_darts_hook.pth"
HEAVY = ("torch", "transformers", "mergekit", "pydantic", "yaml", "numpy", "click.testing")


def _env(pythonpath=None, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MERGEKIT_DARTS_DISABLE")}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **extra)
    return env


def _site_with_hook(tmp_path) -> Path:
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    shutil.copyfile(HOOK, site_dir / HOOK.name)
    return site_dir


def _python_with_site(site_dir, code, pythonpath=None, **env):
    """``python -S``: no installed .pth runs; then ``site_dir``'s .pth files as site would run them.
    Runs in ``site_dir`` so that the current directory does not make the checkout importable."""
    script = f"import site; site.addsitedir({str(site_dir)!r}); " + code
    return subprocess.run([sys.executable, "-S", "-c", script], env=_env(pythonpath, **env), cwd=site_dir,
                          capture_output=True, text=True, timeout=300)


def _with_dependencies(path) -> str:
    """``path`` plus this environment's site-packages as a plain path entry (its .pth files unprocessed)."""
    import sysconfig

    return os.pathsep.join([str(path), sysconfig.get_path("purelib")])


FINDER = "any(type(f).__name__ == '_MergekitFinder' for f in sys.meta_path)"


def test_hook_line_installs_the_finder_and_imports_nothing_heavy(tmp_path):
    site_dir = _site_with_hook(tmp_path)
    code = f"import sys, json; print(json.dumps([{FINDER}, [m for m in {HEAVY!r} if m in sys.modules]]))"
    result = _python_with_site(site_dir, code, pythonpath=REPO)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert json.loads(result.stdout) == [True, []]


def test_disabled_hook_imports_nothing_at_all(tmp_path):
    site_dir = _site_with_hook(tmp_path)
    code = ("import sys, json; print(json.dumps([" + FINDER + ", "
            "sorted(m for m in sys.modules if m.startswith('mergekit')), 'importlib.abc' in sys.modules]))")
    result = _python_with_site(site_dir, code, pythonpath=REPO, MERGEKIT_DARTS_DISABLE="1")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert json.loads(result.stdout) == [False, [], False]


def test_hook_does_not_import_importlib_abc(tmp_path):
    """``importlib.abc`` was ~45 ms of every Python process's start-up (the issue's measurement)."""
    site_dir = _site_with_hook(tmp_path)
    result = _python_with_site(site_dir, f"import sys; print({FINDER}, 'importlib.abc' in sys.modules)",
                               pythonpath=REPO)
    assert result.stdout.split() == ["True", "False"], result.stderr


def test_missing_package_is_silent(tmp_path):
    """A leftover hook file without the package (e.g. ``python -I`` hides the checkout): no noise."""
    site_dir = _site_with_hook(tmp_path)
    result = _python_with_site(site_dir, "import sys; print('ok', 'mergekit_darts' in sys.modules)",
                               pythonpath=tmp_path / "empty")
    assert result.returncode == 0 and result.stdout.split() == ["ok", "False"]
    assert result.stderr == ""


def test_broken_package_prints_one_line_not_a_traceback(tmp_path):
    site_dir = _site_with_hook(tmp_path)
    broken = tmp_path / "broken" / "mergekit_darts"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise RuntimeError('simulated broken install')\n")
    result = _python_with_site(site_dir, "print('ok')", pythonpath=broken.parent)
    assert result.returncode == 0 and result.stdout.strip() == "ok"
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "simulated broken install" in lines[0], result.stderr
    assert "Traceback" not in result.stderr and "Error processing line" not in result.stderr


def test_isolated_mode_prints_nothing():
    """``python -I`` in this environment (its installed hook file): no output at all."""
    result = subprocess.run([sys.executable, "-I", "-c", "pass"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stderr == ""


BROKEN_HOOK = "import sys; sys.modules['mergekit_darts.hook'] = None  # any import error inside the package\n"


def test_import_error_in_the_package_leaves_mergekit_merge_importable(tmp_path):
    site_dir = _site_with_hook(tmp_path)
    code = BROKEN_HOOK + ("import mergekit.merge as m; "
                          "print(callable(m.run_merge), hasattr(m.run_merge, '__mergekit_darts_original__'))")
    result = _python_with_site(site_dir, code.replace("  # any import error inside the package\n", "; "),
                               pythonpath=_with_dependencies(REPO))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", "False"]
    warnings = [line for line in result.stderr.splitlines() if "mergekit-darts" in line]
    assert len(warnings) == 1 and "without surgery support" in warnings[0], result.stderr
    assert "Traceback" not in result.stderr


def test_import_error_in_the_package_still_runs_plain_mergekit_yaml(tiny_family, tmp_path):
    """``mergekit-yaml`` (its real entry point) merges a plain config although the hook cannot load."""
    cfg = tmp_path / "plain.yml"
    cfg.write_text(merge_yaml(tiny_family))
    out = tmp_path / "out"
    code = BROKEN_HOOK + ("import sys; from mergekit.scripts.run_yaml import main; "
                          f"sys.argv = ['mergekit-yaml', {str(cfg)!r}, {str(out)!r}]; main()")
    result = subprocess.run([sys.executable, "-c", code], env=_env(REPO), capture_output=True, text=True,
                            timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert sum("without surgery support" in line for line in result.stderr.splitlines()) == 1


def test_help_and_version_import_neither_torch_nor_mergekit():
    code = (
        "import sys, json\n"
        "from mergekit_darts.cli import main\n"
        "seen = {}\n"
        "for flag in ('--help', '--version'):\n"
        "    try:\n"
        "        main([flag], standalone_mode=True)\n"
        "    except SystemExit as done:\n"
        "        assert done.code in (0, None), done.code\n"
        "    seen[flag] = sorted(m for m in ('torch', 'transformers', 'mergekit', 'pydantic', 'numpy') if m in sys.modules)\n"
        "print(json.dumps(seen))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=_env(REPO, MERGEKIT_DARTS_DISABLE="1"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    last = result.stdout.strip().splitlines()[-1]
    assert json.loads(last) == {"--help": [], "--version": []}
    assert "mergekit-darts, version" in result.stdout and "Commands:" in result.stdout


# --- the command line: every --help and the metadata commands without torch (issue 26) ----------

def _imports_after(args_list, cwd=None) -> dict:
    """{args: the heavy modules imported by the time ``mergekit-darts ARGS`` returned}, one process."""
    code = (
        "import sys, json\n"
        "from mergekit_darts.cli import main\n"
        f"seen = {{}}\n"
        f"for args in {args_list!r}:\n"
        "    try:\n"
        "        main(list(args), standalone_mode=True)\n"
        "    except SystemExit as done:\n"
        "        assert done.code in (0, None), (args, done.code)\n"
        "    seen[' '.join(args)] = sorted(m for m in ('torch', 'transformers', 'mergekit', 'peft', 'numpy',"
        " 'matplotlib') if m in sys.modules)\n"
        "print(json.dumps(seen))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=_env(REPO, MERGEKIT_DARTS_DISABLE="1"),
                            capture_output=True, text=True, timeout=120, cwd=cwd)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_every_command_help_imports_neither_torch_nor_mergekit():
    from mergekit_darts.cli import COMMANDS

    seen = _imports_after([(name, "--help") for name in COMMANDS])
    assert seen == {f"{name} --help": [] for name in COMMANDS}


def test_info_reads_an_output_without_torch(tmp_path):
    out = tmp_path / "v010"
    shutil.copytree(REPO / "tests" / "data" / "v0_1_0_output", out)
    assert _imports_after([("info", str(out)), ("info", str(out), "--json")]) == {
        f"info {out}": [], f"info {out} --json": []}


def test_info_reads_the_shape_as_the_emitted_model_does():
    """``layout.read_shape`` (torch-free, for ``info``) is ``SurgeryShape.from_meta`` without torch."""
    import pytest

    from mergekit_darts.output import layout
    from mergekit_darts.remote_code import surgery

    assert layout.SHAPE_FORMAT_VERSION == surgery.FORMAT_VERSION and layout.SHAPE_KEYS == surgery._SHAPE_KEYS
    v1 = {"method": "darts", "rank": 4, "head_rank": 2, "max_positions": 8}
    for meta in (v1, {**v1, "format_version": 2, "content": "linear"},
                 {**v1, "format_version": 3, "content": "relu", "depth": 1, "depth_rank": 8}):
        shape = surgery.SurgeryShape.from_meta(meta)
        assert layout.read_shape(meta) == {**shape.to_meta(), "format_version": shape.format_version}
    for bad in ({**v1, "format_version": 99}, {"method": "darts", "format_version": 3}, ["not", "a", "dict"]):
        with pytest.raises(ValueError) as model_error:
            surgery.SurgeryShape.from_meta(bad)
        with pytest.raises(ValueError) as info_error:
            layout.read_shape(bad)
        assert str(info_error.value) == str(model_error.value)


def _reference_run_command():
    """``run`` built the way mergekit builds its own commands, from mergekit.options itself."""
    import click
    from mergekit.options import PrettyPrintHelp, add_merge_options

    from mergekit_darts.cli.repair import run_command

    @click.command("run", cls=PrettyPrintHelp, help=run_command.help)
    @click.argument("config_file", metavar="CONFIG_FILE")
    @click.argument("out_path", metavar="OUT_PATH")
    @add_merge_options
    def reference(merge_options, config_file, out_path):
        return merge_options

    return reference


def test_run_declares_exactly_mergekits_merge_options():
    import click

    from mergekit_darts.cli.repair import run_command

    reference = _reference_run_command()
    ours = [p.to_info_dict() for p in run_command.params]
    theirs = [p.to_info_dict() for p in reference.params]
    assert [p["name"] for p in ours] == [p["name"] for p in theirs]
    for mine, real in zip(ours, theirs):
        assert mine == real, (mine["name"], {k: (mine[k], real.get(k)) for k in mine if mine[k] != real.get(k)})

    def help_text(command):
        with click.Context(command, info_name="run") as ctx:
            return command.get_help(ctx)

    assert help_text(run_command) == help_text(reference)


def test_run_builds_the_merge_options_mergekit_would():
    import click
    from click.testing import CliRunner
    from mergekit.options import add_merge_options as mergekits

    from mergekit_darts.cli.merge_options import add_merge_options as ours

    def capture(decorate):
        built = []

        @click.command()
        @decorate
        def command(merge_options):
            built.append(merge_options)

        return command, built

    for args in ([], ["--cuda", "--out-shard-size", "1B", "-vv", "-j", "3", "--no-copy-tokenizer", "--random-seed", "7",
                      "--lora-merge-cache", "/tmp/x", "--write-threads", "2"], ["--gpu-rich", "--out-shard-size", "500M"]):
        results = []
        for decorate in (ours, mergekits):
            command, built = capture(decorate)
            outcome = CliRunner().invoke(command, args, catch_exceptions=False)
            assert outcome.exit_code == 0, outcome.output
            results.append(built[0])
        assert results[0] == results[1], args
    command, _ = capture(ours)
    bad = CliRunner().invoke(command, ["--out-shard-size", "lots"])
    assert bad.exit_code == 2 and "'lots' is not a parameter count" in bad.output


# --- quiet by default: known third-party noise filtered unless verbose (issue 26) ---------------

BNB_NOISE = ("import logging, mergekit; logging.getLogger('bitsandbytes.backends.cpu.ops').warning("
             "'Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already "
             "`pip install kernels`', \"No module named 'kernels'\"); "
             "logging.getLogger('bitsandbytes.backends.cpu.ops').warning('a real bitsandbytes problem')")


def test_bitsandbytes_kernel_noise_is_filtered_in_processes_that_import_mergekit(tmp_path):
    """bitsandbytes logs this at import (via mergekit -> peft) on CPUs with AVX512-BF16; the hook's
    filter is in place from mergekit's first import on, and other records of that logger still print."""
    site_dir = _site_with_hook(tmp_path)
    quiet = _python_with_site(site_dir, BNB_NOISE, pythonpath=_with_dependencies(REPO))
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "gemm_4bit_forward" not in quiet.stderr and "a real bitsandbytes problem" in quiet.stderr
    shown = _python_with_site(site_dir, BNB_NOISE, pythonpath=_with_dependencies(REPO), MERGEKIT_DARTS_VERBOSE="1")
    assert "Failed to load CPU gemm_4bit_forward" in shown.stderr


TORCH_DTYPE_NOISE = ("import mergekit, transformers; config = transformers.PretrainedConfig(); "
                     "config.torch_dtype = 'float32'")  # what mergekit.merge does to every merged config


def test_mergekits_torch_dtype_deprecation_is_filtered_unless_verbose(tmp_path):
    site_dir = _site_with_hook(tmp_path)
    quiet = _python_with_site(site_dir, TORCH_DTYPE_NOISE, pythonpath=_with_dependencies(REPO))
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "torch_dtype" not in quiet.stderr
    shown = _python_with_site(site_dir, TORCH_DTYPE_NOISE, pythonpath=_with_dependencies(REPO),
                              MERGEKIT_DARTS_VERBOSE="1")
    assert "`torch_dtype` is deprecated" in shown.stderr  # the filter is what removed it
