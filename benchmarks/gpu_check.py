"""Every GPU check in one run: grpo.py and prm.py on a Qwen2.5-0.5B-shaped model, per-step time, tokens/s, MFU
and peak memory. Nothing is downloaded.

Builds a model from a config with random weights (494M parameters, 151,936-token vocabulary, tied embeddings)
and a character tokenizer, then runs (bf16 on CUDA, as both scripts choose by themselves):
  grpo       grpo.py, 5 steps, 8 prompts x 8 completions, 256 new tokens, KL to a reference model;
  prm        prm.py, 20 steps, batch 16, rows of 1,021 tokens with 10 labelled steps (--max-length 1024);
  grpo-fsdp, prm-fsdp   both again for 3 steps with --fsdp under `torchrun --nproc_per_node 1` (the sharded
             path on CUDA and NCCL); always last, so that a --deadline cuts these, not the main figures.
The report (a Markdown table, and JSON) goes to OUT/gpu_check.md and OUT/gpu_check.json, rewritten after every
run; each run's output goes to OUT/<run>.log as it runs. The model, the rows and the run directories go to
--work-dir; each run's final/ and checkpoints are deleted once read.

    python benchmarks/gpu_check.py --out gpu-check --timeout 120 --deadline 270   # on a GPU: at most 4.5 min
    python benchmarks/gpu_check.py --size tiny --device cpu --out /tmp/gc         # the same runs, shrunk, on CPU

Each run is a subprocess in its own process group, killed with all its descendants (torchrun's workers start
their own sessions: they are found through /proc) after --timeout seconds or at --deadline, and recorded as an
error row with the steps it did. SIGTERM or Ctrl-C kills the run in progress and writes the report.

The layers are Llama's with Qwen2.5-0.5B's dimensions (Qwen2 is Llama plus q/k/v biases: FLOPs and memory agree
to 0.01%; AutoTokenizer would turn a qwen2 model's tokenizer into a byte-level one that drops the newline step
separator). A random policy rarely samples EOS, so every completion runs to 256 tokens: the rollout's worst case.
"""

