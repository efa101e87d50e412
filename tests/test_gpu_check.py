"""benchmarks/gpu_check.py, the one script to run when a GPU is lent, shrunk to run here on CPU: every run in it
must finish and report, so that the few GPU minutes are not lost to a bug in the script."""

import json
import subprocess
import sys

from conftest import REPO_ROOT


def test_gpu_check_runs_every_job_on_a_small_size(tmp_path):
    process = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--size", "tiny", "--device", "cpu",
                              "--out", str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    results = {r["name"]: r for r in report["results"]}
    assert set(results) == {"grpo", "prm", "grpo-fsdp", "prm-fsdp"}
    assert results["grpo"]["steps"] == 3 and results["prm"]["steps"] == 4
    assert results["grpo-fsdp"]["steps"] == results["prm-fsdp"]["steps"] == 2
    for r in results.values():
        assert r["step_time_s_mean"] > 0 and r["peak_memory_mb"] > 0
    assert results["grpo"]["generated_tokens_per_s"] > 0 and results["prm"]["tokens_per_s"] > 0
    # rows nearly fill --max-length, every step of every row kept
    assert results["prm"]["dropped_steps"] == 0
    assert "| grpo-fsdp | 2 |" in (tmp_path / "gpu_check.md").read_text()
