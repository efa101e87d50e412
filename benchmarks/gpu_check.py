"""Every GPU check in one run, for a machine where a GPU is lent for a few minutes (no downloads needed there).

Builds a Qwen2.5-0.5B-shaped model from a config with random weights (494M parameters, 151,936-token
vocabulary, tied embeddings) and a character tokenizer, then runs, in bf16:
  1. grpo.py: 5 steps, 8 prompts x 8 completions, 256 new tokens, KL to a reference model (a frozen copy);
  2. prm.py: 20 steps, batch 16, rows of 1,021 tokens with 10 labelled steps (--max-length 1024);
  3. grpo.py again with --compile-decoding (its first step compiles: it shows in the per-step times);
  4. both again for a few steps with --fsdp under `torchrun --nproc_per_node 1`: the sharded code path (mixed
     precision, gathered checkpoints, generation through FSDP) on CUDA and NCCL. Always last, whatever the order
     --only gives, so that a --deadline cuts these, not the main figures (a second call with --only can run them);
and prints each run's per-step times (from its metrics.jsonl) and their mean (first step excluded), generated and
trained tokens/s, MFU and peak memory as a Markdown table, also written with the device name to
OUT/gpu_check.md and OUT/gpu_check.json.

    python benchmarks/gpu_check.py --out gpu-check --timeout 120 --deadline 270   # on the GPU: at most 4.5 min
    python benchmarks/gpu_check.py --size tiny --device cpu --out /tmp/gc         # the same runs, shrunk (a test)

Made to lose nothing to a hang or a kill: each run is a subprocess in its own process group (torchrun's workers,
which start their own sessions, are found through /proc and killed with it), stopped after --timeout seconds
(and within --deadline of the start) and recorded as an error row; its stdout and stderr go straight to
OUT/<name>.log (one OUT/runs.log past 6 runs); the report is rewritten after every run, with the runs not done
yet listed as such. OUT gets only those small files (at most 8): the model, the rows and the run directories go
to --work-dir, and each run's final/ and checkpoints are deleted once read (--keep-models keeps them). The
scripts have no flag to skip writing final/ (for grpo.py with its optimiser state), so each run still pays for
that write.

The architecture is Llama with Qwen2.5-0.5B's dimensions: Qwen2 is Llama plus q/k/v biases (FLOPs and memory
agree to 0.01%), and transformers 5.24's AutoTokenizer turns the tokenizer of a qwen2 model into a byte-level one
that drops the newline step separator. A random-weight policy rarely samples EOS, so every completion runs to 256
tokens: the worst case for the rollout. On CPU the --fsdp runs go through tests/fsdp_on_cpu.py (users get an error
for --fsdp on CPU).
"""

import argparse
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
sys.path.insert(0, str(REPO_ROOT))

