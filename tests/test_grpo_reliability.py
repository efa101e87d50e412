"""grpo.py under stress: bad input, interruption and exact resume, two processes."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import grpo
from conftest import made_dir, run_script_main
from test_grpo_runs import QUICK, REPO_ROOT, read_eval_rows, read_metrics, read_summary, run_grpo, save_tiny

# wall-clock and memory readings differ between any two runs; everything else in a metrics row must not
TIMING_KEYS = {"step_time_s", "generation_time_s", "reward_time_s", "reference_time_s", "update_time_s", "memory_mb"}


def run_main(argv: list[str], capsys, with_stdout: bool = False):
    return run_script_main(grpo.main, "grpo.py", argv, capsys, with_stdout)


def bad_rows_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text(text)
    return str(path)


def latin1_file(tmp_path: Path) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_bytes('{"prompt": "a", "answer": "1"}\n{"prompt": "caf\u00e9", "answer": "1"}\n'.encode("latin-1"))
    return str(path)


def below_a_file(tmp_path: Path) -> str:
    (tmp_path / "a_file").write_text("x")
    return str(tmp_path / "a_file" / "out")


def model_without_tokenizer(tmp_path: Path) -> str:
    """A model directory with its config.json only: the tokenizer is what loading misses first."""
    grpo.build_tiny_model(grpo.build_tiny_tokenizer()).config.save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


BAD_INPUTS = {
    "missing data file": (lambda tmp: ["--data-path", str(tmp / "nope.jsonl")], "does not exist"),
    "invalid json": (lambda tmp: ["--data-path", bad_rows_file(tmp, '{"prompt": "1", "answer": "1"}\n{oops\n')],
                     "rows.jsonl:2: invalid JSON"),
    "missing field": (lambda tmp: ["--data-path", bad_rows_file(tmp, '{"prompt": "1+1="}\n')],
                      'rows.jsonl:1: each row needs a field "answer"'),
    "gsm8k field names": (lambda tmp: ["--data-path", bad_rows_file(tmp, '{"question": "1+1?", "answer": "2"}\n')],
                          'rows.jsonl:1: each row needs a string field "prompt" (it has "question": rename that '
                          'field to "prompt")'),
    "wrong type": (lambda tmp: ["--data-path", bad_rows_file(tmp, '{"prompt": 3, "answer": "1"}\n')],
                   'rows.jsonl:1: each row needs a string field "prompt"'),
    "empty data set": (lambda tmp: ["--data-path", bad_rows_file(tmp, "\n\n")], "holds no rows"),
    "prompt too long": (lambda tmp: ["--max-prompt-length", "4"], "longer than --max-prompt-length 4"),
    "model path missing": (lambda tmp: ["--model", str(tmp / "no-model")], "no-model does not exist (a local path"),
    "no reward": (lambda tmp: ["--answer-reward-weight", "0", "--format-reward-weight", "0"],
                  "every reward weight is 0: give --answer-reward-weight"),
    "a PRM at weight 0": (lambda tmp: ["--prm-path", str(tmp), "--prm-weight", "0"],
                          "--prm-weight 0 turns the PRM reward of --prm-path off: drop --prm-path, or give a weight"),
    "a PRM weight without a PRM": (lambda tmp: ["--prm-weight", "2"],
                                   "--prm-weight: PRM reward settings, but there is no PRM without --prm-path"),
    "an empty PRM separator": (lambda tmp: ["--prm-path", str(tmp), "--prm-step-separator", ""],
                               "--prm-step-separator must not be empty"),
    "no bad step allowed": (lambda tmp: ["--max-bad-steps", "0"], "--max-bad-steps must be at least 1, got 0"),
    "a separator typed as backslash-n": (lambda tmp: ["--prm-step-separator", "\\n\\n"],
                                         "holds a backslash and a letter, not a line break: a shell passes"),
    "a prm.py PRM as the model": (lambda tmp: ["--model", made_dir(tmp / "prm", "prm_config.json", "config.json")],
                                  "is a process reward model saved by prm.py, with no LM head to generate with: "
                                  "give it as --prm-path"),
    "a run's directory as the model": (lambda tmp: ["--model", made_dir(tmp / "run", "final/config.json")],
                                       "holds no config.json (a model saved with save_pretrained has one); its "
                                       "run's model is /"),
    "model directory without config.json": (lambda tmp: ["--model", str(tmp)], "the directory holds no config.json"),
    "model directory without a tokenizer": (
        lambda tmp: ["--model", model_without_tokenizer(tmp)], "the directory has no tokenizer"),
    "boolean answer": (lambda tmp: ["--data-path", bad_rows_file(tmp, '{"prompt": "1", "answer": true}\n')],
                       'rows.jsonl:1: each row needs a field "answer" (a string or a number)'),
    "empty answer": (lambda tmp: ["--data-path", bad_rows_file(tmp, '{"prompt": "1", "answer": " "}\n')],
                     "rows.jsonl:1: the answer is empty"),
    "NaN answer": (lambda tmp: ["--data-path", bad_rows_file(tmp, '{"prompt": "1", "answer": 1}\n'
                                                                  '{"prompt": "2", "answer": NaN}\n')],
                   "rows.jsonl:2: the answer is nan, which no completion can equal"),
    "negative lora rank": (lambda tmp: ["--lora-r", "-1"], "--lora-r must be >= 0"),
    "group of one": (lambda tmp: ["--group-size", "1"], "--group-size must be at least 2"),
    "micro-batch larger than batch": (lambda tmp: ["--micro-batch-size", "1000"], "--micro-batch-size 1000 is larger"),
    "micro-batch larger than a minibatch": (lambda tmp: ["--num-minibatches", "2", "--micro-batch-size", "9"],
                                            "--micro-batch-size 9 is larger than the minibatch of 8 completions"),
    "minibatches of unequal shares": (lambda tmp: ["--num-minibatches", "3"],
                                      "--prompts-per-step 4 must be divisible by --num-minibatches 3"),
    "dr_grpo without a length": (lambda tmp: ["--loss-type", "dr_grpo", "--max-new-tokens", "0"],
                                 "--max-new-tokens must be at least 1"),
    "delta inside the clip range": (lambda tmp: ["--delta", "1.1"], "--delta 1.1 must be above"),
    "negative peak": (lambda tmp: ["--peak-tflops", "-1"], "--peak-tflops must be >= 0"),
    "ratio-weighted k2": (lambda tmp: ["--kl-ratio-weighted", "--kl-estimator", "k2"],
                          "--kl-ratio-weighted weights the KL penalty by the ratio: it needs --kl-coef above 0"),
    "ratio-weighted without KL": (lambda tmp: ["--kl-ratio-weighted", "--kl-coef", "0"], "k2 times the ratio"),
    "resume from nothing": (lambda tmp: ["--resume-from", str(tmp)], "not a checkpoint written by grpo.py"),
    "resume from a missing path": (lambda tmp: ["--resume-from", str(tmp / "run" / "checkpoint-3")],
                                   "checkpoint-3 does not exist: pass a checkpoint-STEP or final directory"),
    "not utf-8": (lambda tmp: ["--data-path", latin1_file(tmp)], "rows.jsonl:2: not UTF-8 text"),
    "data path is a directory": (lambda tmp: ["--data-path", str(tmp)], "is a directory; pass a JSONL file"),
    "prompt too long, named by line": (
        lambda tmp: ["--data-path", bad_rows_file(tmp, '{"prompt": "1", "answer": "1"}\n\n{"prompt": "1+1+1+1", '
                     '"answer": "4"}\n'), "--max-prompt-length", "4"], "rows.jsonl:3: the prompt is 8 tokens"),
    "held-out prompt too long": (
        lambda tmp: ["--eval-data-path", bad_rows_file(tmp, '{"prompt": "(123+7)%10=(1+1)", "answer": "1"}\n'),
                     "--max-prompt-length", "12"], "rows.jsonl:1: the prompt is 17 tokens"),
    "every prompt held out": (lambda tmp: ["--num-eval-prompts", "900"], "leaves none of the built-in task's"),
    "unknown device": (lambda tmp: ["--device", "foo"], "--device 'foo' is not a device"),
    "no checkpoint kept": (lambda tmp: ["--keep-checkpoints", "0"], "--keep-checkpoints must be at least 1"),
    "eval batch of zero": (lambda tmp: ["--eval-batch-size", "0"], "--eval-batch-size must be at least 1"),
    "negative learning rate": (lambda tmp: ["--learning-rate", "-1"], "--learning-rate, --weight-decay"),
    "negative save interval": (lambda tmp: ["--save-every", "-1"], "--save-every must be >= 0"),
    "lora target typo": (lambda tmp: ["--lora-r", "4", "--lora-target-modules", "q_proj,qproj"],
                         "no layer is named qproj; this model's include down_proj"),
    "not a prm": (lambda tmp: ["--prm-path", str(tmp)], "--prm-path: "),
    # values AdamW, the seed or the device would reject later with a traceback, or that would train nothing
    "negative weight decay": (lambda tmp: ["--weight-decay", "-1"], "--weight-decay and --max-grad-norm must be >= 0"),
    "beta of 1.5": (lambda tmp: ["--adam-betas", "1.5", "0.9"], "--adam-betas must be in [0, 1), got (1.5, 0.9)"),
    "negative warm-up": (lambda tmp: ["--warmup-steps", "-1"], "--warmup-steps must be >= 0"),
    "negative seed": (lambda tmp: ["--seed", "-1"], "--seed must be in [0, 2**32), got -1"),
    "seed past 32 bits": (lambda tmp: ["--seed", str(2**32)], "--seed must be in [0, 2**32)"),
    "lora alpha of 0": (lambda tmp: ["--lora-r", "4", "--lora-alpha", "0"], "--lora-alpha must be > 0"),
    "NaN reward weight": (lambda tmp: ["--answer-reward-weight", "nan"],
                          "--answer-reward-weight must be a finite number within float32's range (3.4e38), got nan"),
    # inf and nan parse as numbers: an infinite learning rate made every weight NaN, an infinite temperature
    # uniform log-probs (no gradient)
    "infinite learning rate": (lambda tmp: ["--learning-rate", "inf"], "--learning-rate must be a finite number"),
    "infinite temperature": (lambda tmp: ["--temperature", "inf"],
                             "--temperature must be a finite number within float32's range"),
    "NaN beta": (lambda tmp: ["--adam-betas", "0.9", "nan"], "--adam-betas must be a finite number"),
    # past float32's range: the loss's clamp could not convert the bound (a RuntimeError traceback)
    "clip bound past float32": (lambda tmp: ["--clip-eps-high", "1e300", "--num-iterations", "2"],
                                "--clip-eps-high must be a finite number within float32's range (3.4e38), got 1e+300"),
    "delta past float32": (lambda tmp: ["--delta", "1e39"], "--delta must be a finite number within float32's range"),
    # integers past int64 overflowed in torch; a rank above every layer's failed to allocate (both tracebacks)
    "group size past int64": (lambda tmp: ["--group-size", str(2**64)], "--group-size must be within int64's range"),
    "temperature whose logits overflow": (lambda tmp: ["--temperature", "1e-40"],
                                          "--temperature must be at least 1e-3, got 1e-40"),
    "rank above every layer's": (lambda tmp: ["--lora-r", "1000000"],
                                 "--lora-r 1000000 is above the rank of every weight matrix of the model (at most 128"),
    "meta device": (lambda tmp: ["--device", "meta"], "--device meta: a meta device holds no data to train on"),
    # settings of something the run does not have: they would be ignored unsaid
    "LoRA settings without LoRA": (lambda tmp: ["--lora-alpha", "64", "--lora-target-modules", "q_proj"],
                                   "--lora-alpha and --lora-target-modules: LoRA settings, but --lora-r 0"),
    "PRM settings without a PRM": (lambda tmp: ["--prm-aggregate", "prod"],
                                   "--prm-aggregate: PRM reward settings, but there is no PRM without --prm-path"),
    "KL estimator without KL": (lambda tmp: ["--kl-coef", "0", "--kl-estimator", "k1"],
                                "--kl-estimator k1 with --kl-coef 0: there is no KL penalty to estimate"),
    "lower clip of 1": (lambda tmp: ["--clip-eps-low", "1"], "--clip-eps-low must be in [0, 1)"),
    "negative eval interval": (lambda tmp: ["--eval-every", "-1"], "--eval-every must be >= 0 (0 = only at the start"),
    "no module to adapt": (lambda tmp: ["--lora-r", "2", "--lora-target-modules", ","],
                           "--lora-target-modules ',' names no module"),
    "device this torch has no support for": (lambda tmp: ["--device", "mps"], "--device mps: not usable here"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_clear_line(case, tmp_path, capsys):
    flags, message = BAD_INPUTS[case]
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *QUICK, *flags(tmp_path)], capsys)
    assert code == 2, err
    assert message in err
    assert err.startswith("error: ") and err.count("\n") == 1  # one line, no traceback
    assert not out.exists()  # nothing written


@pytest.mark.parametrize("script", ["grpo", "prm"])
def test_a_separator_with_a_backslash_is_refused_only_as_a_typed_line_break(script):
    """"\\n\\n" typed in bash is a backslash and an n, twice: refused; a LaTeX separator is a separator."""
    import prm

    module, flag = (grpo, "prm_step_separator") if script == "grpo" else (prm, "step_separator")
    other = {"prm_path": "prm"} if script == "grpo" else {}  # (grpo.py refuses PRM settings without a PRM)
    for typed in ("\\n\\n", "\\n", " \\t "):
        with pytest.raises(module.UserError, match="holds a backslash and a letter, not a line break"):
            module.validate_args(module.Args(**{flag: typed}, **other), 1, torch.device("cpu"))
    for separator in ("\n\n", "\\newline", "\\text{Step}", " \\therefore "):
        module.validate_args(module.Args(**{flag: separator}, **other), 1, torch.device("cpu"))


def test_one_gpu_named_for_every_torchrun_process_is_refused(tmp_path, capsys, monkeypatch):
    """torchrun with 2 processes on a machine of 2 GPUs and --device cuda:0: both would take GPU 0, which NCCL
    refuses later with a traceback; a bare cuda gives each process its own."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *QUICK, "--device", "cuda:0"], capsys)
    assert code == 2 and err.startswith("error: --device cuda:0 puts every one of the 2 processes on this machine on")
    assert "use --device cuda (each process takes GPU LOCAL_RANK)" in err and not out.exists()


