"""benchmarks/gpu_check.py, the one script to run when a GPU is lent, shrunk to run here on CPU: every run in it
must finish and report, so that the few GPU minutes are not lost to a bug in the script; a run that hangs must be
killed (torchrun's workers too) and recorded, and the report must be on disk after every run."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO_ROOT

SCRIPT = "benchmarks/gpu_check.py"


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO_ROOT / SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def assert_small_outputs(out, names):
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(["gpu_check.md", "gpu_check.json", *(f"{name}.log" for name in names)])
    assert len(files) <= 8 and all((out / name).stat().st_size < (1 << 20) for name in files)


def test_gpu_check_runs_every_job_on_a_small_size(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    process = subprocess.run([sys.executable, SCRIPT, "--size", "tiny", "--device", "cpu", "--out", str(out),
                              "--work-dir", str(work)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    results = {r["name"]: r for r in report["results"]}
    assert set(results) == {"grpo", "prm", "grpo-compiled", "grpo-fsdp", "prm-fsdp"} and report["pending"] == []
    assert results["grpo"]["steps"] == results["grpo-compiled"]["steps"] == 3 and results["prm"]["steps"] == 4
    assert results["grpo-fsdp"]["steps"] == results["prm-fsdp"]["steps"] == 2
    for r in results.values():
        assert r["step_time_s_mean"] > 0 and r["peak_memory_mb"] > 0
        # every step's time from metrics.jsonl, the mean over all but the first
        assert len(r["step_times_s"]) == r["steps"] and all(t > 0 for t in r["step_times_s"])
        assert abs(sum(r["step_times_s"][1:]) / (r["steps"] - 1) - r["step_time_s_mean"]) < 1e-6
    assert results["grpo"]["generated_tokens_per_s"] > 0 and results["prm"]["tokens_per_s"] > 0
    # rows nearly fill --max-length, every step of every row kept
    assert results["prm"]["dropped_steps"] == 0
    markdown = (out / "gpu_check.md").read_text()
    assert "| grpo-fsdp | 2 |" in markdown
    assert "trained tok/s: for prm, tokens_per_s" in markdown  # the note under the table on the mixed column
    assert ", ".join(f"{t:.3f}" for t in results["prm"]["step_times_s"]) in markdown
    # OUT: the report and one log per run, small; the model and the runs in --work-dir, without their final models
    assert_small_outputs(out, results)
    assert "step 3" in (out / "grpo.log").read_text() and "summary" in (out / "prm-fsdp.log").read_text()
    assert (work / "model" / "config.json").is_file() and (work / "prm" / "metrics.jsonl").is_file()
    assert not any((work / name / "final").exists() for name in results)


def test_a_run_past_its_timeout_is_killed_with_its_workers_and_recorded(tmp_path):
    """A stand-in for torchrun: its worker starts its own session, as torchrun's do, so killing the launcher's
    process group alone would leave it running."""
    gpu_check = load_gpu_check()
    worker_pid = tmp_path / "worker.pid"
    launcher = ("import subprocess, sys, time; "
                f"w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', {str(tmp_path)!r}], "
                "start_new_session=True); "
                f"open({str(worker_pid)!r}, 'w').write(str(w.pid)); print('launched', flush=True); time.sleep(600)")
    log = tmp_path / "hang.log"
    started = time.perf_counter()
    row = gpu_check.run("hang", [sys.executable, "-c", launcher, str(tmp_path)], tmp_path / "run", log, timeout=4)
    assert time.perf_counter() - started < 30
    assert row["error"] == "timed out after 4 s" and row["step_times_s"] == [] and row["wall_s"] >= 4
    assert worker_pid.is_file(), "the launcher had not started its worker: the check did not check"
    assert_no_process_left(str(tmp_path))
    assert "launched" in log.read_text()  # the output went to the log as the run went


@pytest.fixture
def gpu_check_stopping():
    """gpu_check with its handlers for the stop signals in this process (as its main() sets them, so that a stop
    raises Stopped); the handlers and this thread's signal mask are restored after, and no stop may be left
    pending. The tests send their signal to this thread alone (pthread_kill), so that it cannot land in another
    thread of the test process."""
    gpu_check = load_gpu_check()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    previous = {sig: signal.signal(sig, gpu_check._raise_stopped) for sig in gpu_check.STOP_SIGNALS}
    try:
        yield gpu_check
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask, "run() left the stop signals blocked"
        assert not signal.sigpending() & set(gpu_check.STOP_SIGNALS), "a stop was left pending"
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_this_thread() -> None:
    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)


def test_a_stop_while_a_run_starts_kills_and_reaps_it_and_records_it(tmp_path, monkeypatch, gpu_check_stopping):
    """The stop signals are blocked while the run is started; a SIGTERM that comes then is raised once they are let
    in again, which must be where the run is killed (and reaped), not before."""
    gpu_check, started, real_popen = gpu_check_stopping, [], subprocess.Popen

    def popen_then_stop(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        stop_this_thread()  # blocked: pending until run() lets it in
        return started[-1]

    monkeypatch.setattr(gpu_check.subprocess, "Popen", popen_then_stop)
    log, begun = tmp_path / "start.log", time.perf_counter()
    with pytest.raises(gpu_check.Stopped) as stopped:
        gpu_check.run("start", [sys.executable, "-c", "import time; time.sleep(600)", str(tmp_path)],
                      tmp_path / "run", log, timeout=60)
    assert time.perf_counter() - begun < 30
    assert stopped.value.signum == signal.SIGTERM and stopped.value.row is not None
    assert stopped.value.row["name"] == "start" and stopped.value.row["error"] == "stopped by signal SIGTERM"
    assert len(started) == 1 and started[0].returncode == -signal.SIGKILL  # killed and reaped (no zombie)
    assert_no_process_left(str(tmp_path))
    assert "== start: stopped by signal SIGTERM" in log.read_text()


def test_a_stop_while_a_run_is_killed_lets_the_kill_finish(tmp_path, monkeypatch, gpu_check_stopping):
    """A SIGTERM in the middle of kill_tree (after its SIGSTOP, during its search of /proc) must not leave the tree
    frozen: it is raised once the tree is killed, with the timed-out run's row."""
    gpu_check = gpu_check_stopping
    real_descendants = gpu_check.descendants
    worker_pid = tmp_path / "worker.pid"
    launcher = ("import subprocess, sys, time; "
                f"w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', {str(tmp_path)!r}], "
                "start_new_session=True); "
                f"open({str(worker_pid)!r}, 'w').write(str(w.pid)); time.sleep(600)")

    def descendants_then_stop(pid):
        stop_this_thread()
        return real_descendants(pid)

    monkeypatch.setattr(gpu_check, "descendants", descendants_then_stop)
    with pytest.raises(gpu_check.Stopped) as stopped:
        gpu_check.run("kill", [sys.executable, "-c", launcher, str(tmp_path)], tmp_path / "run", tmp_path / "kill.log",
                      timeout=3)
    assert worker_pid.is_file(), "the launcher had not started its worker: the check did not check"
    assert stopped.value.row["error"] == "timed out after 3 s"
    assert_no_process_left(str(tmp_path))


