"""grpo.py end to end on CPU: tiny runs of its command line and of train(Args), checked for what they learn, log,
save, resume and refuse."""

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import tyro
from safetensors.torch import load_file

import grpo
import prm
from conftest import REPO_ROOT, made_dir, run_in_process, run_script_main

QUICK = ["--total-steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--eval-every", "0"]
ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
STEP_KEYS = {
    "reward",
    "reward_std",
    "accuracy",
    "reward_answer",
    "reward_format",
    "frac_zero_std_groups",
    "loss",
    "grad_norm",
    "ratio_mean",
    "clip_frac_low",
    "clip_frac_high",
    "pg_loss",
    "kl_mean",
    "entropy",
    "completion_length",
    "truncated_frac",
    "logp_gap_mean",
    "generated_tokens",
    "trained_tokens",
    "generation_time_s",
    "reward_time_s",
    "reference_time_s",
    "update_time_s",
    "step_time_s",
}
SUMMARY_KEYS = {
    "steps",
    "total_time_s",
    "step_time_s_mean",
    "generation_time_s",
    "reward_time_s",
    "reference_time_s",
    "update_time_s",
    "generated_tokens_per_s",
    "trained_tokens_per_s",
    "peak_memory_mb",
    "mfu",
    "eval_accuracy_start",
    "eval_accuracy_end",
}
RESUME_FLAGS = {
    "full": ["--total-steps", "4", "--save-every", "2", "--scale-rewards", "batch"],
    "lora": ["--total-steps", "4", "--save-every", "2", "--lora-r", "8", "--learning-rate", "1e-2"],
}
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}({{ message['content'] }}){% endfor %}{% if add_generation_prompt %}={% endif %}"
)


def cli(out, *extra: str) -> list[str]:
    """--output-dir OUT, QUICK with extra's flags replacing its own, then extra's others; a 4-row held-out set (the
    built-in 200 rows would cost more than the steps)."""
    pairs, extra = {"--output-dir": str(out)}, ["--eval-data-path", str(EVAL_ROWS), *extra]
    for tokens in (QUICK, extra):
        i = 0
        while i < len(tokens):
            takes_value = i + 1 < len(tokens) and not tokens[i + 1].startswith("--")
            pairs[tokens[i]] = tokens[i + 1] if takes_value else None
            i += 2 if takes_value else 1
    return [t for k, v in pairs.items() for t in ([k] if v is None else [k, v])]


def run(out, *extra: str, rc: int = 0):
    process = run_in_process(grpo, cli(out, *extra), timeout=600)
    assert process.returncode == rc, f"rc {process.returncode}\n{process.stdout[-2000:]}\n{process.stderr[-3000:]}"
    return process


def train(out, *extra: str) -> dict:
    """grpo.train in this process, for runs with something patched."""
    return grpo.train(tyro.cli(grpo.Args, args=cli(out, *extra)))


def steps(out) -> list[dict]:
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "loss" in row]


def weights(path) -> dict:
    return {k: v for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(f).items()}


def assert_same_rows(a: list[dict], b: list[dict], tol: float = 1e-5, keys=None) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in keys or x:
            if key.endswith("_time_s"):
                continue
            if x[key] is None or y[key] is None or tol == 0:
                assert x[key] == y[key], (x["step"], key)
            else:
                assert math.isclose(x[key], y[key], rel_tol=tol, abs_tol=tol), (x["step"], key, x[key], y[key])


def assert_same_weights(a, b, tol: float = 1e-5) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and wa
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], atol=tol, rtol=tol if tol else 0, msg=key)