def test_a_run_without_held_out_prompts_prints_no_evaluation(tmp_path, capsys):
    """--data-path without --eval-data-path holds nothing to evaluate: no 'eval accuracy ... nan' lines, nor
    eval_accuracy columns of nulls in metrics.jsonl."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(f'{{"prompt": "{a}+1=", "answer": "{a + 1}"}}\n' for a in range(8)))
    out_dir = tmp_path / "run"
    code, out, err = run_main([*QUICK, "--data-path", str(data), "--output-dir", str(out_dir), "--eval-every", "1"],
                              capsys, with_stdout=True)
    assert code == 0, err
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert "eval accuracy" not in out and len(step_lines) == 3 and not any("eval_acc" in line for line in step_lines)
    assert not any("eval_accuracy" in row for row in read_metrics(out_dir)) and read_eval_rows(out_dir) == []
    assert read_summary(out_dir)["eval_accuracy_end"] is None  # NaN, written as null
    assert ("note: --eval-every, --num-eval-prompts set the evaluation, but --data-path without --eval-data-path "
            "holds no prompts out to evaluate on") in out


@pytest.mark.parametrize("script", ["grpo", "prm"])
def test_an_output_dir_that_cannot_be_created_is_one_clear_line(script, capsys):
    """/proc takes no new directories or files: the OSError from makedirs or the first log line was a traceback."""
    import prm
    from conftest import run_script_main

    module = grpo if script == "grpo" else prm
    flags = QUICK if script == "grpo" else ["--total-steps", "1", "--num-val-rows", "4", "--num-eval-rows", "0"]
    code, err = run_script_main(module.main, f"{script}.py", ["--output-dir", "/proc/no-such/run", *flags], capsys)
    assert code == 2 and err.endswith("error: --output-dir /proc/no-such/run cannot be created or written to (No such "
                                      "file or directory); choose another --output-dir\n"), err
    # /proc/1 exists but takes no files: found before the run, not as a traceback at its first log line
    code, err = run_script_main(module.main, f"{script}.py", ["--output-dir", "/proc/1", *flags], capsys)
    assert code == 2 and "error: --output-dir /proc/1 cannot be created or written to (" in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("script", ["grpo", "prm"])
def test_a_resume_removes_the_saves_a_killed_run_left_unfinished(script, tmp_path, capsys):
    """A SIGKILL after a scheduler's grace period can cut a stop checkpoint's save short (checkpoint-N.tmp) or a
    deletion (*.old); a stop checkpoint's step is saved again only by chance, so nothing else removes them."""
    import prm

    module = grpo if script == "grpo" else prm
    out = tmp_path / "run"
    flags = ["--output-dir", str(out), "--save-every", "1", "--eval-every", "0", *(
        ["--prompts-per-step", "4", "--group-size", "4", "--num-eval-prompts", "16"] if script == "grpo" else
        ["--batch-size", "8", "--num-val-rows", "20", "--num-eval-rows", "20"])]
    assert run_script_main(module.main, f"{script}.py", [*flags, "--total-steps", "2"], capsys)[0] == 0
    unfinished = ["checkpoint-7.tmp", "checkpoint-1.old", "final.tmp"]
    for name in unfinished:
        shutil.copytree(out / "checkpoint-2", out / name)
    (out / "notes").mkdir()  # not the run's: kept
    (out / "checkpoint-5.tmp.bak").mkdir()
    code, stdout, err = run_script_main(module.main, f"{script}.py", [*flags, "--total-steps", "3", "--resume-from",
                                                                      "latest"], capsys, with_stdout=True)
    assert code == 0, err
    assert f"removed {', '.join(sorted(unfinished))} from {out}: left by a run killed while saving" in stdout
    assert sorted(path.name for path in out.iterdir() if path.is_dir()) == [
        "checkpoint-2", "checkpoint-3", "checkpoint-5.tmp.bak", "final", "notes"]
    # one named by --resume-from is what the run continues (a save between its two renames leaves final.old and
    # final.tmp only, both complete): kept
    shutil.copytree(out / "checkpoint-3", out / "checkpoint-3.tmp")
    code, stdout, err = run_script_main(module.main, f"{script}.py", [*flags, "--total-steps", "4", "--resume-from",
                                                                      str(out / "checkpoint-3.tmp")], capsys,
                                        with_stdout=True)
    assert code == 0 and "removed" not in stdout, err
    assert (out / "checkpoint-3.tmp" / "trainer_state.pt").is_file() and (out / "checkpoint-4").is_dir()