# Qwen2.5-0.5B's dimensions (its config.json), in a Llama config: see the docstring
SIZES = {
    "qwen0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                     num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=2048, rope_theta=1000000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=True),
}
# (grpo steps, prompts per step, group size, new tokens), (prm steps, batch size, max length), fsdp steps
WORKLOADS = {"qwen0.5b": ((5, 8, 8, 256), (20, 16, 1024), 3), "tiny": ((3, 4, 4, 16), (4, 4, 128), 2)}
RUN_NAMES = ("grpo", "prm", "grpo-compiled", "grpo-fsdp", "prm-fsdp")
MAX_LOG_FILES = 6  # OUT holds the .md, the .json and at most this many logs: 8 files come back from the device
LOG_LIMIT = 4 << 20  # a longer log keeps its first MiB and its last 3 MiB (16 MiB come back per file)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
CHILD_ENV = {"WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


class Stopped(Exception):
    """This script got SIGTERM, SIGINT or SIGHUP: the run in progress is killed and the report written."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signal.Signals(signum).name}")
        self.signum = signum
        self.row: dict | None = None


def _raise_stopped(signum: int, frame) -> None:
    raise Stopped(signum)


def take_pending_stop() -> None:
    """Lets a stop signal that came while they were blocked in this thread be raised here (the mask is kept)."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def build_model(size: str, directory: Path) -> int:
    """The model and prm.py's character tokenizer (a superset of grpo.py's), saved in bf16; returns its size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import prm

    tokenizer = prm.build_tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(**SIZES[size], head_dim=SIZES[size]["hidden_size"] // SIZES[size]["num_attention_heads"],
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


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
            labels = [rng.random() < 0.7 for _ in steps]
            f.write(json.dumps({"prompt": prompt, "completions": steps, "labels": labels}) + "\n")


# ---- a subprocess with a time limit, killed with all its descendants

def _parent_pids() -> dict[int, int]:
    """pid -> parent pid of every process /proc shows (empty without /proc)."""
    parents = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
                parents[int(entry)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                pass  # it ended meanwhile
    return parents


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for child, parent in _parent_pids().items():
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _signal(pid: int, sig: int, group: bool = False) -> None:
    try:
        if group:
            if os.getpgid(pid) != os.getpgrp():  # never this script's own group
                os.killpg(os.getpgid(pid), sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL to the process, its group and every descendant (torchrun's workers start their own sessions, so
    its group alone would leave them running, and they would be orphaned once torchrun dies): the tree is frozen
    with SIGSTOP first, so that nothing in it starts another process meanwhile. SIGKILL, not SIGTERM: the scripts
    save a checkpoint on SIGTERM, which takes long on a real model. The stop signals are blocked meanwhile (a stop
    in the middle would leave the tree frozen, not killed) and delivered afterwards, if still unblocked then."""
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
        _signal(process.pid, signal.SIGKILL, group=True)
        for pid in tree:
            _signal(pid, signal.SIGKILL, group=True)
            _signal(pid, signal.SIGKILL)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a stop that came meanwhile is raised here


try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # Linux (glibc or musl)
except (OSError, AttributeError):
    _PRCTL = None


def _child_setup() -> None:
    """In the child before exec: its own process group, and SIGKILL when this script dies (PR_SET_PDEATHSIG, Linux
    only), so that a kill of this script does not leave the run going on (torchrun's workers excepted)."""
    os.setpgrp()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked in this script around the start
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGKILL))


def trim_log(path: Path) -> None:
    size = path.stat().st_size if path.exists() else 0
    if size <= LOG_LIMIT:
        return
    with open(path, "rb") as f:
        head = f.read(1 << 20)
        f.seek(size - (3 << 20))
        tail = f.read()
    path.write_bytes(head + f"\n[... {size - len(head) - len(tail):,} bytes cut ...]\n".encode() + tail)


def step_times(run_dir: Path) -> list[float]:
    """The step_time_s of every step in run_dir/metrics.jsonl, as far as the run got."""
    times = []
    try:
        with open(run_dir / "metrics.jsonl") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line cut by a kill
                if isinstance(row, dict) and isinstance(row.get("step_time_s"), (int, float)):
                    times.append(float(row["step_time_s"]))
    except OSError:
        pass
    return times


def run(name: str, command: list[str], run_dir: Path, log: Path, timeout: float, keep_models: bool = False) -> dict:
    """One run as a subprocess, its output appended to log as it goes; its summary.json with the wall time, the
    command and the per-step times, or an error row (non-zero exit, timeout, no summary) with the steps done. A
    signal to this script kills the run and raises Stopped with the run's row.

    The stop signals are blocked in this thread from the run's start to the end of this function, but for the wait
    on the run: a stop cannot leave the run started and untracked, interrupt its killing (kill_tree) or throw away
    the row of a finished run. One that came during the start is taken at the wait (the run is killed); one that
    comes after the wait is left pending to the end, where it is raised as Stopped with the row, or, if the caller
    blocks them too (main, which blocks them before any other thread starts, so that they reach this thread only),
    at the caller's next take_pending_stop()."""
    print(f"== {name} (at most {timeout:.0f} s, log {log.name}): {' '.join(command)}", flush=True)
    start = time.perf_counter()
    row: dict = {"name": name, "command": command}
    shutil.rmtree(run_dir, ignore_errors=True)  # no step times from an earlier check in the same --work-dir
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        row, stopped = _run_blocked(name, command, run_dir, log, timeout, keep_models, start, row)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a stop left pending replaces the error
        raise
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a stop left pending is raised here, if let in
    except (Stopped, KeyboardInterrupt) as stop:
        if stopped is None:  # it came after the run (killed by the first one otherwise): the row stands as it is
            stopped = stop if isinstance(stop, Stopped) else Stopped(signal.SIGINT)
    if stopped is not None:
        stopped.row = row
        raise stopped
    return row


