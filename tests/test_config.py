"""The surgery: block schema: defaults from the paper, and errors that name their YAML path."""

import pytest

from mergekit_darts.config import SurgeryConfigError, parse_surgery_block, split_yaml

DOMAINS = {"math": {"model": "m", "calibration": {"path": "x.jsonl", "field": "question"}}}


def test_defaults_are_the_papers():
    cfg = parse_surgery_block({"domains": DOMAINS})
    assert (cfg.method, cfg.loss, cfg.rank, cfg.max_positions, cfg.steps, cfg.lr) == ("darts", "ewl1", 16, 512, 500, 1e-3)
    assert cfg.head_rank == 0 and cfg.domains["math"].calibration.samples == 50
    assert cfg.active_domain == "math"
    assert parse_surgery_block({"domains": DOMAINS, "default_domain": "none"}).active_domain == "none"


@pytest.mark.parametrize(
    "block, message",
    [
        ({"domains": DOMAINS, "rnak": 4}, "surgery.rnak: unknown key"),
        ({"domains": {"math": {"model": "m", "calibration": {"path": "x", "feild": "q"}}}},
         "surgery.domains.math.calibration.feild: unknown key"),
        ({"domains": DOMAINS, "rank": 0}, "surgery.rank:"),
        ({"domains": DOMAINS, "loss": "huber"}, "surgery.loss:"),
        ({"domains": DOMAINS, "method": "magic"}, "surgery.method:"),
        ({"domains": DOMAINS, "default_domain": "code"}, "default_domain 'code' is not a domain"),
        ({"domains": DOMAINS, "device": "gpu"}, "surgery.device: unknown device"),
        ({"domains": {}}, "surgery.domains: at least one domain"),
        ({"domains": {"my-domain": DOMAINS["math"]}}, "domain name 'my-domain'"),
        ({"domains": {"none": DOMAINS["math"]}}, "domain name 'none'"),
        ({"domains": {"math": {"model": "m", "calibration": {"path": "x", "texts": ["a"]}}}},
         "surgery.domains.math.calibration: give exactly one of"),
        ({"domains": {"math": {"model": "m", "calibration": {"samples": 5}}}}, "give exactly one of"),
        ({"domains": {"math": {"model": "m", "calibration": {"texts": ["a"], "samples": 0}}}},
         "surgery.domains.math.calibration.samples:"),
        ({"domains": {"math": {"calibration": {"texts": ["a"]}}}}, "surgery.domains.math.model: Field required"),
    ],
)
def test_errors_name_the_field(block, message):
    with pytest.raises(SurgeryConfigError) as error:
        parse_surgery_block(block)
    assert message in str(error.value)


def test_split_yaml_keeps_mergekit_part_untouched():
    merge, surgery = split_yaml("merge_method: linear\nmodels: []\nsurgery:\n  rank: 4\n")
    assert merge == {"merge_method": "linear", "models": []} and surgery == {"rank": 4}
    assert split_yaml("merge_method: linear\n")[1] is None
    with pytest.raises(SurgeryConfigError, match="mapping"):
        split_yaml("- a\n- b\n")
