"""benchmarks/gpu_check.py shrunk to run on CPU: every run in it must finish and report, and a run that hangs must be
killed (torchrun's workers too) and recorded."""

import contextlib
import importlib.util
import json
import os
import signal
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
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"processes left running: {left}")


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO_ROOT / SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


def test_gpu_check_runs_and_reports_on_a_small_size(tmp_path, monkeypatch):
    """Its main() here, with one of its runs (the others differ in their command lines only)."""
    out, work, gpu_check = tmp_path / "out", tmp_path / "work", load_gpu_check()
    monkeypatch.setattr(
        sys,
        "argv",
        [SCRIPT, "--size", "tiny", "--device", "cpu", "--out", str(out), "--work-dir", str(work), "--only", "prm"],
    )
    handlers = {sig: signal.getsignal(sig) for sig in gpu_check.STOP_SIGNALS}
    try:
        with pytest.raises(SystemExit) as exit_info:
            gpu_check.main()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert exit_info.value.code == 0, (out / "prm.log").read_text()[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    [result] = report["results"]
    assert result["name"] == "prm" and report["pending"] == []
    assert result["steps"] == 2 and result["step_time_s_mean"] > 0 and result["peak_memory_mb"] > 0
    # every step's time from metrics.jsonl, the mean over all but the first
    assert len(result["step_times_s"]) == 2 and result["step_times_s"][1] == pytest.approx(result["step_time_s_mean"])
    assert result["tokens_per_s"] > 0 and result["dropped_steps"] == 0  # rows nearly fill --max-length
    markdown = (out / "gpu_check.md").read_text()
    assert "| prm | 2 |" in markdown and ", ".join(f"{t:.3f}" for t in result["step_times_s"]) in markdown
    # OUT: the report and the run's log; the model and the run in --work-dir, without its final model
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.md", "prm.log"]
    assert "== prm: done" in (out / "prm.log").read_text()
    assert (work / "prm" / "metrics.jsonl").is_file() and not (work / "prm" / "final").exists()


def test_a_run_past_its_timeout_is_killed_with_its_workers_and_recorded(tmp_path):
    """A stand-in for torchrun: its worker starts its own session, as torchrun's do, so killing the launcher's
    process group alone would leave it running."""
    gpu_check = load_gpu_check()
    worker_pid = tmp_path / "worker.pid"
    launcher = (
        "import subprocess, sys, time; "
        f"w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', {str(tmp_path)!r}], "
        "start_new_session=True); "
        f"open({str(worker_pid)!r}, 'w').write(str(w.pid)); print('launched', flush=True); time.sleep(600)"
    )
    log = tmp_path / "hang.log"
    started = time.perf_counter()
    row = gpu_check.run("hang", [sys.executable, "-c", launcher, str(tmp_path)], tmp_path / "run", log, timeout=2)
    assert time.perf_counter() - started < 20
    assert row["error"] == "timed out after 2 s" and row["step_times_s"] == [] and row["wall_s"] >= 2
    assert worker_pid.is_file(), "the launcher had not started its worker: the check did not check"
    assert_no_process_left(str(tmp_path))
    assert "launched" in log.read_text()  # the output went to the log as the run went
    # the report of a timed-out run, with the runs not done yet
    gpu_check.write_report(tmp_path, "header\n", {}, [row], ["prm"])
    assert "| hang | timed out after 2 s |" in (tmp_path / "gpu_check.md").read_text()
    assert json.loads((tmp_path / "gpu_check.json").read_text())["pending"] == ["prm"]