def test_a_lora_adapter_of_a_local_model_names_its_base_by_its_absolute_path(tmp_path, capsys, monkeypatch):
    """peft records the base model as typed: trained with a relative --model, final/ loaded only from the directory
    the run was started in (elsewhere peft asked the hub for it)."""
    from peft import AutoPeftModelForCausalLM

    save_tiny(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    assert run_main(["--output-dir", str(run), *QUICK, "--total-steps", "1", "--num-eval-prompts", "0", "--model",
                     "model", "--lora-r", "4"], capsys)[0] == 0
    config = json.loads((run / "final" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "model")
    monkeypatch.chdir(REPO_ROOT)
    assert AutoPeftModelForCausalLM.from_pretrained(str(run / "final")) is not None
    # the adapter is no model to start a new run from: said so, with the two ways on (it had no config.json)
    code, err = run_main(["--output-dir", str(tmp_path / "next"), *QUICK, "--model", str(run / "final")], capsys)
    assert code == 2 and (f"--model {run / 'final'} is a LoRA adapter (on {tmp_path / 'model'}), not a model to "
                          "start from: continue its run with --resume-from") in err, err


@pytest.mark.parametrize("script", ["grpo", "prm"])
def test_a_resume_names_the_flags_that_differ_from_its_checkpoints_run(script, tmp_path, capsys):
    """Flags outside RESUME_MUST_MATCH may change on a resume (a longer run, another temperature), but not unsaid:
    a changed --max-new-tokens went through without a word, and with it dr_grpo's normaliser."""
    import prm
    from conftest import run_script_main

    module = grpo if script == "grpo" else prm
    flags = ([*QUICK, "--num-eval-prompts", "0"] if script == "grpo" else
             ["--batch-size", "4", "--num-val-rows", "0", "--num-eval-rows", "0", "--eval-every", "0"])
    changed_flag = "temperature" if script == "grpo" else "max_grad_norm"
    main = lambda *more: run_script_main(module.main, f"{script}.py", [*flags, *more], capsys,  # noqa: E731
                                         with_stdout=True)
    run = tmp_path / "run"
    assert main("--output-dir", str(run), "--total-steps", "1", "--save-every", "1")[0] == 0
    code, out, err = main("--output-dir", str(run), "--total-steps", "1", "--save-every", "1", "--resume-from",
                          "latest")
    assert code == 0 and "nothing to do" in out and "note: resuming" not in out, err  # the same flags: no note
    code, out, err = main("--output-dir", str(run), "--total-steps", "2", "--save-every", "1", "--resume-from",
                          "latest", f"--{changed_flag.replace('_', '-')}", "0.5")
    before = getattr(module.Args(), changed_flag)
    assert code == 0 and ("note: resuming with other settings than the checkpoint's run: --total-steps 1 there, 2 "
                          f"here; --{changed_flag.replace('_', '-')} {before!r} there, 0.5 here\n") in out, out


@pytest.mark.parametrize("script", ["grpo", "prm"])
def test_a_lora_base_among_the_files_the_run_replaces_is_refused(script, tmp_path, capsys):
    """--model run/final --lora-r 4 --output-dir run --overwrite: the run deletes final/, and its adapter names
    that directory as its base, so the PRM or policy it saves could never be loaded. Refused before anything is
    touched; a full fine-tuning run (nothing names its starting point) and another output directory are fine."""
    import prm
    from conftest import run_script_main

    module = grpo if script == "grpo" else prm
    flags = ([*QUICK, "--total-steps", "1", "--num-eval-prompts", "0"] if script == "grpo" else
             ["--total-steps", "1", "--batch-size", "4", "--num-val-rows", "0", "--num-eval-rows", "0"])
    run = tmp_path / "run"
    main = lambda *more: run_script_main(module.main, f"{script}.py", [*flags, *more], capsys)  # noqa: E731
    assert main("--output-dir", str(run), "--save-every", "1")[0] == 0
    for base in (run / "final", run / "checkpoint-1"):
        code, err = main("--output-dir", str(run), "--overwrite", "--model", str(base), "--lora-r", "4")
        assert code == 2 and f"--model {base} lies among the files of --output-dir {run}" in err, err
    assert (run / "final").is_dir() and (run / "checkpoint-1").is_dir()
    assert main("--output-dir", str(tmp_path / "other"), "--model", str(run / "final"), "--lora-r", "4")[0] == 0
    assert main("--output-dir", str(run), "--overwrite", "--model", str(run / "final"))[0] == 0


@pytest.mark.parametrize("script", ["grpo", "prm"])
def test_weight_decay_applies_to_matrices_only_and_a_resume_sets_it_from_the_flag(script, tmp_path, capsys):
    """Biases and norm gains are not decayed (as in transformers' Trainer): every 1-D tensor the optimiser steps is
    in a group of weight decay 0, every matrix in one of --weight-decay; a resume with another --weight-decay
    changes the matrices' group only."""
    import prm
    from conftest import run_script_main
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    module = grpo if script == "grpo" else prm
    flags = ([*QUICK, "--num-eval-prompts", "0"] if script == "grpo" else
             ["--batch-size", "4", "--num-val-rows", "0", "--num-eval-rows", "0", "--eval-every", "0"])
    flags = ["--output-dir", str(tmp_path / "run"), *flags, "--save-every", "1"]
    seen = []
    handle = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: seen.append(
        [(group["weight_decay"], {p.ndim >= 2 for p in group["params"]}) for group in optimizer.param_groups]))
    try:
        for more in (["--total-steps", "1", "--weight-decay", "0.5"],
                     ["--total-steps", "2", "--weight-decay", "0.2", "--resume-from", "latest"]):
            code, err = run_script_main(module.main, f"{script}.py", [*flags, *more], capsys)
            assert code == 0, err
    finally:
        handle.remove()
    assert seen == [[(0.5, {True}), (0.0, {False})], [(0.2, {True}), (0.0, {False})]]


@pytest.mark.parametrize("script", ["grpo", "prm"])
def test_a_checkpoint_with_one_optimiser_group_resumes_as_with_two(script, tmp_path, capsys):
    """Checkpoints written before weight decay left vectors out hold one AdamW group, in the parameters' order:
    such a state is laid out in the two groups, each parameter's moments with it, and the resumed run ends with
    the same weights as one resumed from the two-group checkpoint (a load refused it: other number of groups)."""
    import prm
    from conftest import run_script_main
    from safetensors.torch import load_file

    module = grpo if script == "grpo" else prm
    flags = ([*QUICK, "--num-eval-prompts", "0", "--learning-rate", "1e-2"] if script == "grpo" else
             ["--batch-size", "4", "--num-val-rows", "0", "--num-eval-rows", "0", "--learning-rate", "1e-2"])
    main = lambda out, *more: run_script_main(  # noqa: E731
        module.main, f"{script}.py", ["--output-dir", str(out), *flags, "--weight-decay", "0.1", *more], capsys)
    assert main(tmp_path / "run", "--total-steps", "1", "--save-every", "1")[0] == 0
    model = (grpo.build_tiny_model(grpo.build_tiny_tokenizer()) if script == "grpo" else
             prm.build_prm(prm.Args(), torch.float32)[0])
    ndims = [p.ndim for p in model.parameters() if p.requires_grad]
    two_groups = [i for i, n in enumerate(ndims) if n >= 2] + [i for i, n in enumerate(ndims) if n < 2]
    for name in ("two", "one"):
        shutil.copytree(tmp_path / "run" / "checkpoint-1", tmp_path / name / "checkpoint-1")
    state_path = tmp_path / "one" / "checkpoint-1" / "trainer_state.pt"
    state = torch.load(state_path, weights_only=False)
    saved = state["optimizer"]
    assert [len(group["params"]) for group in saved["param_groups"]] == [ndims.count(2), len(ndims) - ndims.count(2)]
    state["optimizer"] = {"state": {two_groups[k]: value for k, value in saved["state"].items()},
                          "param_groups": [{**saved["param_groups"][0], "params": list(range(len(ndims)))}]}
    del state["optimizer"]["param_groups"][0]["decay"]
    torch.save(state, state_path)
    for name in ("two", "one"):
        code, err = main(tmp_path / name, "--total-steps", "3", "--resume-from", "latest")
        assert code == 0, err
    weights = "model.safetensors"
    two, one = (load_file(tmp_path / name / "final" / weights) for name in ("two", "one"))
    assert two.keys() == one.keys() and all(torch.equal(two[key], one[key]) for key in two)


@pytest.mark.parametrize("script", ["grpo", "prm"])
def test_a_run_resumes_with_its_data_file_given_by_another_path(script, tmp_path, capsys, monkeypatch):
    """What a resume checks is the rows' content, not the path they were read from (a relative path refused a
    resume from another directory); other rows are still refused. The same file by another spelling is no change
    worth a note."""
    import prm
    from conftest import run_script_main
    from test_prm import builtin_rows

    module = grpo if script == "grpo" else prm
    rows = ([{"prompt": f"({i}+7)%10=", "answer": str((i + 7) % 10)} for i in range(8)] if script == "grpo"
            else builtin_rows(24))
    for name, chosen in (("data.jsonl", rows), ("copy.jsonl", rows), ("other.jsonl", rows[::-1])):
        (tmp_path / name).write_text("".join(json.dumps(row) + "\n" for row in chosen))
    run = tmp_path / "run"
    flags = ["--output-dir", str(run), "--total-steps", "2", "--save-every", "1", "--eval-every", "0"]
    flags += (["--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "4", "--num-eval-prompts", "0"]
              if script == "grpo" else ["--batch-size", "4", "--num-val-rows", "0"])
    main = lambda *more: run_script_main(module.main, f"{script}.py", [*flags, *more], capsys)  # noqa: E731
    assert main("--data-path", str(tmp_path / "data.jsonl"))[0] == 0
    monkeypatch.chdir(tmp_path)
    code, out, err = run_script_main(module.main, f"{script}.py", [*flags, "--data-path", "data.jsonl",
                                                                   "--resume-from", "latest"], capsys, with_stdout=True)
    assert code == 0 and "note: resuming" not in out, out
    code, err = main("--data-path", str(tmp_path / "copy.jsonl"), "--resume-from", str(run / "checkpoint-1"))
    assert code == 0, err
    code, err = main("--data-path", str(tmp_path / "other.jsonl"), "--resume-from", str(run / "checkpoint-1"))
    assert code == 2 and "--resume-from" in err


def test_minibatches_must_give_every_process_an_equal_share():
    """4 prompts over 2 processes and 2 minibatches: one prompt each; 2 prompts would leave a process without one."""
    grpo.validate_args(grpo.Args(prompts_per_step=4, num_minibatches=2), 2, torch.device("cpu"))
    with pytest.raises(grpo.UserError, match=r"--num-minibatches 2 times the number of processes \(2\)"):
        grpo.validate_args(grpo.Args(prompts_per_step=2, num_minibatches=2), 2, torch.device("cpu"))


def test_completions_beyond_the_context(tmp_path, capsys):
    """GPT-2 learns a table of positions and has no row past it: a prompt plus --max-new-tokens beyond it is an
    error up front (it was an IndexError in the embedding, a device-side assert on CUDA). Rotary positions run on
    past the trained context: a warning, and the run goes on."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = grpo.build_tiny_tokenizer()
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tokenizer), n_positions=16,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
                    ).save_pretrained(gpt2)
    tokenizer.save_pretrained(gpt2)
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *QUICK, "--model", str(gpt2), "--max-new-tokens", "8"], capsys)
    assert code == 2 and "a prompt of 12 tokens plus --max-new-tokens 8 exceeds the model's 16 positions" in err
    assert not out.exists()
    code, err = run_main(["--output-dir", str(out), *QUICK, "--total-steps", "1", "--num-eval-prompts", "0",
                          "--max-new-tokens", "250"], capsys)
    assert code == 0 and "warning: a prompt of 12 tokens plus --max-new-tokens 250 exceeds the model's 256" in err


def test_output_dir_below_a_file_is_refused(tmp_path, capsys):
    code, err = run_main(["--output-dir", below_a_file(tmp_path), *QUICK], capsys)
    assert code == 2 and "a_file exists and is not a directory" in err and err.count("\n") == 1


def test_existing_run_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    code, err = run_main(["--output-dir", str(out), *QUICK], capsys)
    # (a run that failed before its first checkpoint: --resume-from latest would only be refused in turn)
    assert code == 2 and "already holds a run, stopped before its first checkpoint: pass --overwrite" in err
    assert "--resume-from" not in err and (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
    (out / "checkpoint-7").mkdir()
    (out / "notes.txt").write_text("mine")
    code, _ = run_main(["--output-dir", str(out), *QUICK, "--total-steps", "1", "--overwrite"], capsys)
    assert code == 0 and len(read_metrics(out)) == 1
    assert not (out / "checkpoint-7").exists()  # the old run's files are gone
    assert (out / "notes.txt").read_text() == "mine"  # and nothing else was touched
    # any part of a run counts: without its metrics.jsonl, a new run mixed with its final model and checkpoints
    (out / "metrics.jsonl").unlink()
    code, err = run_main(["--output-dir", str(out), *QUICK], capsys)
    assert code == 2 and "already holds a run" in err


def test_a_damaged_checkpoint_is_one_line_naming_the_damage(tmp_path, capsys):
    """Cut short by a copy, or a file missing: each was a traceback (exit 1)."""
    import shutil

    run = tmp_path / "run"
    assert run_main(["--output-dir", str(run), *QUICK, "--total-steps", "1", "--save-every", "1"], capsys)[0] == 0
    for name, damage, message in (
            ("model.safetensors", lambda path: path.write_bytes(path.read_bytes()[:100]),
             "cannot read its model.safetensors"),
            ("trainer_state.pt", lambda path: path.write_bytes(path.read_bytes()[:100]),
             "cannot read its trainer_state.pt"),
            ("trainer_state.pt", lambda path: path.unlink(), "no trainer_state.pt in it (a copy cut short"),
            # a file that is no torch archive: torch's message advises weights_only=False, which runs any pickle
            ("trainer_state.pt", lambda path: path.write_bytes(b"garbage" * 20),
             "trainer_state.pt (UnpicklingError: not tensors and plain values: corrupt, or not saved by this script)"),
            ("args.json", lambda path: path.write_text("{"), "cannot read its args.json")):
        damaged = tmp_path / "damaged" / "checkpoint-1"
        shutil.rmtree(damaged.parent, ignore_errors=True)
        shutil.copytree(run / "checkpoint-1", damaged)
        damage(damaged / name)
        code, err = run_main(["--output-dir", str(tmp_path / "damaged"), *QUICK, "--resume-from", str(damaged)],
                             capsys)
        assert code == 2 and err.count("\n") == 1 and message in err, err
    # a LoRA checkpoint's adapter cut short; a final/args.json cut short is no final model for latest
    lora = tmp_path / "lora"
    assert run_main(["--output-dir", str(lora), *QUICK, "--total-steps", "1", "--save-every", "1", "--lora-r", "4"],
                    capsys)[0] == 0
    adapter = lora / "checkpoint-1" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:100])
    code, err = run_main(["--output-dir", str(lora), *QUICK, "--lora-r", "4", "--resume-from", str(adapter.parent)],
                         capsys)
    assert code == 2 and err.count("\n") == 1 and "cannot read its LoRA adapter" in err, err
    (lora / "final" / "args.json").write_text("{")
    assert grpo.final_step(str(lora)) is None
    # a blank line in metrics.jsonl (an editor's) is no row: the resume goes on
    with open(run / "metrics.jsonl", "a") as f:
        f.write("\n")
    assert run_main(["--output-dir", str(run), *QUICK, "--total-steps", "2", "--resume-from", "latest"], capsys)[0] == 0


def test_resume_refuses_another_scripts_or_models_checkpoint(tmp_path, capsys):
    foreign = tmp_path / "checkpoint-3"
    foreign.mkdir()
    (foreign / "trainer_state.pt").write_bytes(b"")
    (foreign / "args.json").write_text(json.dumps({"script": "prm.py"}))
    code, err = run_main(["--output-dir", str(tmp_path / "a"), *QUICK, "--resume-from", str(foreign)], capsys)
    assert code == 2 and "written by prm.py, not grpo.py" in err
    (foreign / "args.json").write_text(json.dumps({"script": "grpo.py", **vars(grpo.Args(model="other"))}))
    code, err = run_main(["--output-dir", str(tmp_path / "b"), *QUICK, "--resume-from", str(foreign)], capsys)
    assert code == 2 and "--model 'other' there, 'tiny' here" in err


@pytest.mark.parametrize("pad", ["none", "past the embeddings"])
def test_tokenizer_without_a_usable_pad_token_falls_back_to_eos(pad, tmp_path, capsys, monkeypatch):
    """No pad token, or one added to the tokenizer without resizing the model's embeddings (an IndexError at the
    first padded prompt, a device-side assert on CUDA): finished rows and prompts are padded with EOS instead."""
    from transformers import AutoTokenizer

    model_dir = save_tiny(tmp_path / "model")
    if pad == "none":
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        config.pop("pad_token", None)
        (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        tokenizer.add_special_tokens({"pad_token": "<newpad>"})
        tokenizer.save_pretrained(model_dir)
    code, out, err = run_main(["--output-dir", str(tmp_path / "out"), *QUICK, "--total-steps", "1", "--model",
                               str(model_dir)], capsys, with_stdout=True)
    assert code == 0, err
    problem = "no pad token" if pad == "none" else "a pad id past the model's"
    assert f"has {problem}" in out and "using EOS ('<eos>') to pad" in out
    assert len(read_metrics(tmp_path / "out")) == 1
    # under torchrun every process loads the model: the note is printed once, by rank 0
    monkeypatch.setenv("RANK", "1")
    tokenizer = grpo.load_model_and_tokenizer(str(model_dir), torch.float32, False)[1]
    assert tokenizer.pad_token == "<eos>" and "to pad" not in capsys.readouterr().out


def test_an_eos_id_past_the_embeddings_is_an_error(tmp_path, capsys):
    from transformers import AutoTokenizer

    model_dir = save_tiny(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"eos_token": "<neweos>"})
    tokenizer.save_pretrained(model_dir)
    code, err = run_main(["--output-dir", str(tmp_path / "out"), *QUICK, "--model", str(model_dir)], capsys)
    assert code == 2 and "is past the model's" in err and "resize_token_embeddings(len(tokenizer))" in err


def test_a_model_with_more_token_rows_than_its_tokenizer_samples_only_the_tokenizers_ids(tmp_path, capsys,
                                                                                         monkeypatch):
    """Checkpoints pad their output layer past the tokenizer (Qwen2.5: 151,936 rows, 151,665 ids). Here 8 padded
    rows get logits 30 above the rest, so that a sampler over every row would draw nothing else: the rollout and
    the evaluation draw the tokenizer's ids only, and the training, reference and old-policy passes score them under
    the same restricted softmax as the sampler (else logp_gap, the KL or the ratio would be about e^30 off)."""
    tokenizer = grpo.build_tiny_tokenizer()
    model = grpo.build_tiny_model(tokenizer)
    model.resize_token_embeddings(len(tokenizer) + 8, mean_resizing=False)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    real_load, sampled, real_generate = grpo.load_model_and_tokenizer, [], grpo.generate

    def load_with_dominant_padded_rows(*args, **kwargs):
        model, tokenizer = real_load(*args, **kwargs)
        boost = torch.zeros(len(tokenizer) + 8)
        boost[len(tokenizer):] = 30.0
        model.lm_head.register_forward_hook(lambda module, inputs, output: output + boost)
        return model, tokenizer

    def recording_generate(*args, **kwargs):
        completion_ids, completion_mask, logp = real_generate(*args, **kwargs)
        sampled.append(completion_ids)
        return completion_ids, completion_mask, logp

    monkeypatch.setattr(grpo, "load_model_and_tokenizer", load_with_dominant_padded_rows)
    monkeypatch.setattr(grpo, "generate", recording_generate)
    code, out, err = run_main(["--output-dir", str(tmp_path / "out"), *QUICK, "--total-steps", "2", "--model",
                               str(tmp_path / "model"), "--kl-coef", "0.05", "--eval-every", "1",
                               "--num-eval-prompts", "4", "--num-minibatches", "2"], capsys, with_stdout=True)
    assert code == 0, err
    assert f"has {len(tokenizer) + 8} token rows for its tokenizer's {len(tokenizer)} ids" in out
    assert len(sampled) == 5  # 3 evaluations (start, after each step) and 2 rollouts
    assert all((ids < len(tokenizer)).all() for ids in sampled)
    metrics = read_metrics(tmp_path / "out")
    assert all(row["logp_gap_max"] < 1e-3 for row in metrics)
    assert metrics[0]["kl_mean"] < 0.1  # the reference scores them the same way (the first update starts there)
    assert all(abs(row["ratio_mean"] - 1.0) < 0.05 for row in metrics)  # and the second minibatch's old log-probs


def test_a_tokenizer_whose_ids_have_gaps_can_still_end_completions(tmp_path, capsys, monkeypatch):
    """len(tokenizer) counts ids: here 23 of them, with EOS at 30 and pad at 31 past a gap (special tokens at the
    top of a reserved range). EOS, whose logit is raised far above the rest, must be drawable: every completion is
    one EOS long, and the sampler draws below the tokenizer's largest id + 1 (32), not below 23."""
    from tokenizers import Tokenizer, models, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(grpo.TINY_CHARS)}  # 0 .. 18
    vocab.update({"<unk>": 19, "<bos>": 20, "<eos>": 30, "<pad>": 31})  # nothing at 21 .. 29
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.add_special_tokens(["<unk>", "<bos>", "<eos>", "<pad>"])
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 20)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                        eos_token="<eos>", unk_token="<unk>")
    assert (len(tokenizer), tokenizer.eos_token_id, grpo.token_id_limit(tokenizer)) == (23, 30, 32)
    assert grpo.token_id_limit(tokenizer, [40]) == 41  # a stop id of the generation config counts too
    config = LlamaConfig(vocab_size=32, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=128, eos_token_id=30, pad_token_id=31)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    real_load, seen, real_generate = grpo.load_model_and_tokenizer, [], grpo.generate

    def load_with_a_likely_eos(*args, **kwargs):
        model, tokenizer = real_load(*args, **kwargs)
        boost = torch.zeros(32)
        boost[30] = 50.0
        model.lm_head.register_forward_hook(lambda module, inputs, output: output + boost)
        return model, tokenizer

    def recording_generate(*args, **kwargs):
        completion_ids, completion_mask, logp = real_generate(*args, **kwargs)
        seen.append((kwargs["vocab_size"], completion_ids, completion_mask))
        return completion_ids, completion_mask, logp

    monkeypatch.setattr(grpo, "load_model_and_tokenizer", load_with_a_likely_eos)
    monkeypatch.setattr(grpo, "generate", recording_generate)
    code, err = run_main(["--output-dir", str(tmp_path / "out"), *QUICK, "--total-steps", "1", "--model",
                          str(tmp_path / "model"), "--max-new-tokens", "4", "--no-chat-template"], capsys)
    assert code == 0, err
    assert seen and all(limit == 32 for limit, _, _ in seen)
    assert all((ids[:, 0] == 30).all() and (mask.sum(1) == 1).all() for _, ids, mask in seen)


