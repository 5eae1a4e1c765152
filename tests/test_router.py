"""The domain router (docs/routing.md): math, training, export/read, config, pipeline report."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import merge_yaml
from mergekit_darts.config import SurgeryConfigError, parse_surgery_block
from mergekit_darts.output import layout
from mergekit_darts.output.export import export_surgery, read_darts_info
from mergekit_darts.remote_code.routing import NO_ROUTE, DomainRouter, pool_prompt_states, route_rows
from mergekit_darts.remote_code.surgery import DomainSurgery
from mergekit_darts.repair.route.router import confusion, fit_router, pooled_prompts, prompt_mask, route_pooled
from mergekit_darts.repair.route.prefix import PromptStates, pool_prefixes

DATA = Path(__file__).parent / "data"
HIDDEN = 32


def clusters(seed=0, per_domain=30, spread=0.1):
    """Three well separated clusters of unit vectors around random directions."""
    generator = torch.Generator().manual_seed(seed)
    centers = torch.nn.functional.normalize(torch.randn(3, HIDDEN, generator=generator), dim=-1)
    return {name: torch.nn.functional.normalize(
        centers[i] + spread * torch.randn(per_domain, HIDDEN, generator=generator), dim=-1)
        for i, name in enumerate(("math", "code", "chat"))}


@pytest.mark.parametrize("kind", ["centroid", "logistic"])
def test_fit_is_deterministic_and_separates_clusters(kind):
    train, test = clusters(seed=0), clusters(seed=0, per_domain=60)
    first, second = fit_router(train, kind=kind), fit_router(train, kind=kind)
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[name]), name
    table = confusion(first, test)
    for index, name in enumerate(first.domains):
        assert table[name][name] == 60, table  # every test row of each cluster goes to its own domain
        assert torch.equal(route_pooled(first, test[name]), route_pooled(second, test[name]))


def test_rows_below_threshold_get_none_and_threshold_zero_never_does():
    train = clusters()
    router = fit_router(train, threshold=0.02)
    generator = torch.Generator().manual_seed(5)
    # directions orthogonal to every centroid: far below each domain's typical similarity
    foreign = torch.randn(20, HIDDEN, generator=generator)
    basis = torch.linalg.qr(router.centroids.detach().t()).Q  # [H, D]
    foreign = torch.nn.functional.normalize(foreign - foreign @ basis @ basis.t(), dim=-1)
    assert (route_pooled(router, foreign) == NO_ROUTE).all()
    _, confidence = router.scores(foreign)
    assert (confidence < 0.02).all() and (confidence > 0).all()
    open_router = fit_router(train, threshold=0.0)
    assert (route_pooled(open_router, foreign) != NO_ROUTE).all()
    assert (route_pooled(router, train["code"]) == router.domains.index("code")).all()


def test_left_padding_does_not_change_routing_and_route_rows_matches_training_side():
    router = fit_router(clusters())
    generator = torch.Generator().manual_seed(1)
    lengths = [5, 3, 7, 1]
    longest = max(lengths)
    right, left = torch.zeros(4, longest, HIDDEN), torch.full((4, longest, HIDDEN), 9.0)  # padding holds junk
    right_mask, left_mask = torch.zeros(4, longest, dtype=torch.long), torch.zeros(4, longest, dtype=torch.long)
    for row, n in enumerate(lengths):
        states = torch.randn(n, HIDDEN, generator=generator) + 3 * router.centroids.detach()[row % 3]
        right[row, :n], right_mask[row, :n] = states, 1
        left[row, longest - n:], left_mask[row, longest - n:] = states, 1
    routed_right, routed_left = route_rows(router, right, right_mask), route_rows(router, left, left_mask)
    assert routed_right.dtype == torch.long and routed_right.shape == (4,)
    assert torch.equal(routed_right, routed_left)
    assert torch.equal(routed_right, route_pooled(router, pool_prompt_states(right, right_mask)))
    assert routed_right.tolist() == [0, 1, 2, 0]  # each row was built around its own centroid
    # no mask = every token counts; a single-token prompt then equals that token's direction
    assert torch.equal(route_rows(router, right[3:, :1]), routed_right[3:])


def test_router_meta_is_strict():
    router = DomainRouter(HIDDEN, ["math", "code"], threshold=0.1)
    assert DomainRouter.from_meta(router.to_meta(), HIDDEN).to_meta() == router.to_meta()
    with pytest.raises(ValueError, match="version"):
        DomainRouter.from_meta({**router.to_meta(), "version": 99}, HIDDEN)
    with pytest.raises(ValueError, match="threshold"):
        DomainRouter(HIDDEN, ["math"], threshold=1.5)
    with pytest.raises(ValueError, match="missing kind"):
        DomainRouter.from_meta({k: v for k, v in router.to_meta().items() if k != "kind"}, HIDDEN)
    assert router.to_meta()["version"] == 2 and router.to_meta()["states"] == "final"
    with pytest.raises(ValueError, match="missing states"):
        DomainRouter.from_meta({k: v for k, v in router.to_meta().items() if k != "states"}, HIDDEN)
    with pytest.raises(ValueError, match="router.states: unknown states 'embeddings'"):
        DomainRouter.from_meta({**router.to_meta(), "states": "embeddings"}, HIDDEN)
    # a version-1 entry (no states) read where it routed: the first adapted block's input with depth
    legacy = {k: v for k, v in router.to_meta().items() if k != "states"} | {"version": 1}
    assert DomainRouter.from_meta(legacy, HIDDEN).states == "final"
    assert DomainRouter.from_meta(legacy, HIDDEN, blocks_adapted=True).states == "block_input"
    with pytest.raises(ValueError, match="version True"):
        DomainRouter.from_meta({**router.to_meta(), "version": True}, HIDDEN)


def test_router_step_reads_the_states_it_is_told():
    """router_states: final trains on the merged final states, block_input on the first adapted block's
    input (both captured with depth)."""
    import types

    from mergekit_darts.repair.route.step import _router_states

    final, block = torch.randn(3, 5, HIDDEN), torch.randn(3, 5, HIDDEN)
    data = types.SimpleNamespace(merged_hidden=final, block_inputs=block, prompt_lengths=torch.tensor([5, 4, 3]))
    assert torch.equal(_router_states(data, "final").hidden, final)
    read = _router_states(data, "block_input", rows=2)
    assert torch.equal(read.hidden, block[:2]) and read.lengths.tolist() == [5, 4]


# --------------------------------------------------------------------------------------------- config

DOMAINS = {"math": {"model": "m", "calibration": {"texts": ["a"]}}, "code": {"model": "c", "calibration": {"texts": ["b"]}}}


def test_config_router_defaults_and_errors_name_the_field():
    assert parse_surgery_block({"domains": DOMAINS}).router_enabled
    assert not parse_surgery_block({"domains": {"math": DOMAINS["math"]}}).router_enabled
    assert parse_surgery_block({"domains": DOMAINS, "default_domain": "auto"}).active_domain == "auto"
    with pytest.raises(SurgeryConfigError, match="default_domain 'auto' needs the router.*router: true"):
        parse_surgery_block({"domains": DOMAINS, "default_domain": "auto", "router": False})
    with pytest.raises(SurgeryConfigError, match="default_domain 'auto' needs the router"):
        parse_surgery_block({"domains": {"math": DOMAINS["math"]}, "default_domain": "auto"})
    for bad in (-0.1, 1.5):
        with pytest.raises(SurgeryConfigError, match="surgery.router_threshold"):
            parse_surgery_block({"domains": DOMAINS, "router_threshold": bad})
    with pytest.raises(SurgeryConfigError, match="surgery.router_eval"):
        parse_surgery_block({"domains": DOMAINS, "router_eval": {"samples": 3}})
    with pytest.raises(SurgeryConfigError, match="'router'"):
        parse_surgery_block({"domains": {"router": DOMAINS["math"]}})


def test_config_router_gate_settings():
    surgery = parse_surgery_block({"domains": DOMAINS})
    assert surgery.router_threshold is None and surgery.router_fallback == 0.05 and surgery.router_kind == "auto"
    assert parse_surgery_block({"domains": DOMAINS, "router_fallback_rate": "1e-2"}).router_fallback == 0.01
    assert parse_surgery_block({"domains": DOMAINS, "router_threshold": 0.1}).router_threshold == 0.1
    with pytest.raises(SurgeryConfigError, match="router_fallback_rate together with router_threshold"):
        parse_surgery_block({"domains": DOMAINS, "router_threshold": 0.1, "router_fallback_rate": 0.05})
    for bad in (-0.1, 1.0, True):
        with pytest.raises(SurgeryConfigError, match="surgery.router_fallback_rate"):
            parse_surgery_block({"domains": DOMAINS, "router_fallback_rate": bad})
    with pytest.raises(SurgeryConfigError, match="surgery.router_kind"):
        parse_surgery_block({"domains": DOMAINS, "router_kind": "mlp"})
    with pytest.raises(SurgeryConfigError, match="router_kind together with router: router_kind is used only with the router"):
        parse_surgery_block({"domains": DOMAINS, "router": False, "router_kind": "centroid"})
    with pytest.raises(SurgeryConfigError, match="router_fallback_rate together with router"):
        parse_surgery_block({"domains": {"math": DOMAINS["math"]}, "router_fallback_rate": 0.1})


# --------------------------------------------------------------------------------------------- export

def _modules():
    torch.manual_seed(0)
    return {name: DomainSurgery(HIDDEN, rank=4, max_positions=6) for name in ("math", "code")}


def test_export_and_read_round_trip(merged_copy):
    router = fit_router({"math": clusters()["math"], "code": clusters()["code"]}, threshold=0.05)
    report = {"domains": {}, "router": {**router.to_meta(), "split": "held_out", "accuracy": {"math": 1.0, "code": 0.5},
                                        "confusion": {"math": {"math": 2, "code": 0, "none": 0},
                                                      "code": {"math": 0, "code": 1, "none": 1}},
                                        "out_of_domain": {"source": "swapped_domains", "none_share": 0.75}}}
    export_surgery(merged_copy, _modules(), {"math": "m", "code": "c"}, "auto", loss="ewl1", report=report,
                   router=router)
    config = layout.read_config(merged_copy)
    assert config["darts_domain"] == "auto"
    assert config["darts"]["router"] == router.to_meta() == layout.read_router_entry(merged_copy)
    tensors = load_file(os.path.join(merged_copy, "darts.safetensors"))
    loaded = DomainRouter.from_meta(config["darts"]["router"], HIDDEN)
    loaded.load_state_dict({k[len("darts.router."):]: v for k, v in tensors.items() if k.startswith("darts.router.")})
    probe = torch.cat(list(clusters(seed=3).values()))
    assert torch.equal(route_pooled(loaded, probe), route_pooled(router, probe))
    index = json.load(open(os.path.join(merged_copy, layout.INDEX)))
    assert index["weight_map"]["darts.router.weight"] == "darts.safetensors"
    info = read_darts_info(merged_copy)
    assert info["router"]["domains"] == ["math", "code"] and info["router"]["threshold"] == 0.05
    assert info["router"]["parameters"] == sum(t.numel() for t in router.state_dict().values())
    assert info["router"]["accuracy"] == {"math": 1.0, "code": 0.5}
    card = open(os.path.join(merged_copy, "README.md")).read()
    assert "Automatic domain routing" in card and "75.0%" in card
    # a rerun without a router drops it, and "auto" then needs one
    with pytest.raises(ValueError, match="'auto' needs a router"):
        export_surgery(merged_copy, _modules(), {"math": "m", "code": "c"}, "auto", loss="ewl1")
    export_surgery(merged_copy, _modules(), {"math": "m", "code": "c"}, "math", loss="ewl1")
    assert layout.read_router_entry(merged_copy) is None and read_darts_info(merged_copy)["router"] is None
    assert not any(k.startswith("darts.router.") for k in load_file(os.path.join(merged_copy, "darts.safetensors")))


def test_export_rejects_router_of_other_domains(merged_copy):
    router = fit_router({"math": clusters()["math"], "chat": clusters()["chat"]})
    with pytest.raises(ValueError, match="router: routes to"):
        export_surgery(merged_copy, _modules(), {"math": "m", "code": "c"}, "math", loss="ewl1", router=router)


def test_directories_written_before_routing_still_read(tmp_path):
    out = tmp_path / "old"
    shutil.copytree(DATA / "v0_1_0_output", out)
    assert layout.read_router_entry(str(out)) is None
    info = read_darts_info(str(out))
    assert info["router"] is None and info["domains"]


# ------------------------------------------------------------------------------------------- pipeline

MATH = ["what is 3 plus 4 ?", "how many apples are left if we have 7 and give 2 ?", "total of 2 and 6 is ?",
        "what is 8 minus 5 ?", "how many pears are left if we have 9 and give 4 ?", "each has 3 apples how many in total ?",
        "take 5 from 12 then add 1", "what is 9 times 2 ?"]
CODE = ["def sum ( list ) : return", "write a python function to sort a list", "print ( input ( ) )",
        "def count ( words ) : return", "return list reverse", "write function to count words in a string",
        "def sort ( list ) : print", "int float string true false"]


def _config(paths, tmp_path, **settings):
    base = dict(rank=4, max_positions=32, steps=5, lr=0.01, cache_dir=str(tmp_path / "cache"), held_out=0.25,
                device="cpu", dtype="float32")
    base.update(settings)
    lines = ["surgery:"] + [f"  {k}: {v}" for k, v in base.items()] + ["  domains:"]
    for name, texts in (("math", MATH), ("code", CODE)):
        lines += [f"    {name}:", f"      model: {paths[name]}", "      calibration:",
                  f"        texts: {json.dumps(texts)}", "        continue_tokens: 4"]
    return merge_yaml(paths) + "\n".join(lines) + "\n"


def test_pipeline_trains_reports_and_exports_router(tiny_family, merged_copy, tmp_path):
    from mergekit_darts.pipeline import capture_step, parse_config_source, run_surgery, summary_lines
    from mergekit_darts.repair.train.split import split_held_out
    from mergekit_darts.settings import RunSettings

    source = _config(tiny_family, tmp_path, default_domain="auto")
    report = run_surgery(source, merged_copy, progress=False)
    entry = report["router"]
    assert entry["split"] == "held_out" and entry["records"] == {"math": 2, "code": 2}
    assert entry["accuracy"] == {"math": 1.0, "code": 1.0}, entry["confusion"]
    assert entry["out_of_domain"]["source"] == "swapped_domains"
    assert set(entry["out_of_domain"]["by_domain"]) == {"math", "code"}
    assert entry["kind"] in ("centroid", "logistic") and entry["calibration"]["threshold"] == "conformal"
    assert list(entry["by_prefix"]) == ["16", "32", "64", "all"] and entry["by_prefix"]["all"]["confusion"] == entry["confusion"]
    assert entry["out_of_domain"]["by_prefix"]["all"] == entry["out_of_domain"]["none_share"]
    lines = summary_lines(report)
    assert any(line.startswith(f"router ({entry['kind']}, threshold") for line in lines)
    assert any(line.startswith("router by prompt length in tokens (math/code): 16:") for line in lines)
    assert json.load(open(os.path.join(merged_copy, "darts_report.json")))["router"] == entry
    assert read_darts_info(merged_copy)["router"]["confusion"] == entry["confusion"]

    # the emitted tensors, applied by route_rows to the prompt states, give the training side's domains
    _, surgery = parse_config_source(source)
    captured = capture_step(merged_copy, surgery, RunSettings.resolve(surgery, progress=False))
    router = DomainRouter.from_meta(layout.read_router_entry(merged_copy), captured.domains["math"].merged_hidden.shape[-1])
    tensors = load_file(os.path.join(merged_copy, "darts.safetensors"))
    router.load_state_dict({k[len("darts.router."):]: v for k, v in tensors.items() if k.startswith("darts.router.")})
    for index, (name, data) in enumerate(captured.domains.items()):
        # continue_tokens extended every prompt: the mask must stop at the prompt
        assert (data.prompt_lengths < data.attention_mask.sum(1)).any()
        mask = prompt_mask(data)
        training_side = route_pooled(router, pooled_prompts(data))
        assert torch.equal(route_rows(router, data.merged_hidden, mask), training_side)
        # a prompt cut to its first n tokens routes as the training side's pooled prefix of that length
        states = PromptStates(data.merged_hidden, data.prompt_lengths)
        for n in (1, 2, 3):
            cut = mask & (torch.arange(mask.shape[1]) < n)
            rows = torch.arange(states.records)
            prefix = pool_prefixes(states, rows, states.lengths.clamp(max=n))
            assert torch.allclose(prefix, pool_prompt_states(data.merged_hidden, cut), atol=1e-6)
            assert torch.equal(route_rows(router, data.merged_hidden, cut), route_pooled(router, prefix))
        _, held = split_held_out(len(data.prompt_lengths), surgery.held_out, 0)
        assert (training_side[held] == index).all()


def test_router_eval_texts_are_captured_on_the_merged_model(tiny_family, merged_copy, tmp_path):
    """router_eval given: the fallback share is measured on those texts. Giving a domain's own
    calibration prompts must send none of them to "none" (states captured as at training)."""
    from mergekit_darts.pipeline import run_surgery

    source = _config(tiny_family, tmp_path).replace(
        "surgery:\n", "surgery:\n  router_eval:\n    texts: " + json.dumps(MATH) + "\n", 1)
    ood = run_surgery(source, merged_copy, progress=False)["router"]["out_of_domain"]
    assert ood == {"source": "router_eval", "records": len(MATH), "none_share": 0.0,
                   "by_prefix": {"16": 0.0, "32": 0.0, "64": 0.0, "all": 0.0}}