def test_a_stop_after_a_run_keeps_its_row(tmp_path, monkeypatch, gpu_check_stopping):
    """A SIGTERM during the bookkeeping of a finished run (the log's trim here) is raised with the run's full row."""
    gpu_check = gpu_check_stopping
    real_trim_log = gpu_check.trim_log
    run_dir = tmp_path / "run"
    writer = ("import json, os, sys; os.makedirs(sys.argv[1]); "
              "json.dump({'steps': 2, 'step_time_s_mean': 0.5}, open(os.path.join(sys.argv[1], 'summary.json'), 'w'))")

    def trim_log_then_stop(path):
        stop_this_thread()
        real_trim_log(path)

    monkeypatch.setattr(gpu_check, "trim_log", trim_log_then_stop)
    with pytest.raises(gpu_check.Stopped) as stopped:
        gpu_check.run("done", [sys.executable, "-c", writer, str(run_dir)], run_dir, tmp_path / "done.log", timeout=60)
    row = stopped.value.row
    assert "error" not in row and row["steps"] == 2 and row["step_time_s_mean"] == 0.5


def test_timed_out_runs_are_recorded_and_the_report_written(tmp_path):
    """Also: the --fsdp runs go last, whatever the order --only gives (a --deadline cuts them first)."""
    out, work = tmp_path / "out", tmp_path / "work"
    process = subprocess.run([sys.executable, SCRIPT, "--size", "tiny", "--device", "cpu", "--out", str(out),
                              "--work-dir", str(work), "--only", "prm-fsdp,grpo", "--timeout", "3"],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert process.returncode == 1, process.stdout[-3000:] + process.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert [(r["name"], r["error"]) for r in report["results"]] == [("grpo", "timed out after 3 s"),
                                                                     ("prm-fsdp", "timed out after 3 s")]
    assert "| prm-fsdp | timed out after 3 s |" in (out / "gpu_check.md").read_text()
    assert_small_outputs(out, ["prm-fsdp", "grpo"])
    assert_no_process_left(str(tmp_path))


def test_the_report_is_on_disk_after_each_run(tmp_path):
    """Polled while the second run goes on, then the script is stopped (SIGTERM, as a time limit would): the first
    run's results were already written, and the stop kills the run in progress and records it."""
    out, work = tmp_path / "out", tmp_path / "work"
    process = subprocess.Popen([sys.executable, SCRIPT, "--size", "tiny", "--device", "cpu", "--out", str(out),
                                "--work-dir", str(work), "--only", "prm,grpo"], cwd=REPO_ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, results, grpo_log = time.monotonic() + 240, [], out / "grpo.log"
        # until the first run is reported and the second has started (its log has more than the command line)
        while time.monotonic() < deadline and process.poll() is None and not (
                results and grpo_log.is_file() and len(grpo_log.read_text().splitlines()) > 1):
            time.sleep(0.2)
            try:
                results = json.loads((out / "gpu_check.json").read_text())["results"]
            except (OSError, ValueError):
                results = []
        assert process.poll() is None, "the script ended before it could be stopped: " + process.stdout.read()[-3000:]
        assert [r["name"] for r in results] == ["prm"] and results[0]["steps"] == 4
        assert json.loads((out / "gpu_check.json").read_text())["pending"] == ["grpo"]
        markdown = (out / "gpu_check.md").read_text()
        assert "| prm | 4 |" in markdown and "| grpo | not run (yet) |" in markdown
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signal.SIGTERM, output[-3000:]
    rows = json.loads((out / "gpu_check.json").read_text())["results"]
    assert [r["name"] for r in rows] == ["prm", "grpo"] and rows[1]["error"] == "stopped by signal SIGTERM"
    assert "| grpo | stopped by signal SIGTERM |" in (out / "gpu_check.md").read_text()
    assert_no_process_left(str(tmp_path))


def test_without_a_gpu_the_default_device_is_refused_before_any_work(tmp_path):
    """--device cuda (the default) where torch sees no GPU: one line and exit 2, before the 0.5B model is built
    (it used to build it, 943 MB, then fail each of the five runs in turn)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    process = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / "out"), "--work-dir",
                              str(tmp_path / "work")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert process.returncode == 2 and "--device cuda: this torch" in process.stderr and "sees no GPU" in process.stderr
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()
