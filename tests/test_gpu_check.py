"""benchmarks/gpu_check.py shrunk to run on CPU: every run in it must finish and report, and a run that hangs must be
killed (torchrun's workers too) and recorded."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO_ROOT

SCRIPT = "benchmarks/gpu_check.py"


def processes_mentioning(text: str) -> list[int]:
    """pids of the live processes whose command line holds text (a test's tmp_path: only its own runs)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace")
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if text in command and state != "Z":
                found.append(int(entry))
    return found


def assert_no_process_left(text: str) -> None:
    for _ in range(50):  # a killed process may take a moment to go
        left = processes_mentioning(text)
        if not left:
            return
        time.sleep(0.1)
    for pid in left:  # cleanup of this test's own processes, then fail
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise AssertionError(f"processes left running: {left}")


def test_gpu_check_runs_and_reports_on_a_small_size(tmp_path):
    """Two of its runs, one a script under torchrun with --fsdp (given first, run last): the other two differ from
    these only by --fsdp, and each run costs seconds of process start-up."""
    out, work = tmp_path / "out", tmp_path / "work"
    process = subprocess.run([sys.executable, SCRIPT, "--size", "tiny", "--device", "cpu", "--out", str(out),
                              "--work-dir", str(work), "--only", "grpo-fsdp,prm"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=600)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    results = {r["name"]: r for r in report["results"]}
    assert list(results) == ["prm", "grpo-fsdp"] and report["pending"] == []
    for r in results.values():
        assert r["steps"] == 2 and r["step_time_s_mean"] > 0 and r["peak_memory_mb"] > 0
        # every step's time from metrics.jsonl, the mean over all but the first
        assert len(r["step_times_s"]) == 2 and r["step_times_s"][1] == pytest.approx(r["step_time_s_mean"])
    assert results["grpo-fsdp"]["generated_tokens_per_s"] > 0 and results["prm"]["tokens_per_s"] > 0
    assert results["prm"]["dropped_steps"] == 0  # rows nearly fill --max-length, every step kept
    markdown = (out / "gpu_check.md").read_text()
    assert "| grpo-fsdp | 2 |" in markdown and ", ".join(f"{t:.3f}" for t in results["prm"]["step_times_s"]) in markdown
    # OUT: the report and one log per run; the model and the runs in --work-dir, without their final models
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.md", "grpo-fsdp.log", "prm.log"]
    assert "== grpo-fsdp: done" in (out / "grpo-fsdp.log").read_text()
    assert (work / "prm" / "metrics.jsonl").is_file() and not any((work / n / "final").exists() for n in results)


def test_a_run_past_its_timeout_is_killed_with_its_workers_and_recorded(tmp_path):
    """A stand-in for torchrun: its worker starts its own session, as torchrun's do, so killing the launcher's
    process group alone would leave it running."""
    spec = importlib.util.spec_from_file_location("gpu_check", REPO_ROOT / SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    worker_pid = tmp_path / "worker.pid"
    launcher = ("import subprocess, sys, time; "
                f"w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', {str(tmp_path)!r}], "
                "start_new_session=True); "
                f"open({str(worker_pid)!r}, 'w').write(str(w.pid)); print('launched', flush=True); time.sleep(600)")
    log = tmp_path / "hang.log"
    started = time.perf_counter()
    row = gpu_check.run("hang", [sys.executable, "-c", launcher, str(tmp_path)], tmp_path / "run", log, timeout=4)
    assert time.perf_counter() - started < 20
    assert row["error"] == "timed out after 4 s" and row["step_times_s"] == [] and row["wall_s"] >= 4
    assert worker_pid.is_file(), "the launcher had not started its worker: the check did not check"
    assert_no_process_left(str(tmp_path))
    assert "launched" in log.read_text()  # the output went to the log as the run went
    # the report of a timed-out run, with the runs not done yet
    gpu_check.write_report(tmp_path, "header\n", {}, [row], ["prm"])
    assert "| hang | timed out after 4 s |" in (tmp_path / "gpu_check.md").read_text()
    assert json.loads((tmp_path / "gpu_check.json").read_text())["pending"] == ["prm"]
