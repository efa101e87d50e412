"""Logging and seeding shared by grpo.py and prm.py, and nothing else.

`RunLogger` writes a console line and a `metrics.jsonl` row per step, and with the run's `--track` the same to Weights &
Biases (imported lazily, never required; `WANDB_MODE=offline` works). Only rank 0 logs: pass `enabled=False` elsewhere.
The files are strict JSON: a non-finite value is written as null (`NaN` is not JSON); the console and wandb show nan.
"""

import json
import math
import os
import random
import sys

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device) from one integer."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only (torchrun sets RANK), flushed: subprocess pipes and torchrun logs show lines at once."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def format_value(value) -> str:
    if not isinstance(value, float):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5) and math.isfinite(value):
        return f"{value:.3e}"
    return f"{value:.4f}"


class RunLogger:
    """Console line per step, `metrics.jsonl` in the run directory, and optional wandb."""

    def __init__(
        self,
        run_dir: str,
        config: dict,
        *,
        console_keys: dict[str, str],
        enabled: bool = True,
        append: bool = False,
    ):
        """config: the run's flags, whose `track` and `wandb_project_name` turn wandb on and name its project;
        console_keys: {metric name: its label on the console line}; append: keep metrics.jsonl (a resumed run's)."""
        self.enabled = enabled
        self.console_keys = console_keys
        self.run_dir = run_dir
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")
        self.wandb_run = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if not append:
            with open(self.metrics_path, "w"):
                pass
        if config.get("track"):
            run_name = os.path.basename(os.path.abspath(run_dir))
            self.wandb_run = start_wandb(config, config["wandb_project_name"], run_name)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {"step": step}
        for key, value in metrics.items():
            row[key] = to_python(value)
        parts = [f"step {step}"]
        for key, label in self.console_keys.items():
            if key in row:
                parts.append(f"{label} {format_value(row[key])}")
        print0(" | ".join(parts))
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(finite_or_null(row), allow_nan=False) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(row, step=step)

    def log_rows(self, step: int, name: str, rows: list[dict]) -> None:
        """Append rows (a step's samples, say) to NAME.jsonl in the run directory, and log them as a wandb Table."""
        if not self.enabled:
            return
        with open(os.path.join(self.run_dir, f"{name}.jsonl"), "a") as f:
            for row in rows:
                f.write(json.dumps(finite_or_null({"step": step, **row}), allow_nan=False) + "\n")
        if self.wandb_run is not None:
            import wandb

            columns = list(rows[0])
            self.wandb_run.log({name: wandb.Table(columns, [[row[c] for c in columns] for row in rows])}, step=step)

    def summary(self, summary: dict) -> None:
        """Print the summary as a table, write summary.json, and send it to wandb's run summary."""
        if not self.enabled:
            return
        summary = {key: to_python(value) for key, value in summary.items()}
        width = max(len(key) for key in summary)
        print0("=" * 20 + " summary " + "=" * 20)
        for key, value in summary.items():
            print0(f"{key:<{width}}  {format_value(value)}")
        path = os.path.join(self.run_dir, "summary.json")
        with open(path + ".tmp", "w") as f:  # then renamed: a resume takes summary.json as the mark of a finished run
            json.dump(finite_or_null(summary), f, indent=2, allow_nan=False)
        os.replace(path + ".tmp", path)
        if self.wandb_run is not None:
            self.wandb_run.summary.update(summary)

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()


def to_python(value):
    if isinstance(value, torch.Tensor | np.generic):
        return value.item()
    return value


def finite_or_null(value):
    """value with every non-finite float in it, nested in dicts and lists too, replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(item) for item in value]
    return value


def start_wandb(config: dict, project: str, run_name: str):
    """A wandb run (WANDB_ENTITY picks the team), or a warning and None: tracking must never cost a training run."""
    try:
        import wandb
    except ImportError:
        print0("WARNING: --track: wandb is not installed (pip install wandb); continuing without it", file=sys.stderr)
        return None
    try:  # a resumed run's launches share its group
        return wandb.init(project=project, group=run_name, name=run_name, config=config, save_code=True)
    except Exception as error:  # network, auth or config errors: wandb raises many kinds
        print0(
            f"WARNING: wandb could not start ({type(error).__name__}: {error}); continuing without it. "
            "Run `wandb login`, or set WANDB_MODE=offline to log locally.",
            file=sys.stderr,
        )
        return None
