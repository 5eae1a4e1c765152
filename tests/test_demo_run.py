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
    """Issue 46 item 2: the demo runs `preset: best` (with and without prompts the base writes) from a
    YAML that says so, and its results.md says what the README says of it and which kernels trained
    the family (item 3)."""
    import yaml

    from mergekit_darts.demo.run import MAIN, PRESET_ROWS, ROUTED, DemoSizes, preset_rows, run_demo, surgery_rows

    # the default run: DARTS + KL (routed), the extract and preset: best with the 50 prompts
    assert [key for key, _, _ in surgery_rows()] == ["darts_kl", "extract_all8"]
    assert [key for key, _, _ in preset_rows()] == ["preset_best"]
    sizes = DemoSizes(family=TINY, test=6, calib=20, surgery_steps=5, rank=4, synthesize=4, preset_steps=5)
    workdir = str(tmp_path / "demo")
    result = run_demo(workdir, seed=0, sizes=sizes, progress=False, log=lambda *_: None, all_rows=True)
    ablations = [key for key, _, _ in surgery_rows(all_rows=True)]
    assert len(ablations) == 9 and ablations[-1] == "extract_all8"
    expected = ["base", "expert_math", "expert_code", "expert_instruct", "merged", MAIN[0], *ablations[:4], ROUTED[1],
                *ablations[4:], "preset_best", "preset_best_synth"]
    assert list(result["rows"]) == expected
    routing = result["routing"]["test_prompts"]
    assert set(routing) == set(tasks.DOMAINS)
    for domain, shares in routing.items():
        assert set(shares) == {*tasks.DOMAINS, "none"} and abs(sum(shares.values()) - 1.0) < 1e-9, shares
    for scores in result["rows"].values():
        assert set(scores) == {*tasks.DOMAINS, "average"}
        assert all(0.0 <= v <= 100.0 for v in scores.values())
    for name in ("results.json", "results.md", "demo.yml", "demo_best.yml", "darts_bias.png", "calib_math.jsonl"):
        assert os.path.exists(os.path.join(workdir, name)), name
    assert not os.path.exists(os.path.join(workdir, "variants"))  # the scratch copy is removed
    with open(os.path.join(workdir, "results.json")) as f:
        written = json.load(f)
    assert written["rows"] == result["rows"]
    # which vector kernels trained the family: its scores differ between AVX2 and AVX512 (results.md)
    assert written["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    # the preset's YAML is what a user writes: `preset: best`, none of the keys that would override it
    with open(os.path.join(workdir, "demo_best.yml")) as f:
        preset_yaml = yaml.safe_load(f)["surgery"]
    assert preset_yaml["preset"] == "best" and not {"method", "loss", "lr"} & set(preset_yaml)
    assert "synthesize" not in preset_yaml["domains"]["math"]["calibration"]
    synth = result["reports"][dict((k, label) for k, label, _ in PRESET_ROWS)["preset_best_synth"]]
    assert synth["domains"]["math"]["calibration"]["synthesis"]["requested"] == 4
    with open(os.path.join(workdir, "results.md")) as f:
        table = f.read()
    assert "| DARTS + EWL1 |" in table and "| Merged (task arithmetic) |" in table
    assert f"| {ROUTED[2]} |" in table and "routed to their own domain" in table
    assert "| preset: best (50 prompts per domain) |" in table and "next-token KL gap" in table
    assert "The README's figures for `preset: best` on this demo" in table and "24.5 / 100 / 53.5" in table
    capability = torch.backends.cpu.get_cpu_capability()
    assert f"trained with torch's {capability} CPU kernels" in table
    assert "another seed or size, so its numbers are not expected to equal those" in table
    gaps = result["kl_gap_closed"][MAIN[0]]
    assert set(gaps) == set(tasks.DOMAINS) and all(g is None or g <= 1.0 for g in gaps.values())
    # merged/ is what demo.yml makes; merged_best/ what demo_best.yml makes
    with open(os.path.join(workdir, "merged", "config.json")) as f:
        config = json.load(f)
    assert config["darts"]["method"] == "darts" and config["darts"]["loss"] == "ewl1"
    with open(os.path.join(workdir, "merged_best", "config.json")) as f:
        config = json.load(f)
    assert config["darts"]["loss"] == "kl"


def test_family_training_prints_progress_lines_to_a_log_file(tmp_path, capfd, monkeypatch):
    """Issue 46 item 9: with stderr a file the family's training (minutes in the demo) was silent. It says
    what it trains, then prints a line every few seconds (here every 0 s) instead of a tqdm bar."""
    from mergekit_darts import console

    monkeypatch.setattr(console, "PROGRESS_EVERY_S", 0.0)
    splits = _splits()
    logs = []
    build_family(str(tmp_path / "f"), splits, tasks.vocabulary(splits.values()), seed=3, spec=TINY,
                 progress=False, lines=True, log=logs.append)
    err = capfd.readouterr().err
    assert logs[0].startswith("training the model family in") and "(6 steps on the mixture)" in logs[0]
    assert "mergekit-darts: pretrain base: 1/6 steps" in err and "mergekit-darts: fine-tune code: 6/6 steps" in err
    assert "(done)" in err and "\r" not in err  # lines, not a bar's carriage returns
    build_family(str(tmp_path / "g"), splits, tasks.vocabulary(splits.values()), seed=3, spec=TINY,
                 progress=False, lines=False, log=logs.append)
    assert capfd.readouterr().err == ""  # --quiet: nothing


def test_results_md_says_what_the_readme_says_and_which_kernels_ran():
    """Issue 46 items 2 and 3: the demo's results.md quotes the README's `preset: best` figures (which
    the README must still say) and, where the family is not the README's (an AVX512 CPU trains another
    from the same seed), says so and how to train the README's one, next to the numbers."""
    from mergekit_darts.demo.table import AVX2_ENV, README_PRESET, REFERENCE_EXPERTS, markdown_table

    readme = " ".join(open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read().split())
    for mean, *_ in README_PRESET.values():
        assert mean in readme
    assert " / ".join(f"{v:.0f}" for v in REFERENCE_EXPERTS.values()) in readme and "AVX512" in readme
    domains = list(REFERENCE_EXPERTS)

    def result(capability, experts):
        rows = {f"expert_{d}": {**{o: 0.0 for o in domains}, d: experts[i], "average": 0.0}
                for i, d in enumerate(domains)}
        rows["preset_best"] = {"math": 33.0, "code": 100.0, "instruct": 57.0, "average": 63.3}
        labels = {**{k: k for k in rows}, "preset_best": "preset: best (50 prompts per domain)"}
        return {"seed": 0, "reference_run": True, "cpu_capability": capability, "rows": rows, "labels": labels,
                "test_examples": {d: 100 for d in domains},
                "readme_preset": {"preset_best": ["preset: best (50 prompts per domain)", *README_PRESET["preset_best"]],
                                  "preset_best_synth": ["preset: best + 450", *README_PRESET["preset_best_synth"]]},
                "preset_config": "/w/demo_best.yml", "preset_output_dir": "/w/merged_best"}

    same = markdown_table(result("AVX2", [42.0, 100.0, 60.0]), domains)
    assert "trained with torch's AVX2 CPU kernels" in same and "this is that family" in same
    assert AVX2_ENV not in same
    assert ("preset: best (50 prompts per domain): 24.5 / 100 / 53.5 (seed 0: 29 / 100 / 55; the preset as it "
            "ships: every block, 500 steps on minibatches of 12); this run (seed 0): 33 / 100 / 57; preset: best + "
            "450: 38.7 / 100 / 57.8 "
            "(seed 0: 39 / 100 / 58; measured with the ReLU final-state correction the preset had until "
            "2026-12-06, at 500 fixed steps); not run here (`mergekit-darts demo --all-rows` runs it)") in same
    other = markdown_table(result("AVX512", [44.0, 100.0, 68.0]), domains)
    assert "trained with torch's AVX512 CPU kernels" in other and "The experts score 44 / 100 / 68 here" in other
    assert f"start the demo as: {AVX2_ENV} mergekit-darts demo" in other