@pytest.mark.parametrize("is_decoder", [False, True])
def test_a_model_that_is_not_causal_is_refused(is_decoder, tmp_path, capsys):
    """A BERT checkpoint loads through AutoModelForCausalLM as BertLMHeadModel, bidirectional unless its config says
    is_decoder: the training pass would read each completion token from the ones after it. Refused before any step;
    the same model made causal passes the check."""
    from transformers import BertConfig, BertLMHeadModel

    tokenizer = grpo.build_tiny_tokenizer()
    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                        vocab_size=len(tokenizer), pad_token_id=0, is_decoder=is_decoder)
    BertLMHeadModel(config).save_pretrained(tmp_path / "bert")
    tokenizer.save_pretrained(tmp_path / "bert")
    if is_decoder:
        model, _ = grpo.load_model_and_tokenizer(str(tmp_path / "bert"), torch.float32, False)
        assert type(model).__name__ == "BertLMHeadModel"
        return
    code, err = run_main(["--output-dir", str(tmp_path / "out"), *QUICK, "--model", str(tmp_path / "bert")], capsys)
    assert code == 2 and "is not causal: changing a sequence's last token changes the logits before it" in err, err
    assert "use a decoder-only (causal LM) model" in err and not (tmp_path / "out" / "metrics.jsonl").exists()


