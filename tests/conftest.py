import contextlib
import io
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

# The scripts live at the repository root and are imported as modules (grpo, prm), not installed.
REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


def run_script_main(main, script: str, argv: list[str], capsys, with_stdout: bool = False):
    """A script's main() in this process, as the command line would run it: (exit code, stderr), or with stdout
    too. Much faster than a subprocess for runs that stop at a bad input."""
    saved = sys.argv
    sys.argv = [script, *argv]
    try:
        main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    finally:
        sys.argv = saved
    captured = capsys.readouterr()
    return (code, captured.out, captured.err) if with_stdout else (code, captured.err)


def made_dir(path: Path, *files: str) -> str:
    """A directory holding these (empty) files: what the scripts' checks look at before anything is loaded."""
    for name in files:
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text("{}")
    return str(path)


class RunTimeout(BaseException):
    """Not an Exception: the scripts catch those (a data file that cannot be read, a reward that fails) and would
    take a time limit for an error of their own, or skip it and run on."""


def run_in_process(module, argv: list[str], timeout: int, threads: int | None = None) -> SimpleNamespace:
    """`python SCRIPT ARGV` as module.main() in this process, WANDB_MODE=disabled: (returncode, stdout, stderr), without
    the 5 s of starting Python and importing torch and transformers again (3.7 s of a 4.3 s run). threads: torch's
    thread count meanwhile, as OMP_NUM_THREADS gives a process. A run past timeout seconds (SIGALRM: the scripts
    handle only SIGINT and SIGTERM) raises RunTimeout. A function of the module that is patched (monkeypatch)
    fails the test: the run would not be the command line's."""
    patched = [name for name, value in vars(module).items() if ORIGINALS[module.__name__].get(name, value) is not value]
    if patched:
        pytest.fail(f"{module.__name__}.{', '.join(patched)} patched: undo it (monkeypatch.context()) before this run")
    stdout, stderr, saved_argv, saved_mode = io.StringIO(), io.StringIO(), sys.argv, os.environ.get("WANDB_MODE")
    saved_threads = torch.get_num_threads()

    def out_of_time(signum, frame):
        raise RunTimeout(f"{module.__name__} {' '.join(argv)} ran past {timeout} s")

    saved_alarm = signal.signal(signal.SIGALRM, out_of_time)
    try:
        sys.argv, os.environ["WANDB_MODE"] = [f"{module.__name__}.py", *argv], "disabled"
        torch.set_num_threads(threads or saved_threads)
        signal.alarm(timeout)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            module.main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, saved_alarm)
        sys.argv = saved_argv
        torch.set_num_threads(saved_threads)
        if saved_mode is None:
            os.environ.pop("WANDB_MODE")
        else:
            os.environ["WANDB_MODE"] = saved_mode
    return SimpleNamespace(returncode=code, stdout=stdout.getvalue(), stderr=stderr.getvalue())


# each script's attributes as imported, before any test patches them (see run_in_process)
ORIGINALS = {name: dict(vars(__import__(name))) for name in ("grpo", "prm")}