import argparse
import contextlib
import ctypes
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# Qwen2.5-0.5B's dimensions (its config.json), in a Llama config: see the docstring
SIZES = {
    "qwen0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}
# (grpo steps, prompts per step, group size, new tokens), (prm steps, batch size, max length), fsdp steps
WORKLOADS = {"qwen0.5b": ((5, 8, 8, 256), (20, 16, 1024), 3), "tiny": ((2, 2, 4, 8), (2, 4, 64), 2)}
CHARACTERS = "0123456789abcdefghijklmnopqrstuvwxyz+-*/=%()., \n"  # of the prompts and the PRM rows
RUN_NAMES = ("grpo", "prm", "grpo-fsdp", "prm-fsdp")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
CHILD_ENV = {"WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


class Stopped(Exception):
    """This script got a stop signal: the run in progress is killed (its row in .row) and the report written."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signal.Signals(signum).name}")
        self.signum, self.row = signum, None


def _raise_stopped(signum: int, frame) -> None:
    for sig in STOP_SIGNALS:  # once: a second signal must not cut the killing and the report short
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


def build_model(size: str, directory: Path) -> int:
    """The model, saved in bf16, and a character tokenizer (one token a character, BOS prepended); its size."""
    import torch
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    core = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(specials + list(CHARACTERS))}, merges=[], unk_token="<unk>")
    )
    core.add_special_tokens(specials)
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    torch.manual_seed(0)
    dims = SIZES[size]
    config = LlamaConfig(
        **dims,
        head_dim=dims["hidden_size"] // dims["num_attention_heads"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def write_grpo_prompts(path: Path) -> None:
    """grpo.py's built-in prompts as a --data-path, which has no held-out rows: no evaluation to wait for."""
    with open(path, "w") as f:
        f.writelines(
            json.dumps({"prompt": f"({n}+7)%10=", "answer": str((n + 7) % 10)}) + "\n" for n in range(100, 400)
        )


def write_prm_rows(path: Path, rows: int, max_length: int) -> None:
    """Rows that nearly fill max_length (one token a character): BOS, a prompt and 10 steps with separators."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz0123456789+-*/=().,"
    step_tokens = max_length // 11  # with its separator
    prompt_tokens = max_length - 1 - 10 * step_tokens - 3
    with open(path, "w") as f:
        for _ in range(rows):
            prompt = "".join(rng.choice(letters) for _ in range(prompt_tokens))
            steps = ["".join(rng.choice(letters) for _ in range(step_tokens - 1)) for _ in range(10)]
            f.write(
                json.dumps({"prompt": prompt, "completions": steps, "labels": [rng.random() < 0.7 for _ in steps]})
                + "\n"
            )


# ---- a subprocess with a time limit, killed with all its descendants


def descendants(pid: int) -> set[int]:
    """Every live descendant of pid, from the parent pids in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])  # after the name, which may hold spaces
            except (OSError, IndexError, ValueError):
                continue  # it ended meanwhile
            children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _signal(pid: int, sig: int, group: bool = False) -> None:
    try:
        if not group:
            os.kill(pid, sig)
        elif os.getpgid(pid) != os.getpgrp():  # never this script's own group
            os.killpg(os.getpgid(pid), sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL to the process, its group and every descendant, the tree frozen first with SIGSTOP so that nothing
    in it starts another process meanwhile. SIGKILL, not SIGTERM: the scripts save a checkpoint on SIGTERM, which
    takes long on a real model. Stop signals wait until it is done."""
    if process.returncode is not None:
        return  # reaped already: its pid may be another process's now
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        _signal(process.pid, signal.SIGSTOP, group=True)
        tree: set[int] = set()
        for _ in range(5):  # until no new descendant shows up
            found = descendants(process.pid) - tree
            if not found:
                break
            for pid in found:
                _signal(pid, signal.SIGSTOP)
            tree |= found
        for pid in (process.pid, *tree):
            _signal(pid, signal.SIGKILL, group=True)
            _signal(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # Linux
except (OSError, AttributeError):
    _PRCTL = None


def _child_setup() -> None:
    """In the child before exec: its own process group, and SIGKILL when this script dies (PR_SET_PDEATHSIG)."""
    os.setpgrp()
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGKILL))


def step_times(run_dir: Path) -> list[float]:
    """The step_time_s of every step in run_dir/metrics.jsonl, as far as the run got."""
    times = []
    try:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            if isinstance(row, dict) and isinstance(row.get("step_time_s"), (int, float)):
                times.append(float(row["step_time_s"]))
    except OSError:
        pass
    return times


def run(name: str, command: list[str], run_dir: Path, log: Path, timeout: float, env: dict | None = None) -> dict:
    """One run as a subprocess, its output appended to log: its summary.json with the wall time, the command and
    the per-step times, or an error row (non-zero exit, timeout, no summary) with the steps done. A stop signal
    kills the run and raises Stopped with the row."""
    print(f"== {name} (at most {timeout:.0f} s, log {log.name}): {' '.join(command)}", flush=True)
    row: dict = {"name": name, "command": command}
    shutil.rmtree(run_dir, ignore_errors=True)  # no step times from an earlier check in the same --work-dir
    start = time.perf_counter()
    with open(log, "ab") as f:
        f.write(f"== {name}: {' '.join(command)}\n".encode())
        f.flush()
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env={**os.environ, **CHILD_ENV, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            preexec_fn=_child_setup,
        )
        stopped = None
        try:
            code = process.wait(timeout=timeout)
            row["error"] = f"exit code {code}" if code else None
        except subprocess.TimeoutExpired:
            kill_tree(process)
            row["error"] = f"timed out after {timeout:.0f} s"
        except (Stopped, KeyboardInterrupt) as stop:
            stopped = stop if isinstance(stop, Stopped) else Stopped(signal.SIGINT)
            kill_tree(process)
            row["error"] = str(stopped)
        row["wall_s"] = time.perf_counter() - start
        row["step_times_s"] = step_times(run_dir)
        f.write(f"== {name}: {row['error'] or 'done'} after {row['wall_s']:.1f} s\n".encode())
    if row["error"] is None:
        del row["error"]
        try:
            row.update(json.loads((run_dir / "summary.json").read_text()))
        except (OSError, ValueError) as error:
            row["error"] = f"no summary.json ({type(error).__name__})"
    for path in run_dir.glob("*"):  # gigabytes each on the real size; the results are read
        if path.is_dir() and (path.name.startswith("final") or path.name.startswith("checkpoint-")):
            shutil.rmtree(path, ignore_errors=True)
    if stopped is not None:
        stopped.row = row
        raise stopped
    if "error" in row:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        print(f"!! {name}: {row['error']}; the end of {log}:\n{tail}", flush=True)
    else:
        print(
            f"== {name}: {row['steps']} steps, {number(row.get('step_time_s_mean'), '.3f')} s/step, "
            f"{row['wall_s']:.1f} s in all",
            flush=True,
        )
    return row


# ---- the report


def number(value, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    if not isinstance(value, (int, float)) or math.isnan(value):
        return "-"
    return f"{scale * value:{spec}}{suffix}"


def table(results: list[dict], pending: list[str]) -> str:
    lines = [
        "| run | steps | s/step (mean, first excluded) | s/step (each) | generated tok/s | trained tok/s | MFU | "
        "peak memory MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        each = ", ".join(f"{t:.3f}" for t in r.get("step_times_s", [])) or "-"
        if "error" in r:
            lines.append(f"| {r['name']} | {r['error']} | | {each} | | | | |")
            continue
        trained = r.get("trained_tokens_per_s", r.get("tokens_per_s"))
        lines.append(
            f"| {r['name']} | {r['steps']} | {number(r.get('step_time_s_mean'), '.3f')} | {each} | "
            f"{number(r.get('generated_tokens_per_s'), ',.0f')} | {number(trained, ',.0f')} | "
            f"{number(r.get('mfu'), '.1f', 100, '%')} | {number(r.get('peak_memory_mb'), ',.0f')} |"
        )
    lines += [f"| {name} | not run (yet) | | | | | | |" for name in pending]
    lines.append(
        "\ntrained tok/s: prm.py's over the whole step; grpo.py's over its update phase alone (as generated "
        "tok/s is over its generation phase alone). All over the steps after the first."
    )
    return "\n".join(lines)


def write_report(out: Path, header: str, info: dict, results: list[dict], pending: list[str]) -> str:
    """OUT/gpu_check.md and OUT/gpu_check.json, each replaced whole."""
    report = header + "\n" + table(results, pending)
    for name, text in (
        ("gpu_check.md", report + "\n"),
        ("gpu_check.json", json.dumps({**info, "results": results, "pending": pending}, indent=2)),
    ):
        (out / f".{name}.tmp").write_text(text)
        os.replace(out / f".{name}.tmp", out / name)
    return report


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in ("torch", "transformers", "tyro", "peft"):
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            found.append(f"{package} missing")
    return ", ".join(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu-check", help="where the report and the logs go (small files only)")
    parser.add_argument("--work-dir", default="/tmp/gpu_check", help="where the model, the rows and the runs go")
    parser.add_argument("--size", choices=list(SIZES), default="qwen0.5b")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: check this script (tiny size)")
    parser.add_argument("--timeout", type=float, default=170.0, help="seconds each run may take before it is killed")
    parser.add_argument(
        "--deadline",
        type=float,
        default=0.0,
        help="seconds from this script's start by which every run is done or killed (0 = none)",
    )
    parser.add_argument(
        "--only",
        default=",".join(RUN_NAMES),
        help=f"comma-separated, of {', '.join(RUN_NAMES)} (the --fsdp ones are run last)",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    names = [name for name in args.only.split(",") if name]
    if not names or set(names) - set(RUN_NAMES) or len(set(names)) < len(names):
        parser.error(f"--only {args.only!r}: name each run once, of {', '.join(RUN_NAMES)}")
    names.sort(key=lambda name: name.endswith("-fsdp"))  # last, whatever the order: a --deadline cuts them first
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():  # before the model's build
        parser.error(
            f"--device cuda: this torch ({torch.__version__}) sees no GPU; on a CPU, check the script "
            "with --size tiny --device cpu"
        )
    os.environ.update({k: v for k, v in CHILD_ENV.items() if k != "WANDB_MODE"})  # no hub look-ups here either

    out, work = Path(args.out).resolve(), Path(args.work_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in ["gpu_check.md", "gpu_check.json", *(f"{name}.log" for name in RUN_NAMES)]:
        (out / old).unlink(missing_ok=True)  # a rerun into the same OUT
    work.mkdir(parents=True, exist_ok=True)
    model_dir, rows_path, prompts_path = work / "model", work / "prm_rows.jsonl", work / "grpo_prompts.jsonl"
    parameters = build_model(args.size, model_dir)
    (grpo_steps, prompts, group, new_tokens), (prm_steps, batch, max_length), fsdp_steps = WORKLOADS[args.size]
    write_prm_rows(rows_path, batch * prm_steps * 2, max_length)
    write_grpo_prompts(prompts_path)
    common = ["--model", str(model_dir), "--eval-every", "0"]
    grpo_flags = [
        *common,
        "--data-path",
        str(prompts_path),
        "--total-steps",
        str(grpo_steps),
        "--prompts-per-step",
        str(prompts),
        "--group-size",
        str(group),
        "--max-new-tokens",
        str(new_tokens),
        "--max-prompt-length",
        "64",
        "--kl-coef",
        "0.05",
        "--learning-rate",
        "1e-6",
        "--overwrite",
    ]
    prm_flags = [
        *common,
        "--data-path",
        str(rows_path),
        "--batch-size",
        str(batch),
        "--max-length",
        str(max_length),
        "--total-steps",
        str(prm_steps),
        "--learning-rate",
        "1e-5",
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    commands = {
        "grpo": [sys.executable, "grpo.py", *grpo_flags],
        "prm": [sys.executable, "prm.py", *prm_flags],
        "grpo-fsdp": [*torchrun, "grpo.py", *grpo_flags, "--total-steps", str(fsdp_steps), "--fsdp"],
        "prm-fsdp": [*torchrun, "prm.py", *prm_flags, "--total-steps", str(fsdp_steps), "--fsdp"],
    }
    commands = {name: [*command, "--output-dir", str(work / name)] for name, command in commands.items()}
    # on CPU: no GPU for the scripts to pick by themselves, one thread a run (this is a check of the script)
    env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"} if args.device == "cpu" else {}
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    header = (
        f"{args.size}-shaped model, {parameters:,} parameters, random weights, "
        f"{'bf16 compute' if args.device == 'cuda' else 'fp32'}, on {device}; {versions()}\n"
        f"grpo: {prompts} prompts x {group} completions, {new_tokens} new tokens, KL 0.05 (reference model); "
        f"prm: batch {batch}, --max-length {max_length}; at most {args.timeout:.0f} s a run"
        + (f", {args.deadline:.0f} s in all" if args.deadline else "")
        + "\n"
    )
    info = {"device": device, "size": args.size, "parameters": parameters, "versions": versions()}
    results: list[dict] = []
    write_report(out, header, info, results, names)
    for sig in STOP_SIGNALS:  # from here on a stop kills the run in progress and writes the report
        signal.signal(sig, _raise_stopped)
    stopped = None
    try:
        for name in names:
            timeout = args.timeout
            if args.deadline:
                timeout = min(timeout, args.deadline - (time.perf_counter() - started) - 5)
            if args.deadline and timeout < 10:
                results.append({"name": name, "error": "skipped: --deadline reached", "command": commands[name]})
            else:
                try:
                    results.append(run(name, commands[name], work / name, out / f"{name}.log", timeout, env))
                except Stopped as stop:
                    results.append(stop.row or {"name": name, "error": str(stop), "command": commands[name]})
                    raise
            write_report(out, header, info, results, names[len(results) :])
    except Stopped as stop:  # in a run (its row is in) or between runs (the runs left are listed as not run)
        stopped = stop
    print(write_report(out, header, info, results, names[len(results) :]), flush=True)
    if stopped is not None:
        sys.exit(128 + stopped.signum)
    sys.exit(1 if any("error" in r for r in results) else 0)


if __name__ == "__main__":
    main()