def test_reward_errors_are_reported_or_skipped(tmp_path, capsys, monkeypatch):
    calls = {"n": 0}

    def flaky_reward(completion: str, answer: str) -> float:
        calls["n"] += 1
        if calls["n"] % 5 == 0:
            raise ZeroDivisionError("boom")
        return float("nan") if calls["n"] % 7 == 0 else 1.0

    monkeypatch.setattr(grpo, "answer_reward", flaky_reward)
    code, err = run_main(["--output-dir", str(tmp_path / "a"), *QUICK, "--eval-every", "0", "--num-eval-prompts",
                          "0"], capsys)
    assert code == 2 and "reward answer failed on sample 4" in err and "ZeroDivisionError: boom" in err
    assert "--reward-errors skip" in err
    code, err = run_main(["--output-dir", str(tmp_path / "b"), *QUICK, "--num-eval-prompts", "0",
                          "--reward-errors", "skip"], capsys)
    assert code == 0
    assert "returned nan" in err
    metrics = read_metrics(tmp_path / "b")
    assert read_eval_rows(tmp_path / "b") == []  # no eval prompts: no evaluation rows
    assert all(row["reward_errors"] > 0 for row in metrics)
    assert all(row["loss"] is not None for row in metrics)  # the failed samples left no NaN (null) behind


def test_a_reward_that_fails_on_every_sample_stops_the_run_under_skip(tmp_path, capsys, monkeypatch):
    """--reward-errors skip with a reward that never works: every step had no sample left and went on (reward nan,
    no update), for as long as the run lasted."""
    def broken_reward(completion: str, answer: str) -> float:
        raise KeyError("answer_text")

    monkeypatch.setattr(grpo, "answer_reward", broken_reward)
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *QUICK, "--total-steps", "10", "--max-bad-steps", "2",
                          "--num-eval-prompts", "0", "--format-reward-weight", "0", "--reward-errors", "skip"], capsys)
    assert code == 2 and "the reward failed on every sample of 2 steps in a row" in err, err
    assert [row["step"] for row in read_metrics(out)] == [1, 2]
    # a few warnings a step (not one per sample), then their count
    assert err.count("warning: reward answer failed") == 2 * 5
    assert err.count("warning: 11 more reward failures among this process's samples of the step (counted in "
                     "reward_errors)") == 2


def test_non_finite_loss_skips_updates_then_stops(tmp_path, capsys, monkeypatch):
    real_loss = grpo.grpo_loss

    def nan_loss(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(grpo, "grpo_loss", nan_loss)
    handler_before = signal.getsignal(signal.SIGINT)  # the default, or SIG_IGN in a shell's background job
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *QUICK, "--total-steps", "10", "--max-bad-steps", "3"], capsys)
    assert code == 2 and "3 updates in a row had a non-finite loss" in err
    assert err.count("update skipped") == 3
    metrics = read_metrics(out)  # steps 1 and 2 skipped their updates, step 3 stopped the run after its row
    assert [row["step"] for row in metrics] == [1, 2, 3] and metrics[-1]["loss"] is None
    assert not (out / "final").exists()
    assert signal.getsignal(signal.SIGINT) is handler_before  # an error puts the handlers back too


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


@pytest.mark.parametrize("script", ["grpo", "prm"])
def test_a_second_stop_signal_stops_at_once(script, tmp_path, capsys, monkeypatch):
    """The first Ctrl-C asks for a checkpoint after the step; a second one, in the same step, goes to the handler
    there was before (Python's: KeyboardInterrupt) instead of being swallowed until a step of minutes ends. Not so a
    second SIGTERM (a preemption may deliver two): the run still checkpoints."""
    import prm
    from conftest import run_script_main

    module = grpo if script == "grpo" else prm
    hooked, real = ("generate", grpo.generate) if script == "grpo" else ("collate", prm.collate)
    signals_sent = []

    def then_two_signals(*args, **kwargs):
        result = real(*args, **kwargs)
        if not signals_sent:
            for _ in range(2):
                signals_sent.append(1)
                os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(module, hooked, then_two_signals)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # (SIG_IGN in a shell's background job)
    sigterm_before = signal.getsignal(signal.SIGTERM)
    try:
        flags = ([*QUICK, "--num-eval-prompts", "0"] if script == "grpo" else
                 ["--batch-size", "4", "--num-val-rows", "0", "--num-eval-rows", "0", "--total-steps", "3"])
        with pytest.raises(KeyboardInterrupt):
            run_script_main(module.main, f"{script}.py", ["--output-dir", str(tmp_path / "run"), *flags], capsys)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is sigterm_before and len(signals_sent) == 2  # both put back
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not list((tmp_path / "run").glob("checkpoint-*")) and not (tmp_path / "run" / "final").exists()

    def then_two_sigterms(*args, **kwargs):
        result = real(*args, **kwargs)
        if len(signals_sent) == 2:
            for _ in range(2):
                signals_sent.append(1)
                os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(module, hooked, then_two_sigterms)
    code, err = run_script_main(module.main, f"{script}.py", ["--output-dir", str(tmp_path / "term"), *flags], capsys)
    assert code == 128 + signal.SIGTERM and len(signals_sent) == 4, err  # stopped, not finished: not status 0
    assert [p.name for p in (tmp_path / "term").glob("checkpoint-*")] == ["checkpoint-1"]
    assert signal.getsignal(signal.SIGTERM) is sigterm_before


def test_sigterm_checkpoints_and_resume_matches_an_uninterrupted_run(tmp_path):
    flags = [*QUICK, "--total-steps", "12", "--kl-coef", "0.05", "--num-iterations", "2"]
    straight = tmp_path / "straight"
    run_grpo(straight, *flags)

    interrupted = tmp_path / "interrupted"
    process = subprocess.Popen([sys.executable, "grpo.py", "--output-dir", str(interrupted), *flags],
                               cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "WANDB_MODE": "disabled"})
    metrics_file = interrupted / "metrics.jsonl"
    deadline = time.time() + 240
    # (3 rows: the start evaluation's and two steps')
    while time.time() < deadline and not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=240)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    steps = grpo.checkpoint_steps(str(interrupted))
    assert steps, stdout
    # the command printed works verbatim from anywhere, and again after a second stop: latest, not a fixed checkpoint
    assert f"<the same flags> --output-dir {interrupted} --resume-from latest" in stdout
    assert not (interrupted / "final").exists()
    stopped_at = steps[-1]
    assert stopped_at < 12, "the run finished before the signal arrived; nothing was tested"

    run_grpo(interrupted, *flags, "--resume-from", "latest")
    resumed = read_metrics(interrupted)
    assert [row["step"] for row in resumed] == list(range(1, 13))
    assert comparable(resumed[stopped_at:]) == comparable(read_metrics(straight)[stopped_at:])
    assert read_eval_rows(interrupted) == read_eval_rows(straight)  # the start and final evaluations, once each
    from safetensors.torch import load_file

    a, b = load_file(straight / "final" / "model.safetensors"), load_file(interrupted / "final" / "model.safetensors")
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_a_finished_run_is_taken_further_from_its_final_model(tmp_path, capsys):
    """final/ keeps the trainer state: a run that ended without checkpoints goes on from it with a higher
    --total-steps (`latest` finds it), to the numbers of a run that went the whole way at once; final/ stays
    until the longer run writes its own, and a checkpoint past --total-steps is refused."""
    flags = [*QUICK, "--kl-coef", "0.05"]
    straight, extended = tmp_path / "straight", tmp_path / "extended"
    run_grpo(straight, *flags, "--total-steps", "3")
    run_grpo(extended, *flags, "--total-steps", "2")
    assert grpo.checkpoint_steps(str(extended)) == [] and grpo.final_step(str(extended)) == 2
    code, err = run_main([*flags, "--output-dir", str(extended), "--total-steps", "1", "--resume-from", "latest"],
                         capsys)
    assert code == 2 and "is at step 2, past --total-steps 1" in err
    code, err = run_main([*flags, "--output-dir", str(extended), "--total-steps", "3", "--resume-from", "latest"],
                         capsys)
    assert code == 0, err
    assert [row["step"] for row in read_metrics(extended)] == [1, 2, 3]
    assert comparable(read_metrics(extended)) == comparable(read_metrics(straight))
    # the evaluation that ended the shorter run stays in the curve; the final one is the straight run's
    assert [row["step"] for row in read_eval_rows(extended)] == [0, 2, 3]
    assert read_eval_rows(extended)[::2] == read_eval_rows(straight)
    assert grpo.final_step(str(extended)) == 3
    from safetensors.torch import load_file

    a, b = load_file(straight / "final" / "model.safetensors"), load_file(extended / "final" / "model.safetensors")
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_a_longer_run_stopped_in_its_last_step_still_ends_with_its_own_final_model(tmp_path, capsys, monkeypatch):
    """Taken further from final/ (step 2) and stopped by SIGTERM in its last step (3), a run leaves checkpoint-3
    beside the old final/; resumed, it must write its own final model and summary, not take the old ones for
    "nothing to do". A final/ from before final models kept their trainer state is named as such."""
    run = tmp_path / "run"
    flags = [*QUICK, "--output-dir", str(run)]
    assert run_main([*flags, "--total-steps", "2"], capsys)[0] == 0
    real_rewards = grpo.compute_rewards

    def rewards_sending_sigterm(*args, **kwargs):  # called once per step: this run's only step is step 3
        os.kill(os.getpid(), signal.SIGTERM)
        return real_rewards(*args, **kwargs)

    monkeypatch.setattr(grpo, "compute_rewards", rewards_sending_sigterm)
    code, out, _ = run_main([*flags, "--total-steps", "3", "--resume-from", "latest"], capsys, with_stdout=True)
    monkeypatch.setattr(grpo, "compute_rewards", real_rewards)
    assert code == 128 + signal.SIGTERM and "stopped by a signal after step 3" in out
    assert grpo.checkpoint_steps(str(run)) == [3] and grpo.final_step(str(run)) == 2
    code, out, _ = run_main([*flags, "--total-steps", "3", "--resume-from", "latest"], capsys, with_stdout=True)
    assert code == 0 and "nothing to do" not in out
    assert grpo.final_step(str(run)) == 3 and read_summary(run)["steps"] == 3 and not read_summary(run)["interrupted"]

    (run / "final" / "trainer_state.pt").unlink()  # as an older version wrote it
    code, err = run_main([*flags, "--total-steps", "4", "--resume-from", str(run / "final")], capsys)
    assert code == 2 and "written before final models kept their trainer state" in err and "--model" in err


