"""Logging and seeding shared by grpo.py and prm.py, and nothing else.

`RunLogger` writes one console line per step, one JSON object per step to `metrics.jsonl`, and, with
`track=True`, the same metrics to Weights & Biases (imported lazily, never required; `WANDB_MODE=offline`
works). Only the rank-0 process should log: pass `enabled=False` elsewhere. The files are strict JSON: a
non-finite value (a NaN loss, an MFU with no known peak) is written as null, which every JSON reader accepts
(`NaN` is not JSON: jq and JavaScript reject it); the console and wandb show it as nan.
"""

import json
import math
import os
import random
import secrets
import sys

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device) from one integer."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def print0(*args, enabled: bool = True, **kwargs) -> None:
    """print() that flushes, so that subprocess pipes and torchrun logs show lines as they come."""
    if enabled:
        print(*args, **kwargs, flush=True)


def _format_value(value) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5) and math.isfinite(value):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


class RunLogger:
    """Console line per step, `metrics.jsonl` in the run directory, and optional wandb."""

    def __init__(
        self,
        run_dir: str | None,
        config: dict,
        *,
        console_keys: dict[str, str],
        track: bool = False,
        wandb_project: str = "grpo",
        wandb_entity: str | None = None,
        wandb_group: str | None = None,
        run_name: str = "run",
        enabled: bool = True,
        append: bool = False,
        wandb_id: str | None = None,
    ):
        """console_keys maps a metric name to the short label printed for it on the console line.
        append=True keeps an existing metrics.jsonl (used when resuming); wandb_id: the wandb run to continue (a
        resumed run's, which its checkpoint records), else a new one."""
        self.enabled = enabled
        self.console_keys = console_keys
        self.metrics_file = None
        self.wandb_run = None
        if not enabled:
            return
        if run_dir is not None:
            os.makedirs(run_dir, exist_ok=True)
            self.metrics_file = open(os.path.join(run_dir, "metrics.jsonl"), "a" if append else "w")
        if track:
            self.wandb_run = _start_wandb(config, wandb_project, wandb_entity, wandb_group, run_name, wandb_id)

    @property
    def wandb_id(self) -> str | None:
        """The wandb run's id (None without one): saved with each checkpoint, so that a resume logs into that run."""
        return self.wandb_run.id if self.wandb_run is not None else None

    @property
    def wandb_group(self) -> str | None:
        """The wandb run's group: saved with each checkpoint, so that a branch from it joins its group."""
        return self.wandb_run.group if self.wandb_run is not None else None

    def log(self, step: int, metrics: dict, prefix: str = "step") -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _to_python(v) for k, v in metrics.items()}}
        parts = [f"{prefix} {step}"] + [
            f"{label} {_format_value(row[key])}" for key, label in self.console_keys.items() if key in row
        ]
        print0(" | ".join(parts))
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(_finite_or_null(row), allow_nan=False) + "\n")
            self.metrics_file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(row, step=step)

    def summary(self, summary: dict, run_dir: str | None) -> None:
        """Print the summary as a table, write summary.json, and send it to wandb's run summary."""
        if not self.enabled:
            return
        summary = {k: _to_python(v) for k, v in summary.items()}
        width = max(len(k) for k in summary)
        print0("=" * 20 + " summary " + "=" * 20)
        for key, value in summary.items():
            print0(f"{key:<{width}}  {_format_value(value)}")
        if run_dir is not None:  # atomically: a resume takes a summary.json as the mark of a finished run
            path = os.path.join(run_dir, "summary.json")
            with open(path + ".tmp", "w") as f:
                json.dump(_finite_or_null(summary), f, indent=2, allow_nan=False)
            os.replace(path + ".tmp", path)
        if self.wandb_run is not None:
            self.wandb_run.summary.update(summary)

    def close(self) -> None:
        if self.metrics_file is not None:
            self.metrics_file.close()
            self.metrics_file = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _to_python(value):
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, np.generic):
        value = value.item()
    return value


def _finite_or_null(value):
    """value with every non-finite float in it, nested in dicts and lists too, replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def _start_wandb(config: dict, project: str, entity: str | None, group: str | None, run_name: str,
                 run_id: str | None = None):
    """Start a wandb run, or continue run_id's, or warn and carry on without one: tracking must never cost a
    training run."""
    try:
        import wandb
    except ImportError:
        print0("WARNING: --track given but wandb is not installed (pip install wandb); continuing without it.",
               file=sys.stderr)
        return None
    try:
        if run_id is not None:  # a resume: the same run, its name and group, its curves continued from the checkpoint
            run = wandb.init(project=project, entity=entity, id=run_id, resume="allow", group=group, save_code=True)
            run.config.update(config, allow_val_change=True)  # the flags this launch runs with (--total-steps ...)
            return run
        # without --wandb-group a new run is a group of its own (the suffix keeps two launches in one second apart)
        group = group or f"{run_name}-{secrets.token_hex(3)}"
        return wandb.init(project=project, entity=entity, group=group, name=run_name, config=config,
                          save_code=True)
    except Exception as error:  # network, auth or config errors: wandb raises many kinds
        print0(f"WARNING: wandb could not start ({type(error).__name__}: {error}); continuing without it. "
               "Run `wandb login`, or set WANDB_MODE=offline to log locally.", file=sys.stderr)
        return None