def _run_blocked(name: str, command: list[str], run_dir: Path, log: Path, timeout: float, keep_models: bool,
                 start: float, row: dict) -> tuple[dict, Stopped | None]:
    """run()'s work, called with the stop signals blocked: (the row, the Stopped that came during the run)."""
    stopped = None
    with open(log, "ab") as f:
        f.write(f"== {name}: {' '.join(command)}\n".encode())
        f.flush()
        process = subprocess.Popen(command, cwd=REPO_ROOT, env={**os.environ, **CHILD_ENV},
                                   stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                   preexec_fn=_child_setup)
        try:
            try:
                # the only place where a stop gets in; one that came during the start is raised right here
                signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
                code = process.wait(timeout=timeout)
            finally:
                signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            row["error"] = f"exit code {code}" if code else None
        except subprocess.TimeoutExpired:
            kill_tree(process)
            row["error"] = f"timed out after {timeout:.0f} s"
        except (Stopped, KeyboardInterrupt) as stop:
            stopped = stop if isinstance(stop, Stopped) else Stopped(signal.SIGINT)
            if process.returncode is None:
                kill_tree(process)
                row["error"] = str(stopped)
            else:  # the run ended just before the stop was raised: its row stands
                row["error"] = f"exit code {process.returncode}" if process.returncode else None
        row["wall_s"] = time.perf_counter() - start
        row["step_times_s"] = step_times(run_dir)
        f.write(f"== {name}: {row['error'] or 'done'} after {row['wall_s']:.1f} s\n".encode())
    trim_log(log)
    if row["error"] is None:
        del row["error"]
        try:
            with open(run_dir / "summary.json") as f:
                summary = json.load(f)
            row = {**row, **summary}
        except (OSError, ValueError) as error:
            row["error"] = f"no summary.json ({type(error).__name__})"
    if not keep_models:  # gigabytes each on the real size; the results are read
        for path in run_dir.glob("*"):
            if path.is_dir() and (path.name in ("final", "final.tmp") or path.name.startswith("checkpoint-")):
                shutil.rmtree(path, ignore_errors=True)
    if "error" in row:
        print(f"!! {name}: {row['error']}; the end of {log}:", flush=True)
        try:
            print("\n".join(log.read_text(errors="replace").splitlines()[-40:]), flush=True)
        except OSError:
            pass
    else:
        print(f"== {name}: {row['steps']} steps, {_number(row.get('step_time_s_mean'), '.3f')} s/step, "
              f"{row['wall_s']:.1f} s in all", flush=True)
    return row, stopped


# ---- the report

