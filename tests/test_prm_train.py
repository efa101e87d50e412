"""prm.py end to end through its command line: training, saving, scoring, resuming, signals, several processes, and
the one-line errors for bad input."""

import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import prm
from conftest import made_dir, run_in_process, run_script_main

REPO_ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--batch-size", "8", "--num-eval-rows", "40", "--num-val-rows", "20", "--warmup-steps", "2"]


def run_prm(*flags: str, expect_rc: int = 0, timeout: int = 300):
    """`python prm.py FLAGS` in this process, one thread (the tiny model gains nothing from more)."""
    process = run_in_process(prm, [str(flag) for flag in flags], timeout, threads=1)
    output = f"{process.stdout[-3000:]}\n{process.stderr[-3000:]}"
    assert process.returncode == expect_rc, f"rc {process.returncode}\n{output}"
    return process


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def weights(directory: Path) -> dict:
    """Every trained weight a PRM directory holds: backbone or adapter, and head."""
    names = ["reward_head.safetensors"] + [
        n for n in ("model.safetensors", "adapter_model.safetensors") if (directory / n).exists()
    ]
    return {f"{name}:{key}": value for name in names for key, value in load_file(directory / name).items()}


def without_times(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "step_time_s"} for row in rows]


def torchrun(script: str, *flags: str, processes: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(processes),
        script,
        *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    process = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    return process


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One short run shared by the tests that need a trained PRM: 6 steps, evaluated at 0, 3 and 6, checkpoints at
    3 and 6."""
    out = tmp_path_factory.mktemp("trained") / "run"
    run_prm("--output-dir", out, "--total-steps", "6", "--eval-every", "3", "--save-every", "3", *QUICK)
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The reference for several processes: 3 steps of 8 rows in one process, no evaluation."""
    out = tmp_path_factory.mktemp("one") / "run"
    run_prm("--output-dir", out, "--total-steps", "3", "--batch-size", "8", "--num-eval-rows", "0")
    return out


def test_a_run_logs_evaluates_and_saves(trained):
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["tokens_per_s"] > 0 and summary["peak_memory_mb"] > 0
    assert summary["eval_rows"] == 40 and summary["dropped_steps"] == summary["dropped_rows"] == 0
    rows = read_jsonl(trained / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4, 5, 6, 6]  # the start and the end evaluations apart
    assert "eval_auroc" in rows[3] and "eval_auroc" not in rows[2]  # --eval-every 3
    for key in ("eval_step_accuracy", "eval_auroc", "eval_first_error_f1"):
        assert rows[0][key] == summary[f"{key}_start"] and rows[-1][key] == summary[f"{key}_end"]
    assert [row["learning_rate"] for row in rows[1:4]] == pytest.approx([5e-4, 1e-3, 1e-3])  # warm-up of 2 steps
    assert sorted(p.name for p in trained.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-3",
        "checkpoint-6",
    ]
    config = json.loads((trained / "final" / "prm_config.json").read_text())
    assert config == {
        **config,
        "base_model": "tiny",
        "lora": False,
        "step_separator": "\n",
        "max_length": 1024,
        "loss_kind": "bce",
        "dtype": "float32",
        "step": 6,
    }
    final, checkpoint = weights(trained / "final"), weights(trained / "checkpoint-6")  # the same step
    assert final.keys() == checkpoint.keys() and all(torch.equal(final[k], checkpoint[k]) for k in final)


def test_the_default_run_learns_to_check_steps(tmp_path):
    out = tmp_path / "run"
    run_prm("--output-dir", out, "--eval-every", "0", timeout=600)  # the default run, but for the evaluations between
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_auroc_start"] < 0.75 and summary["eval_first_error_f1_start"] < 0.4
    assert summary["eval_auroc_end"] >= 0.95 and summary["eval_first_error_f1_end"] >= 0.8


def held_out_examples(tokenizer, seed=1, num_val=20, num_eval=40):
    _, val, held_out = prm.builtin_task(seed, num_val, num_eval)
    return [prm.encode_rows(tokenizer, rows, "\n", 1024) for rows in (val, held_out)]


def test_a_reloaded_prm_gives_the_scores_of_the_end_of_training(trained):
    model = prm.load_prm(str(trained / "final"), device="cpu")
    assert not model.training and model.config["step_separator"] == "\n" and model.config["max_length"] == 1024
    summary = json.loads((trained / "summary.json").read_text())
    metrics = prm.evaluate(model, *held_out_examples(model.tokenizer), batch_size=7)
    for key, value in metrics.items():  # the threshold is a midpoint of two validation scores: exact or not at all
        assert value == summary[f"{key}_end"], key


def test_the_scoring_command_writes_every_row_with_its_scores(trained, tmp_path):
    rows = [{**prm.make_solution(random.Random(k)), "id": k} for k in range(5)]
    rows.append({"prompt": "start 3\n", "completions": ["3+1=4"]})  # no labels needed
    source, out = write_rows(tmp_path / "rows.jsonl", rows), tmp_path / "scores.jsonl"
    process = run_prm("--prm-path", trained / "final", "--data-path", source, "--scores-output", out)
    assert f"scored {sum(len(r['completions']) for r in rows)} steps of 6 rows" in process.stdout
    written = read_jsonl(out)
    model = prm.load_prm(str(trained / "final"), device="cpu")
    expected = prm.score_steps(model, [r["prompt"] for r in rows], [r["completions"] for r in rows])
    assert [{k: v for k, v in row.items() if k != "scores"} for row in written] == rows
    assert [row["scores"] for row in written] == expected  # (JSON keeps every bit of a float)
    assert all(len(row["scores"]) == len(row["completions"]) for row in written)


def test_resume_from_latest_continues_exactly(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    shutil.rmtree(copy / "checkpoint-6")  # latest is now checkpoint-3
    shutil.rmtree(copy / "final")
    (copy / "summary.json").unlink()  # (a summary of step 6 would say the run had finished)
    run_prm(
        "--output-dir",
        copy,
        "--total-steps",
        "6",
        "--eval-every",
        "3",
        "--save-every",
        "3",
        *QUICK,
        "--resume-from",
        "latest",
    )
    assert without_times(read_jsonl(copy / "metrics.jsonl")) == without_times(read_jsonl(trained / "metrics.jsonl"))
    resumed, uninterrupted = weights(copy / "final"), weights(trained / "final")
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in uninterrupted)
    summary = json.loads((copy / "summary.json").read_text())
    assert summary["eval_auroc_start"] == json.loads((trained / "summary.json").read_text())["eval_auroc_start"]


RESUME_FLAGS = ["--total-steps", "6", "--eval-every", "3", "--save-every", "3", *QUICK, "--resume-from", "latest"]
NO_EVAL = ["--batch-size", "8", "--num-eval-rows", "0"]


def test_a_larger_total_steps_extends_a_finished_run_from_its_last_checkpoint(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    run_prm("--output-dir", copy, *RESUME_FLAGS, "--total-steps", "8")
    rows = read_jsonl(copy / "metrics.jsonl")
    assert rows[:8] == read_jsonl(trained / "metrics.jsonl") and [row["step"] for row in rows[8:]] == [7, 8, 8]
    assert json.loads((copy / "summary.json").read_text())["steps"] == 8
    assert json.loads((copy / "final" / "prm_config.json").read_text())["step"] == 8
    assert sorted(p.name for p in copy.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]  # the last step saves


def test_resuming_a_finished_run_says_so_and_writes_nothing(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    before = {name: (copy / name).read_bytes() for name in ("summary.json", "metrics.jsonl")}
    process = run_prm("--output-dir", copy, *RESUME_FLAGS)
    assert f"{copy}: the run finished at step 6 (with a checkpoint, a larger --total-steps" in process.stdout
    assert {name: (copy / name).read_bytes() for name in before} == before


def test_what_a_crash_leaves_is_no_run(tmp_path):
    out = made_dir(tmp_path / "run", "metrics.jsonl")  # a run that died while starting
    process = run_prm("--output-dir", out, "--total-steps", "1", *NO_EVAL)
    assert f"output directory: {out}\n" in process.stdout
    assert [row["step"] for row in read_jsonl(Path(out, "metrics.jsonl"))] == [1]


def test_overwrite_replaces_a_run(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    run_prm("--output-dir", copy, "--total-steps", "2", *NO_EVAL, "--overwrite")
    assert [row["step"] for row in read_jsonl(copy / "metrics.jsonl")] == [1, 2]
    assert json.loads((copy / "summary.json").read_text())["steps"] == 2 and not list(copy.glob("checkpoint-*"))


@pytest.mark.parametrize("keep, kept", [(1, [3]), (0, [1, 2, 3])])
def test_keep_checkpoints_keeps_the_newest(keep, kept, tmp_path):
    out = tmp_path / "run"
    run_prm("--output-dir", out, "--total-steps", "3", *NO_EVAL, "--save-every", "1", "--keep-checkpoints", keep)
    assert sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")) == kept


def test_a_max_length_that_drops_steps_says_how_many_and_how_many_were_wrong(tmp_path):
    # bos + "start 3\n" is 9 tokens, each step and its newline 6: --max-length 21 keeps two steps of three
    wrong_last = {"prompt": "start 3\n", "completions": ["3+1=4", "4-1=3", "1+1=2"], "labels": [1, 1, 0]}
    right_last = {**wrong_last, "completions": ["3+1=4", "4-1=3", "3-2=1"], "labels": [1, 1, 1]}
    rows = write_rows(tmp_path / "rows.jsonl", [wrong_last] * 4 + [right_last] * 2)
    out = tmp_path / "run"
    process = run_prm("--data-path", rows, "--output-dir", out, "--max-length", "21", "--total-steps", "1", *NO_EVAL)
    warning = "warning: --max-length 21 drops 6 of 18 steps, 4 of them labelled wrong: raise --max-length\n"
    assert warning in process.stderr
    assert json.loads((out / "summary.json").read_text())["dropped_steps"] == 6


def test_a_step_past_the_prms_max_length_scores_null(trained, tmp_path):
    short = tmp_path / "short"
    shutil.copytree(trained / "final", short)
    config = json.loads((short / "prm_config.json").read_text())
    (short / "prm_config.json").write_text(json.dumps({**config, "max_length": 21}))  # two steps of three fit
    rows = write_rows(tmp_path / "rows.jsonl", [{"prompt": "start 3\n", "completions": ["3+1=4", "4-1=3", "3-2=1"]}])
    out = tmp_path / "scores.jsonl"
    run_prm("--prm-path", short, "--data-path", rows, "--scores-output", out)
    (written,) = read_jsonl(out)
    assert written["scores"][2] is None and all(isinstance(score, float) for score in written["scores"][:2])


def test_ctrl_c_while_starting_is_one_line_and_exit_code_130(monkeypatch, capsys, tmp_path):
    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(prm, "load_splits", interrupt)
    code, stderr = run_script_main(prm.main, "prm.py", ["--output-dir", str(tmp_path / "run")], capsys)
    assert code == 130 and stderr == "interrupted\n"


def test_under_torchrun_only_rank_0_prints_the_error(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    assert run_script_main(prm.main, "prm.py", ["--batch-size", "0"], capsys) == (2, "")


def test_sigterm_saves_a_checkpoint_first_and_the_run_resumes_from_it(tmp_path):
    out, original = tmp_path / "run", signal.getsignal(signal.SIGTERM)

    def terminate_once_training():  # (only once prm.py's handler is in place: the default one would end pytest)
        while signal.getsignal(signal.SIGTERM) is original:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_once_training, daemon=True).start()
    process = run_prm(
        "--output-dir",
        out,
        "--total-steps",
        "100000",
        "--batch-size",
        "8",
        "--num-eval-rows",
        "0",
        expect_rc=128 + signal.SIGTERM,
    )
    assert signal.getsignal(signal.SIGTERM) is original and "--resume-from latest" in process.stdout
    (checkpoint,) = [p for p in out.iterdir() if p.name.startswith("checkpoint-")]
    step = int(checkpoint.name.split("-")[1])
    assert step >= 1 and not (out / "final").exists()
    run_prm(
        "--output-dir",
        out,
        "--total-steps",
        step + 1,
        "--batch-size",
        "8",
        "--num-eval-rows",
        "0",
        "--resume-from",
        "latest",
    )
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == list(range(1, step + 2))


def test_lora_saves_an_adapter_and_its_tiny_base_that_reload(tmp_path):
    out = tmp_path / "run"
    run_prm(
        "--output-dir",
        out,
        "--total-steps",
        "4",
        "--eval-every",
        "0",
        *QUICK,
        "--lora-r",
        "4",
        "--lora-target-modules",
        "q_proj,v_proj",
        "--lr-schedule",
        "cosine",
        "--track",
    )
    final = out / "final"
    assert (final / "adapter_model.safetensors").exists() and (final / "base" / "model.safetensors").exists()
    assert not (final / "model.safetensors").exists()
    rates = [row["learning_rate"] for row in read_jsonl(out / "metrics.jsonl") if "learning_rate" in row]
    assert rates == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3 * (1 + math.cos(math.pi / 2)) / 2], abs=1e-12)
    model = prm.load_prm(str(final), device="cpu")
    summary = json.loads((out / "summary.json").read_text())
    assert prm.evaluate(model, *held_out_examples(model.tokenizer), 64)["eval_auroc"] == summary["eval_auroc_end"]


def test_a_saved_prm_is_a_model_to_start_from_through_the_hub_loaders(trained, tmp_path):
    out = tmp_path / "run"
    run_prm("--model", trained / "final", "--output-dir", out, "--total-steps", "2", "--lora-r", "4", *QUICK)
    config = json.loads((out / "final" / "prm_config.json").read_text())
    assert config["lora"] and config["base_model"] == str(trained / "final")  # AutoModel reloads it by that path
    model = prm.load_prm(str(out / "final"), device="cpu")
    assert len(prm.score_steps(model, ["start 3\n"], [["3+1=4", "4+1=5"]])[0]) == 2


@pytest.mark.parametrize("kind", ["bce", "mse"])
def test_soft_labels_are_learned_as_given(kind, tmp_path):
    rows = [{**row, "labels": [0.3] * len(row["labels"])} for row in prm.builtin_task(5, 0, 0, 200)[0]]
    out = tmp_path / "run"
    run_prm(
        "--data-path",
        write_rows(tmp_path / "rows.jsonl", rows),
        "--output-dir",
        out,
        "--loss-kind",
        kind,
        "--total-steps",
        "40",
        "--batch-size",
        "8",
        "--warmup-steps",
        "0",
        "--learning-rate",
        "3e-3",
    )
    model = prm.load_prm(str(out / "final"), device="cpu")
    scored = prm.score_steps(model, [r["prompt"] for r in rows[:20]], [r["completions"] for r in rows[:20]])
    scores = [s for row in scored for s in row]
    assert sum(scores) / len(scores) == pytest.approx(0.3, abs=0.05)


def test_padded_micro_batches_and_gradient_checkpointing_give_the_packed_update(one_process, tmp_path):
    out = tmp_path / "run"
    run_prm(
        "--output-dir",
        out,
        "--total-steps",
        "3",
        "--batch-size",
        "8",
        "--num-eval-rows",
        "0",
        "--micro-batch-size",
        "3",
        "--gradient-checkpointing",
        "--no-pack-rows",
    )
    assert [row["loss"] for row in read_jsonl(out / "metrics.jsonl")] == pytest.approx(
        [row["loss"] for row in read_jsonl(one_process / "metrics.jsonl")], rel=1e-5
    )
    accumulated, whole = weights(out / "final"), weights(one_process / "final")
    for name in whole:
        torch.testing.assert_close(accumulated[name], whole[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("script, flags", [("prm.py", []), ("prm.py", ["--fsdp"])])
def test_two_processes_give_the_update_of_one(script, flags, one_process, tmp_path):
    out = tmp_path / "run"
    args = [*flags, "--output-dir", str(out), "--total-steps", "3", "--batch-size", "8", "--num-eval-rows", "0"]
    torchrun(script, *(args + (["--save-every", "3"] if flags else [])))
    assert [row["loss"] for row in read_jsonl(out / "metrics.jsonl")] == pytest.approx(
        [row["loss"] for row in read_jsonl(one_process / "metrics.jsonl")], rel=1e-5
    )
    two, one = weights(out / "final"), weights(one_process / "final")
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6)
    if flags:  # the sharded checkpoint is gathered whole, optimiser state included
        state = torch.load(out / "checkpoint-3" / "trainer_state.pt", weights_only=True)
        assert state["step"] == 3 and {"head.weight", "head.bias"} <= state["optimizer"]["state"].keys()


def bad_rows(tmp_path: Path, *lines: str) -> list[str]:
    return ["--data-path", str(write_rows(tmp_path / "rows.jsonl", list(lines)))]


def latin1_rows(tmp_path: Path) -> Path:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "café", "completions": ["b"], "labels": [1]}\n'.encode("latin-1"))
    return path


GOOD = '{"prompt": "start 3\\n", "completions": ["3+1=4"], "labels": [true]}'
BAD_INPUTS = {
    "data file missing": (
        lambda tmp, run: ["--data-path", str(tmp / "nope.jsonl")],
        r"data file .*nope.jsonl does "
        "not exist",
    ),
    "not JSON": (lambda tmp, run: bad_rows(tmp, GOOD, '{"prompt": '), r"rows.jsonl:2: not JSON"),
    "field missing": (
        lambda tmp, run: bad_rows(tmp, '{"prompt": "a", "completions": ["b"]}'),
        r'rows.jsonl:1: needs a field "labels"',
    ),
    "wrong type": (
        lambda tmp, run: bad_rows(tmp, '{"prompt": 3, "completions": ["b"], "labels": [1]}'),
        r'rows.jsonl:1: needs a field "prompt" \(str\)',
    ),
    "steps not strings": (
        lambda tmp, run: bad_rows(tmp, '{"prompt": "a", "completions": [1], "labels": [1]}'),
        r'needs a field "completions" \(list of str\)',
    ),
    "lengths differ": (
        lambda tmp, run: bad_rows(tmp, '{"prompt": "a", "completions": ["b"], "labels": [1, 0]}'),
        r"rows.jsonl:1: 2 labels for 1 steps",
    ),
    "label above 1": (lambda tmp, run: bad_rows(tmp, GOOD, GOOD.replace("true", "1.5")), r"rows.jsonl:2: label 1.5"),
    "label NaN": (lambda tmp, run: bad_rows(tmp, GOOD.replace("true", "NaN")), r"rows.jsonl:1: label nan"),
    "empty data set": (lambda tmp, run: bad_rows(tmp, ""), r"rows.jsonl holds no rows"),
    "every row truncated": (lambda tmp, run: ["--max-length", "5"], r"every training row was truncated away"),
    "model path missing": (lambda tmp, run: ["--model", str(tmp / "nowhere")], r"--model .*nowhere does not exist"),
    "output dir holds a run": (lambda tmp, run: ["--output-dir", str(run)], r"already holds a run"),
    "resume flags differ": (
        lambda tmp, run: ["--resume-from", str(run / "checkpoint-3"), *QUICK, "--batch-size", "16"],
        r"the checkpoint's run differs \(--batch-size 8 there, 16 here\)",
    ),
    "resume changes the learning rate": (
        lambda tmp, run: ["--resume-from", str(run / "checkpoint-3"), *QUICK, "--learning-rate", "0.002"],
        r"the checkpoint's run differs \(--learning-rate 0.001 there, 0.002 here\)",
    ),
    "resume without checkpoint": (
        lambda tmp, run: ["--output-dir", str(tmp), "--resume-from", "latest"],
        r"holds no checkpoint \(a run writes them with --save-every N",
    ),
    "batch size 0": (lambda tmp, run: ["--batch-size", "0"], r"--batch-size.* must be > 0"),
    "micro-batch above the batch": (
        lambda tmp, run: ["--batch-size", "4", "--micro-batch-size", "5"],
        r"--micro-batch-size",
    ),
    "negative learning rate": (lambda tmp, run: ["--learning-rate", "-1"], r"--learning-rate .*must be > 0"),
    "fsdp without torchrun": (lambda tmp, run: ["--fsdp"], r"--fsdp .*needs a launch by torchrun"),
    "scoring without rows": (lambda tmp, run: ["--prm-path", str(run / "final")], r"--prm-path scores the rows"),
    "not a prm": (lambda tmp, run: ["--prm-path", str(tmp), *bad_rows(tmp, GOOD)], r"is not a PRM saved by prm.py"),
    "prm path missing": (
        lambda tmp, run: ["--prm-path", str(tmp / "nowhere"), *bad_rows(tmp, GOOD)],
        r"nowhere does not exist",
    ),
    "data file not UTF-8": (
        lambda tmp, run: ["--data-path", str(latin1_rows(tmp))],
        r"cannot read data file .*latin1.jsonl: 'utf-8' codec can't decode",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_code_2(case, trained, tmp_path):
    argv, message = BAD_INPUTS[case]
    process = run_prm(*argv(tmp_path, trained), expect_rc=2)
    lines = process.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), process.stderr
    assert re.search(message, lines[0]), lines[0]
