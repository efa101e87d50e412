"""common.py: the run logger's files are strict JSON, whatever values a run produces."""

import json
import math

import numpy as np
import pytest
import torch

from common import RunLogger


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as jq and JavaScript's JSON.parse do."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_values_are_written_as_null_and_shown_as_nan(tmp_path, capsys):
    logger = RunLogger(str(tmp_path), {}, console_keys={"loss": "loss", "kl_mean": "kl"})
    logger.log(
        1,
        {
            "loss": float("nan"),
            "kl_mean": torch.tensor(float("inf")),
            "entropy": np.float32("-inf"),
            "reward": 0.5,
            "count": 3,
        },
    )
    logger.log(2, {"loss": torch.tensor(0.25), "kl_mean": 0.0, "entropy": 1.5, "reward": 1.0, "count": 4})
    logger.summary({"mfu": float("nan"), "steps": 2, "per_fn": {"answer": float("nan"), "format": [1.0, math.inf]}})
    logger.close()
    rows = [strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 1, "loss": None, "kl_mean": None, "entropy": None, "reward": 0.5, "count": 3},
        {"step": 2, "loss": 0.25, "kl_mean": 0.0, "entropy": 1.5, "reward": 1.0, "count": 4},
    ]
    summary = strict_json((tmp_path / "summary.json").read_text())
    assert summary == {"mfu": None, "steps": 2, "per_fn": {"answer": None, "format": [1.0, None]}}
    console = capsys.readouterr().out
    assert "step 1 | loss nan | kl inf" in console and "step 2 | loss 0.2500 | kl 0.0000" in console
    assert "mfu" in console and "nan" in console.split("mfu", 1)[1].splitlines()[0]


def test_a_summary_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A resume takes summary.json as the mark of a finished run: a write cut short must not leave a partial one
    under that name (the old one, or none, stays), nor a temporary file that a later summary cannot replace."""
    logger = RunLogger(str(tmp_path), {}, console_keys={})
    logger.summary({"steps": 1})
    real_dump = json.dump

    def dump_then_fail(value, f, **kwargs):
        f.write('{"steps": ')
        raise OSError("disk full")

    monkeypatch.setattr(json, "dump", dump_then_fail)
    with pytest.raises(OSError, match="disk full"):
        logger.summary({"steps": 2})
    monkeypatch.setattr(json, "dump", real_dump)
    assert strict_json((tmp_path / "summary.json").read_text()) == {"steps": 1}
    logger.summary({"steps": 3})
    logger.close()
    assert strict_json((tmp_path / "summary.json").read_text()) == {"steps": 3}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["metrics.jsonl", "summary.json"]