def test_a_stop_during_the_final_evaluation_keeps_the_final_model(tmp_path, capsys, monkeypatch):
    """The final model is written before the final evaluation (on a real model, minutes of generation): a Ctrl-C
    there (a KeyboardInterrupt once the run's handlers are gone) used to lose every step since the last
    checkpoint. Resuming the run, which has no summary yet, runs the final evaluation and writes it."""
    real_evaluate, calls = grpo.evaluate, []

    def evaluate_interrupted_at_the_end(*args, **kwargs):  # called at the start and at the end of the run
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(grpo, "evaluate", evaluate_interrupted_at_the_end)
    run = tmp_path / "run"
    flags = [*QUICK, "--output-dir", str(run), "--total-steps", "2"]
    with pytest.raises(KeyboardInterrupt):
        run_main(flags, capsys)
    assert grpo.final_step(str(run)) == 2 and (run / "final" / "trainer_state.pt").is_file()
    assert not (run / "summary.json").exists()
    monkeypatch.setattr(grpo, "evaluate", real_evaluate)
    with open(run / "metrics.jsonl", "a") as f:  # a row torn by a crash mid-write made every resume a traceback
        f.write('{"step": 3, "rew')
    code, out, _ = run_main([*flags, "--resume-from", "latest"], capsys, with_stdout=True)
    assert code == 0 and "nothing to do" not in out and "eval accuracy at step 2" in out
    summary = read_summary(run)
    assert summary["steps"] == 2 and [row["step"] for row in read_metrics(run)] == [1, 2]
    # no step ran in the resumed process: no throughput (it read 0.0 tokens/s, as if the steps had been endless)
    assert [summary[key] for key in ("generated_tokens_per_s", "trained_tokens_per_s", "model_tflops_per_s")] == [
        None] * 3
    code, out, _ = run_main([*flags, "--resume-from", "latest"], capsys, with_stdout=True)
    assert code == 0 and "nothing to do" in out  # now it is finished


def test_a_stop_after_the_final_evaluation_row_logs_it_once(tmp_path, capsys, monkeypatch):
    """A Ctrl-C after the final evaluation's row is logged but before the summary is written: the resume does that
    evaluation again and logs its row in place of the old one, not beside it."""
    real_throughput = grpo.matmul_flops_per_s

    def interrupted(*args, **kwargs):  # measured for the summary, after the final evaluation's row
        raise KeyboardInterrupt

    monkeypatch.setattr(grpo, "matmul_flops_per_s", interrupted)
    run = tmp_path / "run"
    flags = [*QUICK, "--output-dir", str(run), "--total-steps", "2"]
    with pytest.raises(KeyboardInterrupt):
        run_main(flags, capsys)
    assert not (run / "summary.json").exists() and [row["step"] for row in read_eval_rows(run)] == [0, 2]
    monkeypatch.setattr(grpo, "matmul_flops_per_s", real_throughput)
    assert run_main([*flags, "--resume-from", "latest"], capsys)[0] == 0
    assert [row["step"] for row in read_metrics(run)] == [1, 2]
    assert [row["step"] for row in read_eval_rows(run)] == [0, 2]
    assert read_eval_rows(run)[-1]["eval_accuracy"] == read_summary(run)["eval_accuracy_end"]


def test_a_stop_signal_during_the_final_save_skips_the_final_evaluation(tmp_path, capsys, monkeypatch):
    """A SIGTERM while the final model is being written is not dropped: the (long) final evaluation is skipped,
    and a resume runs it and writes the summary."""
    real_save = grpo.save_checkpoint

    def save_receiving_sigterm(path, *args, **kwargs):
        if path.endswith("final"):
            os.kill(os.getpid(), signal.SIGTERM)  # the run's handler only notes it
        return real_save(path, *args, **kwargs)

    monkeypatch.setattr(grpo, "save_checkpoint", save_receiving_sigterm)
    run = tmp_path / "run"
    flags = [*QUICK, "--output-dir", str(run), "--total-steps", "2"]
    code, out, _ = run_main(flags, capsys, with_stdout=True)
    assert code == 128 + signal.SIGTERM and "stopped by a signal after saving the final model" in out
    assert "eval accuracy at step 2" not in out and not (run / "summary.json").exists()
    assert grpo.final_step(str(run)) == 2
    monkeypatch.setattr(grpo, "save_checkpoint", real_save)
    code, out, _ = run_main([*flags, "--resume-from", "latest"], capsys, with_stdout=True)
    assert code == 0 and "eval accuracy at step 2" in out and read_summary(run)["steps"] == 2


def distinct_accuracies(monkeypatch) -> list[float]:
    """Stub grpo.evaluate to return 0.125, 0.25, 0.375, ... in call order (the tiny model's held-out accuracies are
    all 0.0 in a short run, so a figure taken from the wrong evaluation would go unseen); returns those given."""
    accuracies = []

    def evaluate(*args, **kwargs):
        accuracies.append(0.125 * (len(accuracies) + 1))
        return accuracies[-1], []

    monkeypatch.setattr(grpo, "evaluate", evaluate)
    return accuracies


def test_a_resume_takes_its_evaluations_from_the_checkpoint(tmp_path, capsys, monkeypatch):
    """A resume from checkpoint-STEP evaluates nothing before its first step (on a real model, minutes of
    generation): its summary starts at the run's step-0 accuracy, and until it evaluates, its last accuracy is the
    checkpoint's. final/ is written before the final evaluation, so a run taken further from it evaluates first."""
    accuracies = distinct_accuracies(monkeypatch)
    run = tmp_path / "run"
    flags = [*QUICK, "--output-dir", str(run), "--eval-every", "2", "--save-every", "2"]
    assert run_main(flags, capsys)[0] == 0  # at steps 0, 2 and 3 (the end)
    assert accuracies == [0.125, 0.25, 0.375]
    real_rewards = grpo.compute_rewards

    def rewards_sending_sigterm(*args, **kwargs):  # called once per step: the resumed run stops after step 3
        os.kill(os.getpid(), signal.SIGTERM)
        return real_rewards(*args, **kwargs)

    monkeypatch.setattr(grpo, "compute_rewards", rewards_sending_sigterm)
    assert run_main([*flags, "--resume-from", str(run / "checkpoint-2")], capsys)[0] == 128 + signal.SIGTERM
    monkeypatch.setattr(grpo, "compute_rewards", real_rewards)
    summary = read_summary(run)
    assert accuracies == [0.125, 0.25, 0.375] and summary["interrupted"]
    assert summary["eval_accuracy_start"] == 0.125 and summary["eval_accuracy_end"] == 0.25
    assert run_main([*flags, "--resume-from", "latest"], capsys)[0] == 0  # checkpoint-3: the final evaluation only
    summary = read_summary(run)
    assert accuracies[3:] == [0.5] and not summary["interrupted"]
    assert summary["eval_accuracy_start"] == 0.125 and summary["eval_accuracy_end"] == 0.5
    assert read_eval_rows(run) == [{"step": 0, "eval_accuracy": 0.125}, {"step": 3, "eval_accuracy": 0.5}]
    assert run_main([*flags, "--total-steps", "4", "--resume-from", str(run / "final")], capsys)[0] == 0  # step 3
    assert accuracies[4:] == [0.625, 0.75]  # at its start (final/ does not hold the final evaluation) and end
    summary = read_summary(run)
    assert summary["eval_accuracy_start"] == 0.125 and summary["eval_accuracy_end"] == 0.75


def test_a_resume_evaluates_first_where_its_checkpoint_has_no_figure_for_its_rows(tmp_path, capsys, monkeypatch):
    """A checkpoint's accuracies are reused only on the held-out rows they were measured on: resumed with another
    --eval-data-path, the run evaluates at its start, and that is its start figure too. A checkpoint written
    before the last accuracy was kept gives its start figure only. A resume with nothing left to train evaluates
    once, at the end."""
    accuracies = distinct_accuracies(monkeypatch)
    run = tmp_path / "run"
    flags = [*QUICK, "--output-dir", str(run), "--total-steps", "2", "--save-every", "1"]
    assert run_main(flags, capsys)[0] == 0  # at steps 0 and 2
    rows = tmp_path / "eval.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"({n}+7)%10=", "answer": str((n + 7) % 10)}) + "\n"
                            for n in range(100, 104)))
    assert run_main([*flags, "--eval-data-path", str(rows), "--resume-from", str(run / "checkpoint-1")],
                    capsys)[0] == 0
    assert accuracies[2:] == [0.375, 0.5]  # at its start (step 1) and end
    assert read_summary(run)["eval_accuracy_start"] == 0.375
    state_path = run / "checkpoint-1" / "trainer_state.pt"
    state = torch.load(state_path, weights_only=True)
    assert state["eval_start"] == 0.125 and state["eval_last"] == 0.125
    for key in ("eval_rows", "eval_last"):  # as an older version wrote it
        del state[key]
    torch.save(state, state_path)
    assert run_main([*flags, "--resume-from", str(state_path.parent)], capsys)[0] == 0
    assert accuracies[4:] == [0.625, 0.75]
    summary = read_summary(run)
    assert summary["eval_accuracy_start"] == 0.125 and summary["eval_accuracy_end"] == 0.75
    (run / "summary.json").unlink()  # as a stop during the final evaluation leaves it
    code, out, _ = run_main([*flags, "--resume-from", str(run / "final")], capsys, with_stdout=True)  # at step 2
    assert code == 0 and accuracies[6:] == [0.875] and "eval accuracy at step 2" in out
    assert read_summary(run)["eval_accuracy_start"] == 0.125