def kill_tree(pid: int) -> None:
    """SIGKILL pid and its descendants: torchrun puts its workers in sessions of their own."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kill_tree(int(stat.parent.name))
        except (OSError, ValueError):
            pass
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def torchrun(*args: str, timeout: int = 420) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        process.communicate()
        pytest.fail(f"torchrun {' '.join(args[:3])} ran past {timeout} s")
    assert process.returncode == 0, stderr[-4000:]


@pytest.fixture(scope="module", autouse=True)
def eval_rows(tmp_path_factory):
    global EVAL_ROWS
    EVAL_ROWS = tmp_path_factory.mktemp("data") / "eval.jsonl"
    EVAL_ROWS.write_text(
        "".join(
            json.dumps({"prompt": f"({n}+7)%10=", "answer": str((n + 7) % 10)}) + "\n" for n in (101, 202, 303, 404)
        )
    )


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, eval_rows):
    """QUICK with the default flags otherwise (dapo, one micro-batch, prompts shared)."""
    out = tmp_path_factory.mktemp("base") / "run"
    run(out)
    return out


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory, eval_rows):
    """4 steps with checkpoint-2 and checkpoint-4, full fine-tuning or LoRA, made once each."""
    made = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = tmp_path_factory.mktemp(kind) / "run"
            run(made[kind], *RESUME_FLAGS[kind])
        return made[kind]

    return get


@pytest.mark.slow
def test_default_task_learns(tmp_path):
    out = tmp_path / "run"
    process = run_in_process(grpo, ["--output-dir", str(out), "--eval-every", "0"], timeout=1800)  # the default run
    assert process.returncode == 0, process.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary.keys() >= SUMMARY_KEYS and summary["mfu"] is None and summary["steps"] == grpo.Args.total_steps
    assert summary["eval_accuracy_start"] <= 0.3 and summary["eval_accuracy_end"] >= 0.9, summary
    rows = steps(out)
    assert len(rows) == grpo.Args.total_steps and all(row.keys() >= STEP_KEYS for row in rows)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_micro_batches_do_not_change_the_run(tmp_path, base_run, loss_type):
    whole = base_run if loss_type == "dapo" else tmp_path / "whole"
    if loss_type != "dapo":
        run(whole, "--loss-type", loss_type)
    run(tmp_path / "split", "--loss-type", loss_type, "--micro-batch-size", "4")
    assert_same_rows(steps(whole), steps(tmp_path / "split"), keys=["loss", "grad_norm", "kl_mean"])
    assert_same_weights(whole / "final", tmp_path / "split" / "final")


@pytest.mark.parametrize("variant", ["share_min_positions", "gradient_checkpointing"])
def test_prompt_sharing_and_checkpointing_do_not_change_the_run(tmp_path, base_run, monkeypatch, variant):
    if variant == "gradient_checkpointing":
        runs = [base_run, tmp_path / "checkpointed"]
        run(runs[1], "--gradient-checkpointing")
    else:  # micro-batches of one group: a prompt is shared by 4 rows, always or never
        runs = [tmp_path / "always", tmp_path / "never"]
        for out, positions in zip(runs, (0, 10**9)):
            monkeypatch.setattr(grpo, "SHARE_MIN_POSITIONS", positions)
            train(out, "--micro-batch-size", "4")
    assert_same_rows(steps(runs[0]), steps(runs[1]))
    assert_same_weights(runs[0] / "final", runs[1] / "final")


@pytest.mark.parametrize("lora", [False, True])
def test_reference_is_the_initial_policy(tmp_path, lora):
    run(tmp_path / "run", "--kl-coef", "0.1", *(["--lora-r", "8", "--learning-rate", "1e-2"] if lora else []))
    first, second = steps(tmp_path / "run")
    assert abs(first["kl_mean"]) < 1e-6 and second["kl_mean"] > 1e-6


def test_iterations_and_minibatches_see_the_old_policy(tmp_path):
    run(
        tmp_path / "run", "--num-iterations", "2", "--num-minibatches", "2", "--learning-rate", "1e-2", "--kl-coef", "0"
    )
    for row in steps(tmp_path / "run"):
        assert "kl_mean" not in row  # no reference at --kl-coef 0
        assert abs(row["ratio_mean"] - 1) > 1e-4 or row["clip_frac_low"] + row["clip_frac_high"] > 0, row
        assert row["logp_gap_mean"] < 1e-5, row


@pytest.mark.parametrize("max_new_tokens", ["1", "2"])
def test_mask_truncated_completions(tmp_path, base_run, max_new_tokens):
    for row in steps(base_run):
        assert row["trained_tokens"] == row["generated_tokens"]
    run(tmp_path / "run", "--mask-truncated-completions", "--max-new-tokens", max_new_tokens, "--group-size", "8")
    rows = steps(tmp_path / "run")
    for row in rows:  # a truncated completion has max_new_tokens tokens, none of them trained
        truncated_tokens = round(row["truncated_frac"] * 32) * int(max_new_tokens)  # 4 prompts x 8
        assert row["trained_tokens"] == row["generated_tokens"] - truncated_tokens
    assert any(0 < row["trained_tokens"] < row["generated_tokens"] for row in rows)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_resume_is_exact(tmp_path, saved_runs, kind):
    out = tmp_path / "run"
    shutil.copytree(saved_runs(kind), out)
    for name in ("checkpoint-4", "final"):  # as a crash after step 2 leaves it
        shutil.rmtree(out / name)
    (out / "summary.json").unlink()
    run(out, *RESUME_FLAGS[kind], "--resume-from", "latest")
    assert_same_rows(steps(saved_runs(kind)), steps(out), tol=0)
    assert_same_weights(saved_runs(kind) / "final", out / "final", tol=0)


def test_sigterm_checkpoints_and_resume_finishes(tmp_path):
    out = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "grpo.py", *cli(out, "--total-steps", "200")],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        for line in process.stdout:
            if line.startswith("step 1 |"):
                process.send_signal(signal.SIGTERM)
                break
        _, stderr = process.communicate(timeout=300)
    finally:
        kill_tree(process.pid)
    assert process.returncode == 143, stderr[-3000:]
    (checkpoint,) = out.glob("checkpoint-*")
    step = int(checkpoint.name.split("-")[1])
    assert (out / f"checkpoint-{step}" / "trainer_state.pt").is_file() and not (out / "final").exists()
    run(out, "--total-steps", str(step + 1), "--resume-from", "latest")
    assert (out / "final" / "model.safetensors").is_file() and len(steps(out)) == step + 1


def test_saved_model_loads_and_runs_with_a_chat_template(tmp_path, base_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = (auto.from_pretrained(base_run / "final") for auto in (AutoModelForCausalLM, AutoTokenizer))
    loaded = model.state_dict()
    for key, value in weights(base_run / "final").items():
        torch.testing.assert_close(loaded[key], value)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    model.save_pretrained(tmp_path / "chat")
    tokenizer.save_pretrained(tmp_path / "chat")
    rows = [{"prompt": f"{n}+7", "answer": str(n + 7)} for n in range(10)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = ["--model", str(tmp_path / "chat"), "--data-path", str(tmp_path / "rows.jsonl"), "--system-prompt", "9-9"]
    run(tmp_path / "run", *flags)
    args = tyro.cli(grpo.Args, args=cli(tmp_path / "x", *flags))
    ids = grpo.encode_prompts(AutoTokenizer.from_pretrained(tmp_path / "chat"), rows[3:4], args)[0]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "(9-9)(3+7)="


@pytest.fixture(scope="module")
def tiny_prm(tmp_path_factory):
    out = tmp_path_factory.mktemp("prm") / "run"
    process = run_in_process(
        prm,
        [
            "--output-dir",
            str(out),
            "--total-steps",
            "2",
            "--batch-size",
            "4",
            "--eval-every",
            "0",
            "--num-eval-rows",
            "8",
            "--num-val-rows",
            "8",
            "--warmup-steps",
            "0",
        ],
        timeout=600,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    return out / "final"


@pytest.mark.parametrize("aggregate, weight", [("prod", "1"), ("last", "0")])  # one-step completions: all alike
def test_prm_reward(tmp_path, tiny_prm, aggregate, weight):
    flags = ["--prm-path", str(tiny_prm), "--prm-aggregate", aggregate, "--prm-reward-weight", weight]
    run(tmp_path / "run", *flags, "--total-steps", "1")
    (row,) = steps(tmp_path / "run")
    assert 0 <= row["reward_prm"] <= 1
    answer_and_format = row["reward_answer"] + 0.1 * row["reward_format"]
    assert row["reward"] == pytest.approx(answer_and_format + float(weight) * row["reward_prm"], abs=1e-6)


def test_torchrun_matches_one_process(tmp_path, saved_runs):
    torchrun("grpo.py", *cli(tmp_path / "ddp", *RESUME_FLAGS["full"]))
    assert_same_rows(steps(saved_runs("full")), steps(tmp_path / "ddp"))
    assert_same_weights(saved_runs("full") / "final", tmp_path / "ddp" / "final")


def test_fsdp_on_cpu_matches_one_process_and_resumes(tmp_path, saved_runs):
    out = tmp_path / "fsdp"
    torchrun("grpo.py", "--fsdp", *cli(out, *RESUME_FLAGS["full"], "--total-steps", "2"))
    torchrun("grpo.py", "--fsdp", *cli(out, *RESUME_FLAGS["full"], "--resume-from", "latest"))
    assert_same_rows(steps(saved_runs("full")), steps(out), tol=1e-4)
    assert_same_weights(saved_runs("full") / "final", out / "final", tol=1e-4)


BAD_ROWS = {
    "not_json": '{"prompt": "1", "answer": "1"}\nnot json\n',
    "question": '{"question": "1", "answer": "1"}\n',
    "list_answer": '{"prompt": "1", "answer": [1]}\n',
    "empty": "\n",
}
BAD_INPUTS = [  # (case, flags (DATA: a file of BAD_ROWS[case]; RUN: a directory holding a run), in the message)
    ("missing_file", ["--data-path", "no/such.jsonl"], "no/such.jsonl"),
    ("not_json", ["--data-path", "DATA"], "data.jsonl:2"),
    ("question", ["--data-path", "DATA"], 'rename it to "prompt"'),
    ("list_answer", ["--data-path", "DATA"], '"answer"'),
    ("empty", ["--data-path", "DATA"], "no rows"),
    ("long_prompt", ["--max-prompt-length", "5"], "--max-prompt-length 5"),
    ("model", ["--model", "./does/not/exist"], "./does/not/exist"),
    ("model_no_dot", ["--model", "runs/no/such"], "--model runs/no/such does not exist"),
    ("run_exists", ["--output-dir", "RUN"], "already holds a run"),
    ("max_new_tokens", ["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    ("no_minibatches", ["--num-minibatches", "0"], "--num-minibatches must be at least 1"),
    ("no_prompts", ["--prompts-per-step", "0"], "--prompts-per-step must be at least 1"),
    ("no_rounds", ["--dynamic-sampling", "--max-sampling-rounds", "0"], "--max-sampling-rounds must be at least 1"),
    ("group_size", ["--group-size", "1"], "--group-size"),
    ("clip", ["--clip-eps-low", "1.5"], "--clip-eps-low"),
    ("learning_rate", ["--learning-rate", "0"], "--learning-rate"),
    ("minibatches", ["--prompts-per-step", "3", "--num-minibatches", "2"], "--prompts-per-step 3"),
    ("micro_batch", ["--micro-batch-size", "5"], "--micro-batch-size 5"),
    ("fsdp", ["--fsdp"], "--fsdp"),
    ("resume_empty", ["--resume-from", "latest"], "--resume-from latest"),
    ("resume_changed", ["--output-dir", "SAVED", "--resume-from", "latest", "--group-size", "8"], "--group-size 4"),
]


@pytest.mark.parametrize("case, flags, message", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_a_one_line_error(tmp_path, capsys, monkeypatch, saved_runs, case, flags, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "data.jsonl").write_text(BAD_ROWS.get(case, ""))
    places = {
        "DATA": str(tmp_path / "data.jsonl"),
        "RUN": made_dir(tmp_path / "old", "metrics.jsonl", "checkpoint-2/args.json"),
        "SAVED": str(saved_runs("full")) if case == "resume_changed" else "",
    }
    code, err = run_script_main(grpo.main, "grpo.py", cli(tmp_path / "out", *[places.get(f, f) for f in flags]), capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0] and "Traceback" not in err, err[-2000:]


def test_reward_that_raises_or_is_nan_names_the_completion():
    def raises(completion, answer):
        raise ValueError("boom")

    for bad, says in ((raises, "raised ValueError"), (lambda completion, answer: math.nan, "is nan")):

        def reward(completion, answer, bad=bad):
            return bad(completion, answer) if completion == "12" else 1.0

        with pytest.raises(grpo.UserError, match=rf"{says}.*'12'"):
            grpo.compute_rewards(["p", "p"], ["3", "12"], ["3", "3"], [("answer", reward, 1.0)])


def test_non_finite_loss_skips_updates_then_stops(tmp_path, monkeypatch, capsys):
    original = grpo.grpo_loss

    def nan_loss(*args, **kwargs):
        loss, stats = original(*args, **kwargs)
        return loss * math.nan, stats

    monkeypatch.setattr(grpo, "grpo_loss", nan_loss)
    summary = train(tmp_path / "skipped")  # 2 steps of one update each: under the 3 in a row that stop a run
    assert summary["skipped_updates"] == 2 and capsys.readouterr().err.count("update skipped") == 2
    train(tmp_path / "initial", "--total-steps", "0")
    assert_same_weights(tmp_path / "initial" / "final", tmp_path / "skipped" / "final", tol=0)  # never moved
    with pytest.raises(grpo.UserError, match="3 updates in a row"):
        train(tmp_path / "stopped", "--total-steps", "5")


def test_track_writes_a_wandb_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    train(tmp_path / "run", "--track", "--total-steps", "1")
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_completions_are_logged_and_a_held_out_sample_printed(tmp_path):
    out = tmp_path / "run"
    process = run(out, "--log-completions-every", "1", "--total-steps", "2")
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1] * 4 + [2] * 4  # the first completion of each of the 4 groups
    keys = {"step", "prompt", "completion", "reward", "reward_answer", "reward_format", "advantage"}
    assert all(row.keys() == keys for row in rows)
    assert rows[0]["prompt"].endswith("%10=") and isinstance(rows[0]["completion"], str)
    assert process.stdout.count("held-out sample: '(101+7)%10=' -> ") == 2  # at the start and the end
    assert f"output directory: {out}" in process.stdout


def test_warnings_name_what_keeps_a_run_from_learning(tmp_path):
    """Letters the tiny tokenizer cannot spell, answers that need 2 tokens when 1 is allowed, no reward at all."""
    rows = [{"prompt": f"abc {n}", "answer": str(10 + n)} for n in range(8)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = ["--data-path", str(tmp_path / "data.jsonl"), "--max-new-tokens", "1", "--format-reward-weight", "0"]
    stderr = run(tmp_path / "run", *flags, "--total-steps", "7").stderr
    assert stderr.count("8 of 8 prompts hold the unknown token <unk>") == 1
    assert stderr.count("most completions were cut at --max-new-tokens 1, none with a right answer") == 1
    assert stderr.count("every group's completions got equal rewards") == 1
    quiet = run(tmp_path / "quiet", "--total-steps", "7", "--prompts-per-step", "8", "--group-size", "16").stderr
    assert "warning" not in quiet  # the built-in task (whose answers fill --max-new-tokens 2): none of them


def test_a_resume_may_change_only_the_runs_length_and_logging(tmp_path, saved_runs):
    out = tmp_path / "run"
    shutil.copytree(saved_runs("full"), out)
    changed = run(out, *RESUME_FLAGS["full"], "--resume-from", "latest", "--learning-rate", "1e-3", rc=2).stderr
    assert "--learning-rate 0.0003 there, 0.001 here" in changed
    finished = run(out, *RESUME_FLAGS["full"], "--resume-from", "latest", "--eval-every", "3")  # nothing to do
    assert "the run finished at step 4" in finished.stdout
    assert (out / "summary.json").read_text() == (saved_runs("full") / "summary.json").read_text()
    assert (out / "metrics.jsonl").read_text() == (saved_runs("full") / "metrics.jsonl").read_text()
    run(out, *RESUME_FLAGS["full"], "--resume-from", "latest", "--total-steps", "6")  # extends it from checkpoint-4
    assert [row["step"] for row in steps(out)] == [1, 2, 3, 4, 5, 6]
    assert json.loads((out / "summary.json").read_text())["steps"] == 6
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]


def test_overwrite_removes_the_old_run_only_once_every_check_passed(tmp_path, base_run):
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    run(out, "--overwrite", "--data-path", str(tmp_path / "no-such.jsonl"), rc=2)  # a typo: the old run stays
    assert (out / "final").is_dir() and (out / "summary.json").is_file()
    run(out, "--overwrite", "--total-steps", "1")
    assert len(steps(out)) == 1


def test_what_a_crash_leaves_does_not_block_a_new_run(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    (out / "completions.jsonl").write_text('{"step": 9, "prompt": "stale"}\n')
    run(out, "--log-completions-every", "1", "--total-steps", "1")
    assert all(json.loads(line)["step"] == 1 for line in (out / "completions.jsonl").read_text().splitlines())


def test_learning_rate_schedule_weight_decay_and_kept_checkpoints(tmp_path, base_run):
    flags = ["--warmup-steps", "2", "--lr-schedule", "cosine", "--total-steps", "4", "--save-every", "1"]
    run(tmp_path / "run", *flags, "--weight-decay", "0.5")
    lr = grpo.Args.learning_rate
    assert [row["learning_rate"] for row in steps(tmp_path / "run")] == pytest.approx([lr / 2, lr, lr, lr / 2])
    assert sorted(path.name for path in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    run(tmp_path / "no_decay", *flags, "--keep-checkpoints", "0")
    assert len(list((tmp_path / "no_decay").glob("checkpoint-*"))) == 4
    decayed, kept = weights(tmp_path / "run" / "final"), weights(tmp_path / "no_decay" / "final")
    assert sum(w.norm() ** 2 for w in decayed.values()) < sum(w.norm() ** 2 for w in kept.values())


def test_ctrl_c_while_starting_is_one_line(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(grpo, "build_policy", interrupted)
    code, err = run_script_main(grpo.main, "grpo.py", cli(tmp_path / "run"), capsys)
    assert code == 130 and err.strip() == "interrupted"


def test_torchrun_error_is_one_line(tmp_path):
    process = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "grpo.py"]
        + cli(tmp_path / "run", "--max-new-tokens", "0"),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    output = process.stdout + process.stderr
    assert process.returncode != 0 and output.count("error: --max-new-tokens must be at least 1") == 1, output[-3000:]
    assert "Traceback" not in output.split("error: --max-new-tokens")[0]


def test_dynamic_sampling_trains_on_groups_with_signal_and_resumes_exactly(tmp_path):
    """Answer reward only: most groups of 4 early completions are all wrong, equal rewards, no signal."""
    flags = ["--dynamic-sampling", "--max-sampling-rounds", "8", "--format-reward-weight", "0", "--total-steps", "4"]
    out = tmp_path / "run"
    run(out, *flags, "--save-every", "2")
    rows = steps(out)
    assert any(row["sampling_rounds"] > 1 for row in rows)
    for row in rows:
        assert row["prompts_consumed"] == 4 * row["sampling_rounds"]
        rounds = row["sampling_rounds"]
        if rounds < 8:  # filled before running out of rounds: every group has signal, the others were dropped
            assert row["frac_zero_std_groups"] == 0 and 4 * (rounds - 1) - 3 <= row["groups_dropped"] <= 4 * rounds - 4
    run(tmp_path / "plain", *flags[3:])
    plain = steps(tmp_path / "plain")
    assert sum(row["frac_zero_std_groups"] for row in plain) > sum(row["frac_zero_std_groups"] for row in rows)
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    for name in ("checkpoint-4", "final"):  # as a crash after step 2 leaves it
        shutil.rmtree(resumed / name)
    (resumed / "summary.json").unlink()
    run(resumed, *flags, "--save-every", "2", "--resume-from", "latest")
    assert_same_rows(rows, steps(resumed), tol=0)
    torchrun("grpo.py", *cli(tmp_path / "ddp", *flags, "--total-steps", "2"))  # each process fills its own share
    assert len(steps(tmp_path / "ddp")) == 2


def test_evaluation_with_samples_logs_pass_maj_and_prm_at_k(tmp_path, tiny_prm):
    out = tmp_path / "run"
    run(out, "--eval-num-samples", "8", "--prm-path", str(tiny_prm), "--total-steps", "1")
    summary = json.loads((out / "summary.json").read_text())
    for when in ("start", "end"):
        pass_1, pass_8 = summary[f"eval_pass@1_{when}"], summary[f"eval_pass@8_{when}"]
        assert 0 <= pass_1 <= pass_8 <= 1 and 0 <= summary[f"eval_maj@8_{when}"] <= pass_8
        assert 0 <= summary[f"eval_prm@8_{when}"] <= pass_8