def _number(value, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    if not isinstance(value, (int, float)) or math.isnan(value):
        return "-"
    return f"{scale * value:{spec}}{suffix}"


def table(results: list[dict], pending: list[str] = ()) -> str:
    lines = [("| run | steps | s/step (mean, first excluded) | s/step (each) | generated tok/s | trained tok/s | MFU | "
              "peak memory MiB |"),
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        each = ", ".join(f"{t:.3f}" for t in r.get("step_times_s", [])) or "-"
        if "error" in r:
            lines.append(f"| {r['name']} | {r['error']} | | {each} | | | | |")
            continue
        trained = r.get("trained_tokens_per_s", r.get("tokens_per_s"))
        lines.append(f"| {r['name']} | {r['steps']} | {_number(r.get('step_time_s_mean'), '.3f')} | {each} | "
                     f"{_number(r.get('generated_tokens_per_s'), ',.0f')} | {_number(trained, ',.0f')} | "
                     f"{_number(r.get('mfu'), '.1f', 100, '%')} | {_number(r.get('peak_memory_mb'), ',.0f')} |")
    for name in pending:
        lines.append(f"| {name} | not run (yet) | | | | | | |")
    lines.append("\ntrained tok/s: for prm, tokens_per_s (trained tokens over the whole step); for grpo, "
                 "trained_tokens_per_s (over the update phase alone: generation, reference and reward time left "
                 "out, as generated tok/s is over the generation phase alone). All over the steps after the first.")
    return "\n".join(lines)


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def write_report(out: Path, header: str, info: dict, results: list[dict], pending: list[str],
                 echo: bool = False) -> None:
    """OUT/gpu_check.md and OUT/gpu_check.json, rewritten whole after every run."""
    report = header + "\n" + table(results, pending)
    if echo:
        print(report, flush=True)
    _write_atomically(out / "gpu_check.md", report + "\n")
    _write_atomically(out / "gpu_check.json", json.dumps({**info, "results": results, "pending": pending}, indent=2))


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in ("torch", "transformers", "tyro", "peft"):
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            found.append(f"{package} missing")
    return ", ".join(found)


def device_name(device: str) -> str:
    if not device.startswith("cuda"):
        return f"CPU ({os.cpu_count()} cores)"
    try:
        import torch

        return torch.cuda.get_device_name()
    except Exception as error:  # the report is still written
        return f"CUDA device (name unread: {type(error).__name__}: {error})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu-check", help="where the report and the logs go (small files only)")
    parser.add_argument("--work-dir", default="/tmp/gpu_check", help="where the model, the rows and the runs go")
    parser.add_argument("--size", choices=list(SIZES), default="qwen0.5b")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to check this script on a small size")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="for MFU; 0 = guess from the device name")
    parser.add_argument("--timeout", type=float, default=170.0, help="seconds each run may take before it is killed")
    parser.add_argument("--deadline", type=float, default=0.0,
                        help="seconds from this script's start by which every run is done or killed (0 = none)")
    parser.add_argument("--only", default=",".join(RUN_NAMES),
                        help=f"comma-separated, of {', '.join(RUN_NAMES)} (the --fsdp ones are run last)")
    parser.add_argument("--keep-models", action="store_true", help="keep each run's final/ and checkpoints")
    args = parser.parse_args()
    started = time.perf_counter()
    names = [name for name in args.only.split(",") if name]
    unknown = sorted(set(names) - set(RUN_NAMES))
    if unknown or not names or len(set(names)) < len(names):
        parser.error(f"--only: {args.only!r} (unknown: {unknown}); name each run once, of {', '.join(RUN_NAMES)}")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():  # else it would build the model, then fail each run in turn
            parser.error(f"--device {args.device}: this torch ({torch.__version__}) sees no GPU; on a CPU, check the "
                         "script with --size tiny --device cpu")
    # the --fsdp runs last, whatever the order given: a --deadline then cuts them, not the main figures
    names.sort(key=lambda name: name.endswith("-fsdp"))
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise_stopped)
    # blocked from here on in this thread, before any other starts (torch's, CUDA's): every thread inherits the
    # block, so that a stop reaches this thread alone, and only where it lets them in: in the wait on a run (run())
    # and between runs (take_pending_stop()), never while a run is started or killed or its row recorded
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    os.environ.update({k: v for k, v in CHILD_ENV.items() if k != "WANDB_MODE"})  # no hub look-ups here either

    out, work = Path(args.out).resolve(), Path(args.work_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in ["gpu_check.md", "gpu_check.json", "runs.log", *(f"{name}.log" for name in RUN_NAMES)]:
        (out / old).unlink(missing_ok=True)  # a rerun into the same OUT
    work.mkdir(parents=True, exist_ok=True)
    model_dir, rows_path = work / "model", work / "prm_rows.jsonl"
    parameters = build_model(args.size, model_dir)
    (grpo_steps, prompts, group, new_tokens), (prm_steps, batch, max_length), fsdp_steps = WORKLOADS[args.size]
    write_prm_rows(rows_path, batch * prm_steps * 2, max_length)
    python, dtype = sys.executable, "bfloat16"
    common = ["--model", str(model_dir), "--dtype", dtype, "--device", args.device, "--eval-every", "0",
              "--peak-tflops", str(args.peak_tflops), "--overwrite"]
    grpo_flags = [*common, "--total-steps", str(grpo_steps), "--prompts-per-step", str(prompts), "--group-size",
                  str(group), "--max-new-tokens", str(new_tokens), "--max-prompt-length", "64", "--kl-coef", "0.05",
                  "--learning-rate", "1e-6", "--num-eval-prompts", "0"]
    prm_flags = [*common, "--data-path", str(rows_path), "--num-val-rows", "0", "--batch-size", str(batch),
                 "--max-length", str(max_length), "--total-steps", str(prm_steps), "--learning-rate", "1e-5"]
    # --fsdp needs torchrun; on CPU it goes through the tests' driver, which lifts the CUDA-only check
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    fsdp = {script: [*torchrun, "tests/fsdp_on_cpu.py", script] if args.device == "cpu"
            else [*torchrun, f"{script}.py"] for script in ("grpo", "prm")}
    commands = {
        "grpo": [python, "grpo.py", *grpo_flags],
        "prm": [python, "prm.py", *prm_flags],
        "grpo-compiled": [python, "grpo.py", *grpo_flags, "--compile-decoding"],
        "grpo-fsdp": [*fsdp["grpo"], *grpo_flags, "--total-steps", str(fsdp_steps), "--fsdp"],
        "prm-fsdp": [*fsdp["prm"], *prm_flags, "--total-steps", str(fsdp_steps), "--fsdp"],
    }
    commands = {name: [*command, "--output-dir", str(work / name)] for name, command in commands.items()}
    device = device_name(args.device)
    header = (f"{args.size}-shaped model, {parameters:,} parameters, random weights, bf16 (FSDP runs: fp32 sharded "
              f"weights, bf16 compute), on {device}; {versions()}\n"
              f"grpo: {prompts} prompts x {group} completions, {new_tokens} new tokens, KL 0.05 (reference model); "
              f"prm: batch {batch}, --max-length {max_length}; at most {args.timeout:.0f} s a run"
              + (f", {args.deadline:.0f} s in all" if args.deadline else "") + "\n")
    info = {"device": device, "size": args.size, "parameters": parameters, "versions": versions()}
    results: list[dict] = []
    write_report(out, header, info, results, names)
    stopped = None
    try:
        for i, name in enumerate(names):
            take_pending_stop()  # one that came since: during the model's build or the last run's bookkeeping
            log = out / (f"{name}.log" if len(names) <= MAX_LOG_FILES else "runs.log")
            timeout = args.timeout
            if args.deadline:
                timeout = min(timeout, args.deadline - (time.perf_counter() - started) - 5)
            if args.deadline and timeout < 10:
                results.append({"name": name, "error": "skipped: --deadline reached", "command": commands[name]})
            else:
                try:
                    results.append(run(name, commands[name], work / name, log, timeout, args.keep_models))
                except Stopped as stop:
                    results.append(stop.row or {"name": name, "error": str(stop), "command": commands[name]})
                    raise
            write_report(out, header, info, results, names[i + 1:])
        take_pending_stop()
    except Stopped as stop:  # in a run (its row is in) or between runs (the runs left are listed as not run)
        stopped = stop
    write_report(out, header, info, results, names[len(results):], echo=True)
    if stopped is not None:
        sys.exit(128 + stopped.signum)
    sys.exit(1 if any("error" in r for r in results) else 0)


if __name__ == "__main__":
    main()
