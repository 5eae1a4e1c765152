"""The benchmark that measures ``preset: best``'s step at 7B shapes on a GPU (benchmarks/gpu_kl_scale.py
--preset, docs/scale.md) runs, here at tiny shapes on the CPU, and writes what docs/scale.md reads."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_preset_step_script_runs_at_tiny_shapes_on_the_cpu(tmp_path):
    out = tmp_path / "preset.json"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_kl_scale.py"), "--preset", "--small",
                             "--device", "cpu", "--repeats", "1", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    preset = json.loads(out.read_text())["preset"]
    assert preset["shape"] == {"hidden": 64, "mlp": 96, "layers": 2, "heads": 4, "vocab": 512}
    measured = preset["measured"]
    assert set(measured) == {"kl_depth0", "preset_float32", "preset_bf16_autocast"}
    for row in measured.values():
        assert row["seconds_per_step"] > 0 and row["minutes_per_domain"] > 0
    assert preset["flop_model"]["preset_over_kl"] > 1
    assert "min per domain" in result.stdout