def test_resuming_with_another_lora_alpha_or_chat_template_is_refused(tmp_path, capsys):
    """On resume peft reads alpha from the checkpoint's adapter: another --lora-alpha was ignored, and recorded in
    args.json as if it applied. Another chat-template setting changes every prompt's tokens."""
    run = tmp_path / "run"
    flags = [*QUICK, "--output-dir", str(run), "--total-steps", "2", "--save-every", "1", "--lora-r", "4"]
    assert run_main(flags, capsys)[0] == 0
    code, err = run_main([*flags, "--lora-alpha", "8", "--resume-from", "latest"], capsys)
    assert code == 2 and "--lora-alpha 32 there, 8 here" in err
    code, err = run_main([*flags, "--no-chat-template", "--resume-from", "latest"], capsys)
    assert code == 2 and "--chat-template True there, False here" in err


def test_removing_a_directory_never_leaves_a_half_one_under_its_name(tmp_path, monkeypatch):
    """A checkpoint or final/ being dropped or replaced is renamed away before it is deleted: a kill during the
    deletion leaves nothing under the name, never a directory with some of its files gone that `latest` takes."""
    final = tmp_path / "final"
    final.mkdir()
    (final / "trainer_state.pt").write_text("state")
    (final / "model.safetensors").write_text("weights")
    under_the_name = []
    real_rmtree = grpo.shutil.rmtree

    def rmtree_that_looks(path, *args, **kwargs):
        if os.path.exists(path):  # a deletion that does something: what is under the name meanwhile
            under_the_name.append(sorted(p.name for p in final.iterdir()) if final.exists() else None)
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(grpo.shutil, "rmtree", rmtree_that_looks)
    grpo.remove_directory(str(final))
    assert under_the_name == [None] and not final.exists() and not (tmp_path / "final.old").exists()


def test_resuming_on_other_training_rows_is_refused(tmp_path, capsys):
    # the built-in task's training rows are the prompts not held out: another --num-eval-prompts changes them
    run = tmp_path / "run"
    run_grpo(run, *QUICK, "--total-steps", "1", "--save-every", "1")
    code, err = run_main([*QUICK, "--output-dir", str(run), "--num-eval-prompts", "17", "--resume-from", "latest"],
                         capsys)
    assert code == 2 and "the training rows differ from the checkpoint's (the built-in task holds out" in err
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"prompt": "({n}+7)%10=", "answer": "{(n + 7) % 10}"}}\n' for n in range(100, 140)))
    data_run = tmp_path / "data_run"
    run_grpo(data_run, *QUICK, "--total-steps", "1", "--save-every", "1", "--data-path", str(rows))
    rows.write_text(rows.read_text().replace('"answer": "7"', '"answer": "8"'))
    code, err = run_main([*QUICK, "--output-dir", str(data_run), "--data-path", str(rows), "--resume-from", "latest"],
                         capsys)
    assert code == 2 and "(the same --data-path, but the file changed?)" in err


def test_bf16_resume_is_exact_and_resume_flags_win(tmp_path):
    """bf16 weights are the fp32 masters rounded: the checkpoint keeps the masters, so a bf16 run resumed from it
    ends with the uninterrupted run's weights, bit for bit (rebuilt from the rounded weights, 15 of 20 tensors
    differed). --learning-rate and --weight-decay given at resume win over the optimiser state the checkpoint
    restores, and metrics.jsonl logs the rate each update used (not the next one's)."""
    from safetensors.torch import load_file

    flags = [*QUICK, "--total-steps", "4", "--dtype", "bfloat16", "--learning-rate", "1e-2", "--warmup-steps", "2",
             "--save-every", "2", "--kl-coef", "0.05"]
    straight = tmp_path / "straight"
    run_grpo(straight, *flags)
    # 2 warm-up updates, then constant: the first update uses half the rate
    assert [row["learning_rate"] for row in read_metrics(straight)] == pytest.approx([5e-3, 1e-2, 1e-2, 1e-2])
    final = load_file(straight / "final" / "model.safetensors")

    resumed = tmp_path / "resumed"
    run_grpo(resumed, *flags, "--resume-from", str(straight / "checkpoint-2"))
    again = load_file(resumed / "final" / "model.safetensors")
    assert all(again[name].dtype == torch.bfloat16 and torch.equal(again[name], final[name]) for name in final)

    lowered = tmp_path / "lowered"
    process = run_grpo(lowered, *flags, "--learning-rate", "1e-3", "--weight-decay", "0.5",
                       "--resume-from", str(straight / "checkpoint-2"))
    assert "resuming with --learning-rate 0.001 (the checkpoint's run had 0.01)" in process.stdout
    assert "resuming with --weight-decay 0.5" in process.stdout
    assert [row["learning_rate"] for row in read_metrics(lowered)] == pytest.approx([1e-3, 1e-3])
    state = torch.load(lowered / "checkpoint-4" / "trainer_state.pt", weights_only=True)
    assert state["scheduler"]["base_lrs"] == [1e-3, 1e-3]  # (matrices, decayed; norm gains, not)
    assert [group["weight_decay"] for group in state["optimizer"]["param_groups"]] == [0.5, 0.0]
    other = load_file(lowered / "final" / "model.safetensors")
    assert any(not torch.equal(other[name], final[name]) for name in final)


@pytest.mark.parametrize("lora_r", ["4", "0"])
def test_a_model_configured_with_dropout_trains_without_it(tmp_path, lora_r):
    """A config's attention_dropout is applied by the attention layers themselves, in train mode: left on, the
    training pass's log-probs of the sampled tokens would differ from the sampler's (eval mode) by a dropout draw
    (measured: logp_gap_max 0.18-0.22); off, they agree to rounding. The saved models keep the configured rate."""
    model_dir = save_tiny(tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.3}))
    out = tmp_path / "out"
    run_grpo(out, *QUICK, "--total-steps", "2", "--model", str(model_dir), "--lora-r", lora_r, "--no-chat-template",
             "--save-every", "1")
    assert all(row["logp_gap_max"] < 1e-4 for row in read_metrics(out))
    if lora_r == "0":  # (an adapter saves no config of its own)
        for saved in ("checkpoint-2", "final"):
            saved_config = json.loads((out / saved / "config.json").read_text())
            assert saved_config["attention_dropout"] == 0.3 and saved_config["use_cache"] is True


def test_resume_continues_the_checkpoints_run(tmp_path, capsys, monkeypatch):
    """Given a checkpoint and no --output-dir, a resumed run continues in the checkpoint's directory (not a new
    time-stamped one) and drops the checkpoints of the branch it leaves; a run already finished is left alone."""
    run = tmp_path / "run"
    run_grpo(run, *QUICK, "--total-steps", "3", "--save-every", "1", "--keep-checkpoints", "3")
    summary = (run / "summary.json").read_text()
    code, out, _ = run_main([*QUICK, "--total-steps", "3", "--resume-from", str(run / "checkpoint-3")], capsys,
                            with_stdout=True)
    assert code == 0 and "the run already reached --total-steps 3; nothing to do" in out
    assert (run / "summary.json").read_text() == summary  # the finished run's figures are left alone
    code, err = run_main([*QUICK, "--total-steps", "3", "--dtype", "bfloat16", "--resume-from",
                          str(run / "checkpoint-1")], capsys)
    assert code == 2 and "computed in torch.float32, this one in torch.bfloat16: pass the same --dtype" in err

    runs_before = set(os.listdir("runs")) if os.path.isdir("runs") else set()
    code, _ = run_main([*QUICK, "--total-steps", "2", "--resume-from", str(run / "checkpoint-1")], capsys)
    assert code == 0
    assert [row["step"] for row in read_metrics(run)] == [1, 2]
    assert grpo.checkpoint_steps(str(run)) == [1]  # checkpoint-2 and -3 belonged to the abandoned branch
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["steps"] == 2 and resumed["resumed_from_step"] == 1  # its times cover the one step it ran
    assert json.loads(summary)["resumed_from_step"] == 0
    assert (set(os.listdir("runs")) if os.path.isdir("runs") else set()) == runs_before  # no new run directory

    # the abandoned branch's final model goes too: were this run stopped in its last step, a resume would
    # otherwise find a final/ and take the old branch's model for this one's
    calls = {"n": 0}

    def reward_failing_in_step_3(completion: str, answer: str) -> float:
        calls["n"] += 1
        if calls["n"] > 16:
            raise RuntimeError("stop")
        return 1.0

    with monkeypatch.context() as patch:
        patch.setattr(grpo, "answer_reward", reward_failing_in_step_3)
        code, err = run_main([*QUICK, "--total-steps", "3", "--resume-from", str(run / "checkpoint-1")], capsys)
    assert code == 2 and "RuntimeError: stop" in err
    assert not (run / "final").exists() and not (run / "summary.json").exists()

    # a checkpoint resumed into another directory that holds a run would overwrite that run
    other = tmp_path / "other"
    run_grpo(other, *QUICK, "--total-steps", "1")
    code, err = run_main([*QUICK, "--output-dir", str(other), "--resume-from", str(run / "checkpoint-1")], capsys)
    assert code == 2 and "already holds a run" in err


