"""grpo.py and prm.py against TRL's GRPOTrainer / PRMTrainer on identical work, side by side in one run.

Each configuration (see CONFIGS and benchmarks/README.md) runs both sides --reps times, alternated (ours-TRL,
TRL-ours, ...), each run a fresh process on the CPU in fp32. TRL runs through the harness in ../shared/bench
(trl_grpo_bench.py under $BENCH_ROOT/venv with trl 1.16, trl_prm_bench.py under $BENCH_ROOT/venv-trl113 with
trl 1.13, the last release with PRMTrainer); our scripts run under $BENCH_ROOT/venv too (same torch and
transformers). This file needs only the standard library.

    python benchmarks/bench_vs_trl.py                                   # all configurations, 3 pairs each
    python benchmarks/bench_vs_trl.py --configs grpo_small --reps 5 --quiet-wait 300
    python benchmarks/bench_vs_trl.py --reps 1 --grpo-steps 3 --prm-steps 3 --configs grpo_tiny,prm_tiny  # smoke

The table: s/step is a run's mean wall time per optimizer step, first step excluded (`step_time_s_mean` in our
summary.json, `mean_step_s_excl_first` in the harness's JSON), median over repetitions. TRL/ours is the median of
the per-pair ratios (above 1: ours is faster) with their [min-max]. RSS is each process's peak resident memory
(ru_maxrss). "other cores" is the most CPU that other processes used during any run (from /proc/stat): above
about 0.2 the machine was contended and the times are not to be trusted. Under the table, per configuration, the
check that both sides did the same work: the mean completion length (GRPO) or tokens per step (PRM) of each side.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = [
    "grpo_tiny",
    "grpo_tiny_lora",
    "grpo_small",
    "grpo_small_lora",
    "grpo_small_long",
    "grpo_small_accum",
    "prm_tiny",
    "prm_tiny_lora",
    "prm_small",
    "prm_small_lora",
]
# grpo_small_accum: up to ACCUM_NEW_TOKENS new tokens (lengths vary: the random model says EOS now and then),
# trained in micro-batches of ACCUM_MICRO_BATCH with gradient accumulation on both sides
ACCUM_NEW_TOKENS, ACCUM_MICRO_BATCH = 64, 4
# grpo_small_long: this instruction before every prompt (one token a character: 69-token prompts with BOS)
LONG_PROMPT_PREFIX = "Add the two digits below and reply with their sum in digits. Q: "
LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # the harness's target_modules
# GRPO rows train at a learning rate too small to change any fp32 weight: both sides keep sampling from the
# initial policy. Their rewards differ (TRL's harness: a completion's leading integer; grpo.py: its last number),
# so trained, their completion lengths, and with them the work per step, would drift apart. Every pass, gradient
# and AdamW step still runs.
GRPO_LEARNING_RATE = "1e-12"


# ---- helpers run under a venv's python: `bench_vs_trl.py --probe prm-data --probe-args JSON` prints
# `PROBE {json}`; `bench_vs_trl.py --trl-grpo-prefix P --trl-grpo-lora-r R -- HARNESS_ARGS` runs the GRPO harness


def probe_prm_data(harness_dir: str, model_dir: str, out_path: str, batch_size: int, max_length: int) -> dict:
    """The harness's PRM training rows (its own generator, seed 0) written as prm.py JSONL, and their token lengths
    as PRMTrainer.tokenize_row gives them (needs the trl 1.13 venv)."""
    sys.path.insert(0, harness_dir)
    import trl_prm_bench as h
    from transformers import AutoTokenizer

    a = h.Args()
    rows = [
        {"prompt": r["prompt"], "completions": list(r["completions"]), "labels": [bool(x) for x in r["labels"]]}
        for r in h.make_dataset(a.n_train, a.seed, a)
    ]
    with open(out_path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    tok = AutoTokenizer.from_pretrained(model_dir)
    lens = [len(h.PRMTrainer.tokenize_row(r, tok, "\n", max_length, None, False, False)["input_ids"]) for r in rows]
    rng = random.Random(0)
    padded = [max(rng.sample(lens, batch_size)) * batch_size for _ in range(4000)]  # random batches
    return {
        "rows": len(rows),
        "tokens_per_step": batch_size * sum(lens) / len(lens),
        "padded_tokens_per_step": sum(padded) / len(padded),
    }


def trl_grpo_wrapped(harness_dir: str, prefix: str, lora_r: int, harness_args: list[str]) -> int:
    """The harness's GRPO benchmark with `prefix` before every prompt and, with lora_r > 0, LoRA (r, alpha 2r, no
    dropout, on LORA_TARGETS; TRL then takes the reference log-probs with the adapters disabled, as grpo.py does):
    the harness has no flag for either."""
    sys.path.insert(0, harness_dir)
    import trl_grpo_bench as h
    import tyro

    if prefix:
        make_prompts = h.make_prompts
        h.make_prompts = lambda max_tokens, tok: [
            {**row, "prompt": prefix + row["prompt"]} for row in make_prompts(max_tokens, tok)
        ]
    if lora_r > 0:
        from peft import LoraConfig

        lora = LoraConfig(
            r=lora_r,
            lora_alpha=2 * lora_r,
            lora_dropout=0.0,
            target_modules=LORA_TARGETS.split(","),
            task_type="CAUSAL_LM",
        )
        h.GRPOTrainer = functools.partial(h.GRPOTrainer, peft_config=lora)
    h.main(tyro.cli(h.Args, args=harness_args))
    sys.stdout.flush()
    return 0


# ---- one run, and the machine around it


def child_env(a) -> dict:
    env = {
        **os.environ,
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "PYTHONUNBUFFERED": "1",
        "BENCH_ROOT": a.bench_root,
    }
    if a.threads > 0:
        env["OMP_NUM_THREADS"] = str(a.threads)
    return env


def run_probe(a, python: str, name: str, **kwargs) -> dict:
    cmd = [python, os.path.abspath(__file__), "--probe", name, "--probe-args", json.dumps(kwargs)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(a))
    for line in p.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[6:])
    raise RuntimeError(f"probe {name} failed (rc {p.returncode}): {(p.stderr or p.stdout)[-2000:]}")


def machine_busy_s() -> float | None:
    """CPU seconds (all cores) the machine spent non-idle, from /proc/stat (Linux)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return None


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_for_quiet(wait_s: float, busy_max: float) -> None:
    """Wait up to wait_s for the machine's busy fraction (all cores, over 2 s) to drop below busy_max."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        b0 = machine_busy_s()
        if b0 is None:
            return
        time.sleep(2.0)
        if (machine_busy_s() - b0) / (2.0 * (os.cpu_count() or 1)) < busy_max:
            return


def run_cmd(cmd: list[str], cwd: str, log_path: Path, a) -> dict:
    """Run to completion, output to log_path; wall time and the cores other processes used meanwhile."""
    if a.quiet_wait > 0:
        wait_for_quiet(a.quiet_wait, a.busy_max)
    busy0, cpu0, t0 = machine_busy_s(), children_cpu_s(), time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n\n")
        log.flush()
        try:
            rc = subprocess.run(
                cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=child_env(a), timeout=a.timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall, busy1 = time.perf_counter() - t0, machine_busy_s()
    other = (
        max(0.0, (busy1 - busy0 - (children_cpu_s() - cpu0)) / wall)
        if busy0 is not None and busy1 is not None
        else None
    )
    return {"rc": rc, "wall_s": wall, "other_cores": other, "log": str(log_path)}


# ---- the two sides of each configuration


def ours_cmd(cfg: dict, a, data: dict, out_dir: Path) -> list[str]:
    lora = ["--lora-r", "8", "--lora-alpha", "16", "--lora-target-modules", LORA_TARGETS] if cfg["lora"] else []
    if cfg["kind"] == "grpo":
        return [
            a.ours_python,
            os.path.join(a.main_dir, "benchmarks", "grpo_same_reward.py"),  # the harness's reward, not Math-Verify
            "--model",
            cfg["model"],
            "--data-path",
            data[cfg["prompts"]],
            "--no-chat-template",
            "--max-prompt-length",
            str(cfg["max_prompt_length"]),
            "--prompts-per-step",
            "2",
            "--group-size",
            "8",
            "--max-new-tokens",
            str(cfg["new_tokens"]),
            "--temperature",
            "1.0",
            "--kl-coef",
            "0.05",
            "--loss-type",
            "dapo",
            "--scale-rewards",
            "group",
            "--num-iterations",
            "1",
            "--learning-rate",
            GRPO_LEARNING_RATE,
            "--total-steps",
            str(a.grpo_steps),
            "--micro-batch-size",
            str(cfg["micro_batch"]),
            "--no-gradient-checkpointing",
            "--format-reward-weight",
            "0",
            "--eval-every",
            "0",
            "--seed",
            "0",
            "--overwrite",
            "--output-dir",
            str(out_dir),
            *lora,
            *shlex.split(a.grpo_flags),
        ]
    cmd = [
        a.ours_python,
        os.path.join(a.main_dir, "prm.py"),
        "--model",
        cfg["model"],
        "--batch-size",
        "8",
        "--total-steps",
        str(a.prm_steps),
        "--learning-rate",
        "1e-3",
        "--warmup-steps",
        "0",
        "--max-length",
        "128",
        "--step-separator",
        "\n",
        "--no-gradient-checkpointing",
        "--eval-every",
        "0",
        "--seed",
        "0",
        "--output-dir",
        str(out_dir),
        *lora,
    ]
    if data.get("prm_rows"):  # the harness's rows (no held-out rows then: nothing is evaluated)
        cmd += ["--data-path", data["prm_rows"]]
    return cmd


def trl_cmd(cfg: dict, a, out_json: Path, out_dir: Path) -> list[str]:
    if cfg["kind"] == "grpo":
        long = cfg["prompts"] == "grpo_prompts_long"
        harness = [a.trl_python, os.path.join(a.harness_dir, "trl_grpo_bench.py")]
        if long or cfg["lora"]:
            harness = [
                a.trl_python,
                os.path.abspath(__file__),
                "--harness-dir",
                a.harness_dir,
                "--trl-grpo-prefix",
                LONG_PROMPT_PREFIX if long else "",
                "--trl-grpo-lora-r",
                "8" if cfg["lora"] else "0",
                "--",
            ]
        # TRL samples per_device_train_batch_size x gradient_accumulation_steps = 16 completions at once and makes
        # one optimizer step over them, as grpo.py does
        return [
            *harness,
            "--model",
            cfg["model"],
            "--steps",
            str(a.grpo_steps),
            "--num-generations",
            "8",
            "--per-device-train-batch-size",
            str(cfg["micro_batch"]),
            "--gradient-accumulation-steps",
            str(16 // cfg["micro_batch"]),
            "--num-iterations",
            "1",
            "--max-completion-length",
            str(cfg["new_tokens"]),
            "--max-prompt-length",
            str(cfg["max_prompt_length"]),
            "--beta",
            "0.05",
            "--learning-rate",
            GRPO_LEARNING_RATE,
            "--temperature",
            "1.0",
            "--loss-type",
            "dapo",
            "--scale-rewards",
            "group",
            "--no-activation-checkpointing",
            "--seed",
            "0",
            "--no-eval-greedy",
            "--output-dir",
            str(out_dir),
            "--out-json",
            str(out_json),
        ]
    return [
        a.trl_prm_python,
        os.path.join(a.harness_dir, "trl_prm_bench.py"),
        "--model",
        cfg["model"],
        "--steps",
        str(a.prm_steps),
        "--per-device-train-batch-size",
        "8",
        "--gradient-accumulation-steps",
        "1",
        "--learning-rate",
        "1e-3",
        "--max-length",
        "128",
        "--no-activation-checkpointing",
        "--seed",
        "0",
        "--no-evaluate",
        "--output-dir",
        str(out_dir),
        "--out-json",
        str(out_json),
        *(["--lora", "--lora-r", "8", "--lora-alpha", "16"] if cfg["lora"] else []),
    ]


def run_ours(cfg: dict, a, data: dict, rep_dir: Path) -> dict:
    out_dir = rep_dir / "ours"
    res = run_cmd(ours_cmd(cfg, a, data, out_dir), a.main_dir, rep_dir / "ours.log", a)
    if res["rc"] != 0 or not (out_dir / "summary.json").exists():
        return {**res, "error": f"rc {res['rc']}; see {res['log']}"}
    s = json.loads((out_dir / "summary.json").read_text())
    res.update(step_s=s["step_time_s_mean"], peak_rss_mib=s["peak_memory_mb"], steps_run=s.get("steps"))
    if cfg["kind"] == "grpo":
        timed = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        timed = [m for m in timed if "completion_length" in m][1:]
        if timed:
            res["completion_length"] = statistics.mean(m["completion_length"] for m in timed)
        res["generated_tokens_per_s"] = s.get("generated_tokens_per_s")
    elif s.get("tokens_per_s") is not None:  # over the timed steps: their mean tokens per step
        res["tokens_per_step"] = s["tokens_per_s"] * s["step_time_s_mean"]
    shutil.rmtree(out_dir / "final", ignore_errors=True)  # model weights, up to ~80 MB a run
    return res


def run_trl(cfg: dict, a, rep_dir: Path) -> dict:
    out_json = rep_dir / "trl.json"
    res = run_cmd(trl_cmd(cfg, a, out_json, rep_dir / "trl_out"), a.harness_dir, rep_dir / "trl.log", a)
    shutil.rmtree(rep_dir / "trl_out", ignore_errors=True)
    if res["rc"] != 0 or not out_json.exists():
        return {**res, "error": f"rc {res['rc']}; see {res['log']}"}
    s = json.loads(out_json.read_text())
    res.update(step_s=s["mean_step_s_excl_first"], peak_rss_mib=s["peak_rss_mib"], steps_run=s.get("steps_run"))
    if cfg["kind"] == "grpo":  # TRL logs each step's mean completion length; its summary does not keep it
        lengths = [
            float(x) for x in re.findall(r"'completions/mean_length': '?([0-9.eE+-]+)", Path(res["log"]).read_text())
        ]
        if lengths[1:]:
            res["completion_length"] = statistics.mean(lengths[1:])
    return res


# ---- the report


def fmt(x, spec=".4f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def med(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def log_tail(path: str, n: int = 25) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def report(results: dict, a, notes: list[str]) -> str:
    hdr = (
        f"{'config':<17} {'reps':>4} {'ours s/step':>11} {'TRL s/step':>10} {'TRL/ours':>8} {'[min-max]':>13} "
        f"{'ours RSS MiB':>12} {'TRL RSS MiB':>11} {'other cores':>11}"
    )
    lines, details, worst = [hdr, "-" * len(hdr)], [], 0.0
    for name, r in results.items():
        pairs = r["pairs"]
        ours, trl = [p["ours"].get("step_s") for p in pairs], [p["trl"].get("step_s") for p in pairs]
        ratios = [t / o for o, t in zip(ours, trl) if o and t]
        other = max((x.get("other_cores") or 0.0 for p in pairs for x in (p["ours"], p["trl"])), default=0.0)
        worst = max(worst, other)
        lines.append(
            f"{name:<17} {len(pairs):>4} {fmt(med(ours)):>11} {fmt(med(trl)):>10} "
            f"{fmt(med(ratios), '.2f'):>7}x "
            f"{f'[{min(ratios):.2f}-{max(ratios):.2f}]' if ratios else '-':>13} "
            f"{fmt(med([p['ours'].get('peak_rss_mib') for p in pairs]), '.0f'):>12} "
            f"{fmt(med([p['trl'].get('peak_rss_mib') for p in pairs]), '.0f'):>11} {other:>11.2f}"
        )
        if r["cfg"]["kind"] == "grpo":
            details.append(
                f"{name}: mean completion length ours "
                f"{fmt(med([p['ours'].get('completion_length') for p in pairs]), '.2f')}, TRL "
                f"{fmt(med([p['trl'].get('completion_length') for p in pairs]), '.2f')}; ours generated "
                f"{fmt(med([p['ours'].get('generated_tokens_per_s') for p in pairs]), '.0f')} tokens/s"
            )
        elif r.get("prm_data"):
            d = r["prm_data"]
            details.append(
                f"{name}: tokens/step ours "
                f"{fmt(med([p['ours'].get('tokens_per_step') for p in pairs]), '.1f')}, TRL "
                f"{d['tokens_per_step']:.1f} ({d['padded_tokens_per_step']:.1f} with the padding to each "
                "batch's longest row)" + ("" if r["shared_rows"] else "; ours ran on prm.py's built-in task")
            )
        for p in pairs:
            for side in ("ours", "trl"):
                if "error" in p[side]:
                    details.append(
                        f"{name} rep {p['rep']} {side} FAILED: {p[side]['error']}\n{log_tail(p[side]['log'])}"
                    )
    lines += [
        "",
        "s/step: mean per optimizer step, first excluded, median over reps; TRL/ours: median of the "
        "per-pair ratios (>1 = ours faster) [range]; RSS: peak, median; other cores: max over the runs",
    ]
    if a.grpo_flags:
        lines.append(f"grpo.py ran with {a.grpo_flags} (TRL without an equivalent)")
    if worst > 0.2:
        lines.append(
            f"WARNING: other processes used up to {worst:.2f} cores during the runs: the machine was "
            "contended, times and ratios are unreliable (try --quiet-wait 300 or --threads 1)."
        )
    return "\n".join(lines + [""] + details + notes)


# ----


def python_has(python: str, modules: str) -> bool:
    try:
        return subprocess.run([python, "-c", f"import {modules}"], capture_output=True, timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument(
        "--main-dir", default=str(Path(__file__).resolve().parents[1]), help="checkout with our grpo.py and prm.py"
    )
    ap.add_argument(
        "--bench-root",
        default=os.environ.get("BENCH_ROOT", "bench-out"),
        help="TRL harness root: venv, venv-trl113, tiny-model, small-model",
    )
    ap.add_argument(
        "--harness-dir",
        default=None,
        help="folder of trl_grpo_bench.py / trl_prm_bench.py / make_tiny.py; None = <main-dir>/../shared/bench",
    )
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--reps", type=int, default=3, help="alternated repetitions (pairs) per configuration")
    ap.add_argument("--grpo-steps", type=int, default=30)
    ap.add_argument("--prm-steps", type=int, default=50)
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=8,
        help=f"GRPO: tokens sampled per completion, both sides (grpo_small_accum: {ACCUM_NEW_TOKENS})",
    )
    ap.add_argument(
        "--grpo-flags",
        default="",
        help="more flags for grpo.py only (not TRL), in one string, e.g. --grpo-flags='--top-k 50'",
    )
    ap.add_argument(
        "--prm-data",
        choices=["harness", "builtin"],
        default="harness",
        help="PRM rows: the harness's synthetic rows (same text both sides), or prm.py's built-in task",
    )
    ap.add_argument(
        "--ours-python",
        default=None,
        help="python for grpo.py/prm.py; None = <bench-root>/venv/bin/python if it has peft and tyro, else python3",
    )
    ap.add_argument("--trl-python", default=None, help="None = <bench-root>/venv/bin/python (trl 1.16)")
    ap.add_argument("--trl-prm-python", default=None, help="None = <bench-root>/venv-trl113/bin/python (trl 1.13)")
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for every run; 0 = torch's default")
    ap.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        help="before each run wait up to this many seconds for an idle machine (busy fraction over 2 s "
        "below --busy-max); 0 = don't wait",
    )
    ap.add_argument("--busy-max", type=float, default=0.10)
    ap.add_argument("--work-dir", default=None, help="logs and outputs; None = a new folder under $TMPDIR")
    ap.add_argument("--out-json", default=None, help="all raw results; None = <work-dir>/results.json")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probe-args", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--trl-grpo-prefix", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--trl-grpo-lora-r", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("harness_args", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.harness_args and a.trl_grpo_prefix is None:
        ap.error(f"unexpected arguments: {' '.join(a.harness_args)}")
    a.harness_dir = os.path.abspath(a.harness_dir or os.path.join(a.main_dir, "..", "shared", "bench"))
    a.main_dir, a.bench_root = os.path.abspath(a.main_dir), os.path.abspath(a.bench_root)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.trl_grpo_prefix is not None:
        return trl_grpo_wrapped(a.harness_dir, a.trl_grpo_prefix, a.trl_grpo_lora_r, a.harness_args)
    if a.probe:
        print("PROBE " + json.dumps({"prm-data": probe_prm_data}[a.probe](**json.loads(a.probe_args))), flush=True)
        return 0

    notes = []
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        sys.exit(f"unknown config(s) {bad}; choose from {CONFIGS}")
    a.trl_python = a.trl_python or os.path.join(a.bench_root, "venv", "bin", "python")
    a.trl_prm_python = a.trl_prm_python or os.path.join(a.bench_root, "venv-trl113", "bin", "python")
    if a.ours_python is None:
        venv_py = os.path.join(a.bench_root, "venv", "bin", "python")
        if os.path.exists(venv_py) and python_has(venv_py, "torch, transformers, peft, tyro, numpy"):
            a.ours_python = venv_py
        else:
            a.ours_python = shutil.which("python3") or sys.executable
            notes.append(
                f"note: {venv_py} lacks torch/transformers/peft/tyro (or is missing); our scripts ran "
                f"with {a.ours_python} instead"
            )
    if not os.path.isfile(os.path.join(a.harness_dir, "trl_grpo_bench.py")):
        sys.exit(f"the TRL harness (trl_grpo_bench.py) is not in {a.harness_dir}: pass --harness-dir")
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="bench_vs_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"work dir {work}\nours: {a.ours_python} ({a.main_dir})\nTRL GRPO: {a.trl_python}\n"
        f"TRL PRM: {a.trl_prm_python}\nharness: {a.harness_dir}",
        flush=True,
    )

    # models: the missing ones built by the harness's make_tiny.py (random init, seed 0, character tokenizer)
    models = {size: os.path.join(a.bench_root, f"{size}-model") for size in ("tiny", "small")}
    for size, d in models.items():
        if any(c.split("_")[1] == size for c in configs) and not os.path.exists(os.path.join(d, "config.json")):
            print(f"building {d}", flush=True)
            subprocess.run(
                [a.trl_python, os.path.join(a.harness_dir, "make_tiny.py"), "--size", size, "--root", a.bench_root],
                check=True,
                env=child_env(a),
            )

    # data: the harness's 100 "a+b=" prompts, plain and with the long instruction; its PRM rows
    data = {}
    for key, prefix in (("grpo_prompts", ""), ("grpo_prompts_long", LONG_PROMPT_PREFIX)):
        data[key] = str(work / f"{key}.jsonl")
        with open(data[key], "w") as f:
            f.writelines(
                json.dumps({"prompt": f"{prefix}{x}+{y}=", "answer": str(x + y)}) + "\n"
                for x in range(10)
                for y in range(10)
            )
    prm_data = None
    prm_sizes = sorted({c.split("_")[1] for c in configs if c.startswith("prm")})
    if prm_sizes:
        try:  # both sizes share the character tokenizer
            prm_data = run_probe(
                a,
                a.trl_prm_python,
                "prm-data",
                harness_dir=a.harness_dir,
                model_dir=models[prm_sizes[0]],
                out_path=str(work / "prm_rows.jsonl"),
                batch_size=8,
                max_length=128,
            )
            if a.prm_data == "harness":
                data["prm_rows"] = str(work / "prm_rows.jsonl")
        except Exception as e:
            notes.append(
                f"PRM data: could not generate the harness's rows ({str(e).splitlines()[0] if str(e) else e}"
                "); ours ran on prm.py's built-in task: compare tokens per step"
            )
            print(notes[-1], flush=True)

    results = {}
    for name in configs:
        kind, size = name.split("_")[:2]
        accum = name.endswith("_accum")
        cfg = {
            "kind": kind,
            "size": size,
            "model": models[size],
            "lora": name.endswith("_lora"),
            "new_tokens": ACCUM_NEW_TOKENS if accum else a.max_new_tokens,
            "micro_batch": ACCUM_MICRO_BATCH if accum else 16,
            "prompts": "grpo_prompts_long" if name.endswith("_long") else "grpo_prompts",
            "max_prompt_length": 80 if name.endswith("_long") else 16,
        }
        r = results[name] = {
            "cfg": cfg,
            "pairs": [],
            "prm_data": prm_data if kind == "prm" else None,
            "shared_rows": bool(data.get("prm_rows")),
        }
        for rep in range(a.reps):
            rep_dir = work / name / f"rep{rep}"
            rep_dir.mkdir(parents=True, exist_ok=True)
            pair = {"rep": rep}
            for side in ("ours", "trl") if rep % 2 == 0 else ("trl", "ours"):
                x = pair[side] = run_ours(cfg, a, data, rep_dir) if side == "ours" else run_trl(cfg, a, rep_dir)
                if "error" in x:
                    outcome = f"FAILED ({x['error']})"
                else:
                    outcome = (
                        f"{x['step_s']:.4f} s/step, peak RSS {x['peak_rss_mib']:.0f} MiB, wall {x['wall_s']:.1f} s"
                    )
                    outcome += f", other cores {fmt(x['other_cores'], '.2f')}"
                print(f"{name} rep {rep} {side:<4}: {outcome}", flush=True)
            r["pairs"].append(pair)

    text = report(results, a, notes)
    print("\n" + text)
    out_json = Path(a.out_json or work / "results.json")
    out_json.write_text(json.dumps({"args": vars(a), "results": results, "notes": notes}, indent=2, default=str))
    (work / "report.txt").write_text(text + "\n")
    print(f"\nraw results: {out_json}; report: {work / 'report.txt'}; logs under {work}")
    return 1 if any("error" in p[s] for r in results.values() for p in r["pairs"] for s in ("ours", "trl")) else 0


if __name__ == "__main__":
    sys.exit(main())
