"""The built-in demo: the family builder (deterministic, cached) and a reduced end-to-end run."""

import json
import os

import torch

from mergekit_darts.demo import tasks
from mergekit_darts.demo.family import FamilySpec, build_family

TINY = FamilySpec(hidden_size=32, layers=2, seq_len=128, batch_size=8, base_steps=6, expert_steps=6,
                  train_examples=60)


def _splits(seed=0):
    return {d: tasks.make_splits(d, seed, train=TINY.train_examples, calib=20, test=6) for d in tasks.DOMAINS}


def test_family_is_deterministic_and_reused(tmp_path):
    from safetensors.torch import load_file

    splits = _splits()
    words = tasks.vocabulary(splits.values())
    logs = []
    first = build_family(str(tmp_path / "a"), splits, words, seed=3, spec=TINY, progress=False, log=logs.append)
    second = build_family(str(tmp_path / "b"), splits, words, seed=3, spec=TINY, progress=False, log=logs.append)
    assert set(first) == {"base", *tasks.DOMAINS}
    for name in first:
        a = load_file(os.path.join(first[name], "model.safetensors"))
        b = load_file(os.path.join(second[name], "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        assert os.path.exists(os.path.join(first[name], "tokenizer.json"))
    base = load_file(os.path.join(first["base"], "model.safetensors"))
    math = load_file(os.path.join(first["math"], "model.safetensors"))
    assert any(not torch.equal(base[k], math[k]) for k in base)  # the expert was fine-tuned

    mtime = os.path.getmtime(os.path.join(first["math"], "model.safetensors"))
    build_family(str(tmp_path / "a"), splits, words, seed=3, spec=TINY, progress=False, log=logs.append)
    assert os.path.getmtime(os.path.join(first["math"], "model.safetensors")) == mtime
    assert any("reusing" in line for line in logs)
    # another seed is another family
    logs.clear()
    build_family(str(tmp_path / "a"), splits, words, seed=4, spec=TINY, progress=False, log=logs.append)
    assert not any("reusing" in line for line in logs)


def test_demo_yaml_has_the_surgery_block(tmp_path):
    import yaml

    from mergekit_darts.config import parse_surgery_block
    from mergekit_darts.demo.run import DemoSizes, make_data, merge_yaml

    sizes = DemoSizes(family=TINY, test=6, calib=20)
    make_data(str(tmp_path), 0, sizes)
    paths = {"base": "/x/base", **{d: f"/x/{d}" for d in tasks.DOMAINS}}
    data = yaml.safe_load(merge_yaml(str(tmp_path), paths, 0, sizes))
    assert data["merge_method"] == "task_arithmetic" and data["base_model"] == "/x/base"
    assert [m["parameters"]["weight"] for m in data["models"]] == [sizes.merge_weight] * 3
    surgery = parse_surgery_block(data["surgery"])
    assert surgery.method == "darts" and surgery.loss == "ewl1"
    for domain in tasks.DOMAINS:
        calib = surgery.domains[domain].calibration
        assert calib.path == os.path.join(str(tmp_path), f"calib_{domain}.jsonl") and calib.field == "prompt"
        with open(calib.path) as f:
            assert len(f.readlines()) == 20


def test_demo_cli_help():
    from click.testing import CliRunner

    from mergekit_darts.cli.demo import demo_command

    result = CliRunner().invoke(demo_command, ["--help"])
    assert result.exit_code == 0
    assert "--workdir" in result.output and "--seed" in result.output and "--quick" in result.output


def test_reduced_demo_end_to_end(tmp_path):
    from mergekit_darts.demo.run import ABLATIONS, MAIN, ROUTED, DemoSizes, run_demo

    sizes = DemoSizes(family=TINY, test=6, calib=20, surgery_steps=5, rank=4)
    workdir = str(tmp_path / "demo")
    result = run_demo(workdir, seed=0, sizes=sizes, progress=False, log=lambda *_: None)
    expected_rows = {"base", "expert_math", "expert_code", "expert_instruct", "merged", MAIN[0],
                     *(key for key, _, _ in ABLATIONS), ROUTED[1]}
    assert set(result["rows"]) == expected_rows
    keys = list(result["rows"])
    assert keys[keys.index(ROUTED[0]) + 1] == ROUTED[1]  # the routed row sits under its oracle-domain row
    routing = result["routing"]["test_prompts"]
    assert set(routing) == set(tasks.DOMAINS)
    for domain, shares in routing.items():
        assert set(shares) == {*tasks.DOMAINS, "none"} and abs(sum(shares.values()) - 1.0) < 1e-9, shares
    for scores in result["rows"].values():
        assert set(scores) == {*tasks.DOMAINS, "average"}
        assert all(0.0 <= v <= 100.0 for v in scores.values())
    for name in ("results.json", "results.md", "demo.yml", "darts_bias.png", "calib_math.jsonl"):
        assert os.path.exists(os.path.join(workdir, name)), name
    with open(os.path.join(workdir, "results.json")) as f:
        written = json.load(f)
    assert written["rows"] == result["rows"]
    # which vector kernels trained the family: its scores differ between AVX2 and AVX512 (results.md)
    assert written["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    with open(os.path.join(workdir, "results.md")) as f:
        table = f.read()
    assert "| DARTS + EWL1 |" in table and "| Merged (task arithmetic) |" in table
    assert f"| {ROUTED[2]} |" in table and "routed to their own domain" in table
    assert "next-token KL gap" in table
    gaps = result["kl_gap_closed"][MAIN[0]]
    assert set(gaps) == set(tasks.DOMAINS) and all(g is None or g <= 1.0 for g in gaps.values())
    # the output directory is left with the main configuration and loads as a DARTS model
    with open(os.path.join(workdir, "merged", "config.json")) as f:
        config = json.load(f)
    assert config["darts"]["method"] == "darts" and config["darts"]["loss"] == "ewl1"