def test_a_step_with_no_token_in_the_loss_leaves_the_weights(tmp_path, capsys, monkeypatch):
    """When every sample's reward fails (--reward-errors skip), no token is in the loss: the gradient is zero, but
    AdamW's momentum from earlier steps would still move the weights, so the update is not taken; the token-
    weighted statistics are NaN rather than 0."""
    from safetensors.torch import load_file

    calls = {"n": 0}

    def reward_failing_from_step_2(completion: str, answer: str) -> float:
        calls["n"] += 1
        return 1.0 if calls["n"] <= 16 and calls["n"] % 3 else (0.0 if calls["n"] <= 16 else float("nan"))

    monkeypatch.setattr(grpo, "answer_reward", reward_failing_from_step_2)
    out = tmp_path / "out"
    code, _ = run_main(["--output-dir", str(out), *QUICK, "--total-steps", "2", "--save-every", "1",
                        "--num-eval-prompts", "0", "--reward-errors", "skip", "--learning-rate", "1e-2"], capsys)
    assert code == 0
    first, second = read_metrics(out)
    assert first["grad_norm"] > 0 and second["reward_errors"] == 16
    assert second["ratio_mean"] is None and second["entropy"] is None  # NaN, written as null
    before = load_file(out / "checkpoint-1" / "model.safetensors")
    after = load_file(out / "final" / "model.safetensors")
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_lora_on_the_tiny_model_saves_a_loadable_adapter(tmp_path):
    """The tiny model exists nowhere but in the script: its final/ adapter carries the base model beside it, so
    peft loads it as it is, and it generates what the run's last evaluation did."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    run_grpo(out, *QUICK, "--total-steps", "1", "--lora-r", "4", "--num-eval-prompts", "0")
    model = AutoPeftModelForCausalLM.from_pretrained(out / "final")
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    assert type(model.get_base_model()).__name__ == "LlamaForCausalLM"
    ids = tokenizer("(123+7)%10=", return_tensors="pt")
    assert model.generate(**ids, max_new_tokens=2, do_sample=False).shape == (1, ids["input_ids"].shape[1] + 2)


def test_keep_checkpoints_keeps_the_newest(tmp_path):
    out = tmp_path / "out"
    run_grpo(out, *QUICK, "--total-steps", "4", "--save-every", "1", "--keep-checkpoints", "2")
    assert grpo.checkpoint_steps(str(out)) == [3, 4]
    assert not list(out.glob("*.tmp"))


@pytest.mark.parametrize("minibatches", ["1", "2"])
def test_two_processes_make_the_same_update_as_one(minibatches, tmp_path):
    """dapo: each process's token sum is divided by the token count of both. A wrong normaliser shows in the loss
    and the gradient norm; the weights after Adam's first step hide a gradient scale. With 2 minibatches each
    process holds one prompt of each, and each update is normalised by its minibatch's counts over both."""
    flags = ["--total-steps", "1", "--prompts-per-step", "4", "--group-size", "4", "--eval-every", "0",
             "--num-eval-prompts", "8", "--kl-coef", "0.05", "--loss-type", "dapo", "--learning-rate", "1e-3",
             "--num-minibatches", minibatches]
    single = tmp_path / "single"
    run_grpo(single, *flags)
    double = tmp_path / "double"
    process = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                              "grpo.py", "--output-dir", str(double), *flags], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=300,
                             env={**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"})
    assert process.returncode == 0, process.stderr[-3000:]
    from safetensors.torch import load_file

    one, two = load_file(single / "final" / "model.safetensors"), load_file(double / "final" / "model.safetensors")
    # Adam divides each entry by its own RMS: fp32 rounding in near-zero entries moves a weight by a few percent of
    # a step (lr 1e-3; measured 1.9e-5); a per-process token count moved them by 2e-3
    assert max((one[name] - two[name]).abs().max().item() for name in one) < 1e-4
    # and the update was not a no-op: the weights moved from their (seeded, identical) initial values
    torch.manual_seed(1)
    initial = grpo.build_tiny_model(grpo.build_tiny_tokenizer()).state_dict()
    assert max((one[name] - initial[name]).abs().max().item() for name in one) > 5e-4  # Adam moves ~lr
    for key in ("reward", "loss", "grad_norm"):
        assert read_metrics(single)[0][key] == pytest.approx(read_metrics(double)[0][key], rel=1e-5), key


def test_a_failed_reward_is_named_by_the_same_sample_index_under_torchrun(tmp_path):
    """torchrun gives each process every world_size-th prompt of the step: a reward failure names the sample by its
    index in the whole step's batch, the index one process names for the same completion."""
    rows = [{"prompt": f"({n}+7)%10=", "answer": str(n)} for n in range(101, 105)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    wrapper = tmp_path / "failing_reward.py"  # grpo.py whose answer reward is NaN for one prompt
    wrapper.write_text(f"import sys\nsys.path.insert(0, {str(REPO_ROOT)!r})\nimport grpo\n"
                       "grpo.answer_reward = lambda completion, answer: float('nan') if answer == '102' else 0.0\n"
                       "grpo.main()\n")
    flags = ["--data-path", str(data), "--no-chat-template", "--total-steps", "1", "--prompts-per-step", "4",
             "--group-size", "4", "--eval-every", "0", "--num-eval-prompts", "0", "--reward-errors", "skip"]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    named = {}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    for launch, processes in (([sys.executable], 1), (torchrun, 2)):
        process = subprocess.run([*launch, str(wrapper), "--output-dir", str(tmp_path / f"run{processes}"), *flags],
                                 cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
        assert process.returncode == 0, process.stderr[-3000:]
        named[processes] = sorted(int(n) for n in re.findall(r"failed on sample (\d+) ", process.stderr))
    # the prompt's 4 completions, by the same indices (the epoch's order puts it at any of the 4 places)
    assert len(named[1]) == 4 and named[1] == list(range(named[1][0], named[1][0] + 4)) and named[1][0] % 4 == 0
    assert named[2] == named[1]


def test_a_prompt_of_no_tokens_is_refused():
    """An empty prompt through a tokenizer that adds no BOS leaves no position to predict the first completion token
    from: an error naming the prompt, not a crash in the middle of a step."""
    class NoBos:
        chat_template = None

        def __call__(self, text):
            return {"input_ids": [ord(c) for c in text]}

    assert grpo.encode_prompts(NoBos(), ["ab", "c"], True, 8) == [[97, 98], [99]]
    with pytest.raises(grpo.UserError, match="prompt 1 encodes to no tokens"):
        grpo.encode_prompts(NoBos(), ["ab", ""], True, 8)


@pytest.mark.parametrize("script", ["grpo", "prm"])
def test_a_save_killed_while_deleting_the_old_version_leaves_the_new_one_under_its_name(script, tmp_path,
                                                                                         monkeypatch):
    """The old version was deleted (slow, for a large model) before the new one took its name: a kill then left
    only final.old, half deleted, and final.tmp, and a resume found no final model at all."""
    import shutil

    import prm

    path, real_rmtree = tmp_path / "final", shutil.rmtree
    if script == "grpo":
        tokenizer = grpo.build_tiny_tokenizer()
        model = grpo.build_tiny_model(tokenizer)
        save = lambda step: grpo.save_checkpoint(str(path), model, tokenizer, grpo.Args(), {"step": step},  # noqa: E731
                                                 {})
        step_of = lambda: torch.load(path / "trainer_state.pt", weights_only=True)["step"]  # noqa: E731
    else:
        model, _ = prm.build_prm(prm.Args(), torch.float32)
        save = lambda step: prm.save_prm(str(path), model, step=step)  # noqa: E731
        step_of = lambda: prm.final_step(str(tmp_path))  # noqa: E731
    save(1)

    def killed_while_deleting_the_old_one(target, *args, **kwargs):
        if str(target).endswith(".old") and os.path.exists(target):
            raise KeyboardInterrupt
        return real_rmtree(target, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", killed_while_deleting_the_old_one)
    with pytest.raises(KeyboardInterrupt):
        save(2)
    assert step_of() == 2 and (tmp_path / "final.old").exists()
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    save(3)  # a later save at the same name cleans up
    assert step_of() == 3 and not (tmp_path / "final.old").exists()


def test_weights_saved_under_hub_names_load_back(tmp_path):
    """save_pretrained writes GPT-NeoX's lm_head as embed_out and Mixtral's fused experts one expert at a time: read
    by their names alone, a full fine-tuning checkpoint of either did not fit its own model on --resume-from."""
    from safetensors.torch import load_file
    from transformers import (GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM, MixtralConfig,
                              MixtralForCausalLM)

    small = dict(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    mixtral = MixtralConfig(**small, num_local_experts=2, num_experts_per_tok=1)
    for model_class, config in ((GPTNeoXForCausalLM, GPTNeoXConfig(**small)), (MixtralForCausalLM, mixtral)):
        torch.manual_seed(0)
        saved = model_class(config)
        saved.save_pretrained(tmp_path / config.model_type)
        names = set(load_file(tmp_path / config.model_type / "model.safetensors"))
        assert not names >= set(saved.state_dict())  # (stored under other names than the model's own)
        torch.manual_seed(1)
        model = model_class(config)
        assert grpo.load_saved_weights(model, str(tmp_path / config.model_type)) == ([], [])
        for name, weight in saved.state_dict().items():
            assert torch.equal(model.state_dict()[name], weight), name
    # another architecture's weights are named, not loaded; weights of other shapes are load_state_dict's error
    missing, unexpected = grpo.load_saved_weights(LlamaForCausalLM(LlamaConfig(**small)), str(tmp_path / "gpt_neox"))
    assert "lm_head.weight" in missing and "embed_out.weight" in unexpected
    LlamaForCausalLM(LlamaConfig(**small)).save_pretrained(tmp_path / "llama")
    with pytest.raises(RuntimeError, match="size mismatch"):
        grpo.load_saved_weights(LlamaForCausalLM(LlamaConfig(**{**small, "hidden_size": 32})), str(tmp_path / "llama"))


def test_models_the_rollout_cannot_serve_are_one_line(tmp_path, capsys):
    """A state-space model's cache holds a recurrent state, not keys and values: the rollout crashed with an
    IndexError deep in transformers. Tokens added to a tokenizer without resizing the model crashed the embedding
    lookup (IndexError). peft's refusal of some layers (Mamba's out_proj) was a traceback under --lora-r."""
    from transformers import LlamaConfig, LlamaForCausalLM, MambaConfig, MambaForCausalLM

    mamba = MambaForCausalLM(MambaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, state_size=4))
    with pytest.raises(grpo.UserError, match=r"MambaForCausalLM\) has state-space or linear-attention layers"):
        grpo.check_attention_cache(mamba, "mamba")
    grpo.check_attention_cache(LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                                            num_attention_heads=2, intermediate_size=32)), "llama")
    with pytest.raises(grpo.UserError, match="peft cannot adapt them on MambaForCausalLM .*out_proj"):
        grpo.apply_lora(mamba, grpo.Args(lora_r=4))
    tokenizer = grpo.build_tiny_tokenizer()
    model = grpo.build_tiny_model(tokenizer)
    model.resize_token_embeddings(len(tokenizer) - 3)  # the last three characters' ids have no row
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    capsys.readouterr()  # (save_pretrained's progress bar)
    code, err = run_main(["--model", str(tmp_path / "model"), "--output-dir", str(tmp_path / "run"), *QUICK], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"past {tmp_path / 'model'}'s {len(tokenizer) - 3} embeddings" in err and "resize_token_embeddings" in err
    # LoRA on the embeddings wraps them in a layer without num_embeddings, which that check read: an AttributeError
    code, err = run_main(["--output-dir", str(tmp_path / "lora"), *QUICK, "--lora-r", "4", "--lora-target-modules",
                          "embed_tokens,q_proj"], capsys)
    assert code == 0, err


def test_prm_path_without_prm_py_beside_says_what_to_copy(tmp_path):
    """grpo.py with common.py is meant to be copied on its own; --prm-path then needs prm.py too, which was a
    ModuleNotFoundError traceback."""
    for name in ("grpo.py", "common.py"):
        shutil.copy(REPO_ROOT / name, tmp_path / name)
    (tmp_path / "a-prm").mkdir()
    process = subprocess.run([sys.executable, "grpo.py", "--prm-path", "a-prm", "--total-steps", "1", "--output-dir",
                              "run"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"})
    assert process.returncode == 2, process.stderr[-2000:]
    assert process.stderr.strip().splitlines()[-1] == ("error: --prm-path loads the PRM with prm.py's load_prm: put "
                                                       "prm.py beside grpo.py (with common.py)")
