"""prm.py under stress: bad input, non-finite losses, interruption and exact resume, two processes."""

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
from safetensors.torch import load_file, save_file

import prm
from conftest import made_dir, run_script_main
from test_prm import (QUICK, REPO_ROOT, builtin_rows, read_all_metrics, read_metrics, read_summary, run_prm,
                      write_rows)

# wall-clock and memory readings differ between any two runs; everything else in a metrics row must not
TIMING_KEYS = {"step_time_s", "memory_mb"}
ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}


def run_main(argv: list[str], capsys, with_stdout: bool = False):
    return run_script_main(prm.main, "prm.py", argv, capsys, with_stdout)


def bytes_file(tmp_path: Path, content: bytes) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    return str(path)


def rows_file(tmp_path: Path, *lines: str, name: str = "rows.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


GOOD = '{"prompt": "start 1\\n", "completions": ["1+1=2", "2+1=3"], "labels": [true, 0.5]}'
# a small data file keeps in-process runs fast (the built-in task tokenises 10,000 rows)
SMALL = ["--batch-size", "4", "--eval-every", "0", "--num-val-rows", "4", "--warmup-steps", "0"]


def small_data(tmp_path: Path, count: int = 48) -> str:
    return str(write_rows(tmp_path / "train.jsonl", builtin_rows(count)))


BAD_INPUTS = {
    # data files
    "missing data file": (lambda tmp: ["--data-path", str(tmp / "nope.jsonl")], "data file", "does not exist"),
    "data path is a directory": (lambda tmp: ["--data-path", str(tmp)], "data file", "is a directory"),
    "unreadable data (not UTF-8)": (lambda tmp: ["--data-path", bytes_file(tmp, GOOD.encode() + b"\n\xff\xfe\x00")],
                                    "rows.jsonl:2:", "not UTF-8 text"),
    "missing eval file": (lambda tmp: ["--data-path", rows_file(tmp, GOOD), "--eval-data-path",
                                       str(tmp / "eval.jsonl")], "eval.jsonl", "does not exist"),
    "invalid json": (lambda tmp: ["--data-path", rows_file(tmp, GOOD, '{"prompt": "p", oops')],
                     "rows.jsonl:2:", "invalid JSON"),
    "row not an object": (lambda tmp: ["--data-path", rows_file(tmp, GOOD, "[1, 2]")], "rows.jsonl:2:",
                          "JSON object"),
    "json array": (lambda tmp: ["--data-path", rows_file(tmp, "[1, 2]")], "rows.jsonl holds a JSON array",
                   "one object per line"),
    "missing field": (lambda tmp: ["--data-path", rows_file(tmp, GOOD, '{"prompt": "p", "completions": ["a"]}')],
                      "rows.jsonl:2:", 'needs a field "labels"'),
    "mistyped prompt": (lambda tmp: ["--data-path", rows_file(tmp, '{"prompt": 3, "completions": ["a"], '
                                                                   '"labels": [1]}')],
                        "rows.jsonl:1:", 'needs a string field "prompt"'),
    "mistyped completions": (lambda tmp: ["--data-path", rows_file(tmp, '{"prompt": "p", "completions": "a", '
                                                                        '"labels": [1]}')],
                             "rows.jsonl:1:", 'needs a field "completions", a list of strings'),
    "label count != step count": (lambda tmp: ["--data-path", rows_file(tmp, GOOD, GOOD, '{"prompt": "p", '
                                                                        '"completions": ["a", "b"], "labels": [1]}')],
                                  "rows.jsonl:3:", "1 labels for 2 steps"),
    "label above 1": (lambda tmp: ["--data-path", rows_file(tmp, '{"prompt": "p", "completions": ["a"], '
                                                                 '"labels": [1.5]}')],
                      "rows.jsonl:1:", "label 0 is 1.5"),
    "label below 0": (lambda tmp: ["--data-path", rows_file(tmp, '{"prompt": "p", "completions": ["a", "b"], '
                                                                 '"labels": [1, -1]}')],
                      "rows.jsonl:1:", "label 1 is -1"),
    "label NaN": (lambda tmp: ["--data-path", rows_file(tmp, '{"prompt": "p", "completions": ["a"], '
                                                             '"labels": [NaN]}')],
                  "rows.jsonl:1:", "label 0 is nan"),
    "label infinite": (lambda tmp: ["--data-path", rows_file(tmp, '{"prompt": "p", "completions": ["a"], '
                                                                  '"labels": [Infinity]}')],
                       "rows.jsonl:1:", "label 0 is inf"),
    "label a string": (lambda tmp: ["--data-path", rows_file(tmp, '{"prompt": "p", "completions": ["a"], '
                                                                  '"labels": ["+"]}')],
                       "rows.jsonl:1:", "label 0 is '+'"),
    "no steps": (lambda tmp: ["--data-path", rows_file(tmp, '{"prompt": "p", "completions": [], "labels": []}')],
                 "rows.jsonl:1:", "no steps to learn from"),
    "empty data set": (lambda tmp: ["--data-path", rows_file(tmp, "", "  ")], "rows.jsonl", "holds no valid rows"),
    "every row bad, skipped": (lambda tmp: ["--data-path", rows_file(tmp, "{", "[]"), "--skip-bad-rows"],
                               "rows.jsonl", "holds no valid rows (2 skipped as invalid)"),
    # truncation
    "every prompt longer than --max-length": (lambda tmp: ["--max-length", "4"], "--max-length 4",
                                              "every training row was truncated away"),
    "no first step fits": (lambda tmp: ["--data-path", rows_file(tmp, GOOD), "--max-length", "10"],
                           "--max-length 10", "every training row was truncated away"),
    # model
    "model path missing": (lambda tmp: ["--model", str(tmp / "no-model")], "no-model",
                           "it does not exist (a local path, not a hub id)"),
    "model path without a model": (lambda tmp: ["--model", str(tmp)], "could not load model", "no config.json"),
    "a separator typed as backslash-n": (lambda tmp: ["--step-separator", "\\n\\n"], "--step-separator '\\\\n\\\\n'",
                                         "in bash write $'\\n\\n' for a blank line"),
    "a run's directory as the model": (lambda tmp: ["--model", made_dir(tmp / "run", "final/config.json")],
                                       "no config.json", "; its run's model is /"),
    "a LoRA adapter as the model": (lambda tmp: ["--model", made_dir(tmp / "lora", "adapter_config.json")],
                                    "lora", "it is a LoRA adapter, not a model to start from; merge it into its base"),
    "lora target partly matching": (lambda tmp: ["--lora-r", "4", "--lora-target-modules", "q_proj,qproj"],
                                    "--lora-target-modules q_proj,qproj: no module of LlamaModel has that name (qproj)",
                                    "its linear modules include down_proj"),
    "lora target matching nothing": (lambda tmp: ["--lora-r", "4", "--lora-target-modules", "qkv,c_attn"],
                                     "--lora-target-modules qkv,c_attn: no module of LlamaModel has that name",
                                     "its linear modules include down_proj, gate_proj, k_proj, o_proj, q_proj"),
    # flags that contradict each other
    "negative lora rank": (lambda tmp: ["--lora-r", "-1"], "--lora-r", "must be >= 0"),
    "lora dropout 1": (lambda tmp: ["--lora-r", "4", "--lora-dropout", "1"], "--lora-dropout", "[0, 1)"),
    "negative peak": (lambda tmp: ["--peak-tflops", "-1"], "--peak-tflops must be >= 0", "got -1.0"),
    "micro-batch larger than batch": (lambda tmp: ["--micro-batch-size", "16"], "--micro-batch-size 16",
                                      "is larger than the batch of 8 rows"),
    "negative micro-batch": (lambda tmp: ["--micro-batch-size", "-1"], "--micro-batch-size", "must be >= 0"),
    "zero batch": (lambda tmp: ["--batch-size", "0"], "--batch-size", "at least 1"),
    "zero steps": (lambda tmp: ["--total-steps", "0"], "--total-steps", "at least 1"),
    "negative epochs": (lambda tmp: ["--epochs", "-1"], "--epochs", "must be > 0"),
    "infinite epochs": (lambda tmp: ["--epochs", "inf"], "--epochs", "must be a finite number"),
    "learning rate past float32": (lambda tmp: ["--learning-rate", "1e39"], "--learning-rate",
                                   "must be a finite number within float32's range"),
    "batch past int64": (lambda tmp: ["--batch-size", str(2**64)], "--batch-size", "must be within int64's range"),
    "rank above every layer's": (lambda tmp: ["--lora-r", "1000000"], "--lora-r 1000000",
                                 "is above the rank of every weight matrix of the model (at most 64"),
    "infinite learning rate": (lambda tmp: ["--learning-rate", "inf"], "--learning-rate", "must be a finite number"),
    "infinite weight decay": (lambda tmp: ["--weight-decay", "inf"], "--weight-decay", "must be a finite number"),
    "meta device": (lambda tmp: ["--device", "meta"], "--device meta", "a meta device holds no data to train on"),
    "LoRA settings without LoRA": (lambda tmp: ["--lora-dropout", "0.5"], "--lora-dropout",
                                   "LoRA settings, but --lora-r 0 (full fine-tuning) makes no adapters"),
    "no module to adapt": (lambda tmp: ["--lora-r", "2", "--lora-target-modules", " , "], "--lora-target-modules",
                           "names no module"),
    "empty separator": (lambda tmp: ["--step-separator", ""], "--step-separator", "must not be empty"),
    "negative learning rate": (lambda tmp: ["--learning-rate", "-1"], "--learning-rate", ">= 0"),
    "zero max bad steps": (lambda tmp: ["--max-bad-steps", "0"], "--max-bad-steps", "at least 1"),
    "keep no checkpoints": (lambda tmp: ["--keep-checkpoints", "0"], "--keep-checkpoints", "at least 1"),
    "fsdp on CPU": (lambda tmp: ["--fsdp"], "--fsdp", "needs CUDA"),
    "unknown device": (lambda tmp: ["--device", "foo"], "--device 'foo'", "is not a device"),
    # where the scores go: found out before training, not after it
    "scores output is a directory": (lambda tmp: ["--score-data-path", rows_file(tmp, GOOD), "--scores-output",
                                                  str(tmp)], "--scores-output", "is a directory"),
    "scores output below a file": (lambda tmp: ["--score-data-path", rows_file(tmp, GOOD), "--scores-output",
                                                rows_file(tmp, GOOD) + "/scores.jsonl"], "--scores-output",
                                   "its directory cannot be created, "),
    "scores output not writable": (lambda tmp: ["--score-data-path", rows_file(tmp, GOOD), "--scores-output",
                                                "/proc/1/scores.jsonl"], "--scores-output",
                                   "/proc/1 cannot be written to"),
    "scores output without rows to score": (lambda tmp: ["--scores-output", str(tmp / "scores.jsonl")],
                                            "--scores-output", "give --score-data-path rows.jsonl too"),
    "negative seed": (lambda tmp: ["--seed", "-1"], "--seed", "must be in [0, 2**32), got -1"),
    "lora alpha of 0": (lambda tmp: ["--lora-r", "4", "--lora-alpha", "0"], "--lora-alpha", "must be > 0"),
    "device this torch has no support for": (lambda tmp: ["--device", "mps"], "--device mps", "not usable here"),
    "held-out rows beyond the built-in pool": (lambda tmp: ["--num-val-rows", "1000", "--num-eval-rows", "1001"],
                                               "--num-val-rows + --num-eval-rows", "must be at most that, got 2001"),
    # resuming
    "resume from nothing": (lambda tmp: ["--resume-from", str(tmp)], "--resume-from",
                            "not a checkpoint written by prm.py"),
    "resume latest, no checkpoint": (lambda tmp: ["--resume-from", "latest"], "--resume-from latest",
                                     "no checkpoint-* directory"),
    "resume from a missing path": (lambda tmp: ["--resume-from", str(tmp / "run" / "checkpoint-3")],
                                   "checkpoint-3", "does not exist: pass a checkpoint-STEP directory"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_clear_line(case, tmp_path, capsys):
    flags, where, message = BAD_INPUTS[case]
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *QUICK, *flags(tmp_path)], capsys)
    assert code == 2, err
    *before, last = err.strip().splitlines()
    # one error line, no traceback (only --skip-bad-rows warnings may come before it)
    assert last.startswith("error: ") and all(line.startswith("warning: ") for line in before), err
    assert where in last and message in last, err
    assert not out.exists()  # nothing written


def test_max_length_beyond_the_models_positions(tmp_path, capsys):
    """GPT-2 learns a table of positions and has no row past it: a --max-length beyond it is an error up front
    (it was an IndexError at the first evaluation, after metrics.jsonl was created). Rotary positions run on past
    the trained context: a warning, and the run goes on."""
    from transformers import GPT2Config, GPT2Model

    tokenizer = prm.build_tiny_tokenizer()
    gpt2 = tmp_path / "gpt2"
    GPT2Model(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tokenizer), n_positions=16)
              ).save_pretrained(gpt2)
    tokenizer.save_pretrained(gpt2)
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *QUICK, "--model", str(gpt2), "--max-length", "64"], capsys)
    assert code == 2 and err.endswith("error: --max-length 64 exceeds the model's 16 positions: pass --max-length 16 "
                                      "or less\n")
    assert not out.exists()
    code, err = run_main(["--output-dir", str(out), *QUICK, "--total-steps", "1", "--max-length", "2048"], capsys)
    assert code == 0 and "warning: --max-length 2048 exceeds the model's 1024 positions" in err

    from transformers import OPTConfig, OPTModel

    opt = tmp_path / "opt"  # OPT's learned table has 2 rows more than its positions
    OPTModel(OPTConfig(hidden_size=32, word_embed_proj_dim=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=2,
                       vocab_size=len(tokenizer), max_position_embeddings=16)).save_pretrained(opt)
    tokenizer.save_pretrained(opt)
    code, err = run_main(["--output-dir", str(tmp_path / "opt_out"), *QUICK, "--model", str(opt), "--max-length",
                          "64"], capsys)
    assert code == 2 and "--max-length 64 exceeds the model's 16 positions: pass --max-length 16" in err


def test_a_lora_prm_whose_base_model_moved_is_named(tmp_path):
    # prm_config.json keeps a local base model's absolute path: once it has moved, say which field to fix
    saved = tmp_path / "prm"
    prm.build_tiny_tokenizer().save_pretrained(saved)
    (saved / "prm_config.json").write_text(json.dumps({"lora": True, "backbone": str(tmp_path / "moved_away")}))
    for name in ("adapter_model.safetensors", "reward_head.safetensors"):  # (the base is found missing before them)
        (saved / name).touch()
    with pytest.raises(prm.UserError, match=r'moved_away \("backbone" in prm_config.json\) does not exist'):
        prm.load_prm(str(saved), device="cpu")


def test_score_steps_refuses_a_solution_given_as_one_string():
    """Forgetting split_steps: a string is iterable, and each character was scored as a step."""
    torch.manual_seed(0)
    model, _ = prm.build_prm(prm.Args(), torch.float32)
    with pytest.raises(TypeError, match="a list of steps .split_steps"):
        prm.score_steps(model, ["start 5\n"], ["5+3=8\n8-2=6"])
    with pytest.raises(TypeError, match="a string would be scored character by character"):
        prm.score_steps(model, "start 5\n", [["5+3=8", "8-2=6"]])
    assert [len(scores) for scores in prm.score_steps(model, ["start 5\n"], [["5+3=8", "8-2=6"]])] == [2]


def test_scoring_under_torchrun_is_refused(tmp_path, capsys, monkeypatch):
    # every process would score every row and write the same file: one of them crashed renaming it
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, err = run_main(["--prm-path", str(tmp_path), "--score-data-path", rows_file(tmp_path, '{"prompt": "p", '
                          '"completions": ["a"]}'), "--scores-output", str(tmp_path / "scores.jsonl")], capsys)
    assert code == 2 and "scores in one process: run it with python prm.py, not torchrun" in err


def test_scoring_mode_bad_inputs(tmp_path, capsys):
    data = rows_file(tmp_path, '{"prompt": "p", "completions": ["a"]}')
    scores = tmp_path / "scores.jsonl"
    code, err = run_main(["--prm-path", str(tmp_path), "--score-data-path", data], capsys)
    assert code == 2 and "give --score-data-path rows.jsonl and --scores-output" in err and err.count("\n") == 1
    code, err = run_main(["--prm-path", str(tmp_path), "--score-data-path", data, "--scores-output", str(scores)],
                         capsys)
    assert code == 2 and "is not a PRM saved by prm.py" in err and err.count("\n") == 1
    # a path that is not there, and a run's directory for its final PRM, are said as such
    code, err = run_main(["--prm-path", str(tmp_path / "nope"), "--score-data-path", data, "--scores-output",
                          str(scores)], capsys)
    assert code == 2 and f"'{tmp_path / 'nope'}' does not exist: pass the final/ or a checkpoint-STEP/" in err
    made_dir(tmp_path / "run", "final/prm_config.json")
    code, err = run_main(["--prm-path", str(tmp_path / "run"), "--score-data-path", data, "--scores-output",
                          str(scores)], capsys)
    assert code == 2 and f"(no prm_config.json in it); its run's PRM is {tmp_path / 'run' / 'final'}" in err
    code, err = run_main(["--prm-path", str(tmp_path), "--score-data-path", str(tmp_path / "no.jsonl"),
                          "--scores-output", str(scores)], capsys)
    assert code == 2 and "does not exist" in err and err.count("\n") == 1
    code, err = run_main(["--prm-path", str(tmp_path), "--score-data-path", data, "--scores-output", str(tmp_path)],
                         capsys)
    assert code == 2 and f"--scores-output {tmp_path} is a directory" in err and err.count("\n") == 1
    code, err = run_main(["--prm-path", str(tmp_path), "--score-data-path", data, "--scores-output",
                          str(tmp_path / "." / "rows.jsonl")], capsys)
    assert code == 2 and "is the --score-data-path file: the scores would replace the rows they score" in err
    code, err = run_main(["--output-dir", str(tmp_path), *SMALL, "--score-data-path", str(tmp_path / "scores.jsonl")],
                         capsys)  # a training run's default scores file: its --output-dir's scores.jsonl
    assert code == 2 and "is the --score-data-path file" in err, err
    code, err = run_main(["--prm-path", str(tmp_path), "--score-data-path", data, "--scores-output", str(scores),
                          "--device", "foo"], capsys)
    assert code == 2 and err == "error: --device 'foo' is not a device; use auto, cpu, cuda or cuda:N\n"
    # training flags are refused, not ignored: the saved PRM fixes the model, its LoRA and its loss
    code, err = run_main(["--prm-path", str(tmp_path), "--score-data-path", data, "--scores-output", str(scores),
                          "--model", "other", "--lora-r", "8", "--loss-kind", "mse"], capsys)
    assert code == 2 and err == ("error: --model, --lora-r, --loss-kind: training flags, which scoring with "
                                 "--prm-path does not use; drop them\n")
    for size in ("0", "-1"):  # (-1 wrote an empty list of scores for every row, 0 crashed)
        code, err = run_main(["--prm-path", str(tmp_path), "--score-data-path", data, "--scores-output", str(scores),
                              "--eval-batch-size", size], capsys)
        assert code == 2 and err == f"error: --eval-batch-size must be at least 1, got {size}\n"
    assert not scores.exists()
    # a saved PRM scores with its own separator and max length: other ones given are an error, not ignored unsaid
    model, _ = prm.build_prm(prm.Args(), torch.float32)
    prm.save_prm(str(tmp_path / "prm"), model)
    for flag, value, own in (("--max-length", "64", "1024"), ("--step-separator", "\n\n", "'\\n'")):
        code, err = run_main(["--prm-path", str(tmp_path / "prm"), "--score-data-path", data, "--scores-output",
                              str(scores), flag, value], capsys)
        assert code == 2 and err.splitlines()[-1] == (  # (after transformers' progress bars)
            f"error: {flag} {value if flag == '--max-length' else repr(value)}: {tmp_path / 'prm'} was trained "
            f"with {own}, which scoring uses; drop the flag")
    assert run_main(["--prm-path", str(tmp_path / "prm"), "--score-data-path", data, "--scores-output", str(scores),
                     "--max-length", str(prm.Args().max_length)], capsys)[0] == 0  # its own value: fine


def test_rows_to_score_are_tokenised_before_training_and_scoring(tmp_path, capsys):
    """A row of --score-data-path with a step that is no token at all (a blank step, with a separator the tokenizer
    drops) was found only when scoring, after training had written final/ and metrics.jsonl: a traceback, exit
    code 1. Now one line naming the file and line, exit code 2, before anything is written; scoring with a saved
    PRM says the same before writing the scores. A training row with such a step is named by its file and line
    too (it was named by its place after the shuffle); --skip-bad-rows skips both kinds, each counted."""
    from test_prm import whitespace_dropping_tokenizer

    tokenizer = whitespace_dropping_tokenizer()
    model_dir = tmp_path / "wordpiece"
    prm.build_tiny_backbone(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    capsys.readouterr()  # the save's progress bar
    good_rows = [json.dumps({"prompt": "start 3", "completions": ["3+1=4", "4-2=2"], "labels": [1, k % 2]})
                 for k in range(12)]
    train_rows = rows_file(tmp_path, *good_rows, name="train.jsonl")
    to_score = rows_file(tmp_path, '{"prompt": "start 3", "completions": ["3+1=4"]}',
                         '{"prompt": "start 4", "completions": ["4+1=5", " "], "id": 2}', name="score.jsonl")
    out, scores = tmp_path / "out", tmp_path / "scores.jsonl"
    flags = [*SMALL, "--model", str(model_dir), "--data-path", train_rows, "--total-steps", "1", "--num-eval-rows",
             "0", "--score-data-path", to_score]
    code, err = run_main(["--output-dir", str(out), *flags], capsys)
    last = err.strip().splitlines()[-1]  # (after transformers' progress bar of loading the model)
    assert code == 2 and "Traceback" not in err and last == (
        f"error: {to_score}:2: step 1 (' ') with the separator '\\n' is no token at all, so no token can carry its "
        "label or score: this tokenizer drops the separator; remove empty steps, or pick a --step-separator that "
        "the tokenizer keeps (--skip-bad-rows skips such rows)")
    assert not out.exists()
    to_score_well = rows_file(tmp_path, '{"prompt": "start 3", "completions": ["3+1=4"]}', name="good.jsonl")
    code, err = run_main(["--output-dir", str(out), *flags[:-1], to_score_well], capsys)
    assert code == 0, err
    code, err = run_main(["--prm-path", str(out / "final"), "--score-data-path", to_score, "--scores-output",
                          str(scores)], capsys)
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: {to_score}:2: step 1 (' ')")
    # skipped: the row keeps its line, with why, and is counted
    code, stdout, err = run_main(["--prm-path", str(out / "final"), "--score-data-path", to_score, "--scores-output",
                                  str(scores), "--skip-bad-rows"], capsys, with_stdout=True)
    assert code == 0 and f"warning: skipped {to_score}:2: step 1 (' ')" in err, err
    assert f"scored 1 steps of 1 rows into {scores} (0 steps truncated away, 1 rows skipped)" in stdout
    written = [json.loads(line) for line in scores.read_text().splitlines()]
    assert len(written[0]["scores"]) == 1 and written[1]["id"] == 2 and written[1]["scores"] is None
    assert written[1]["skipped"].startswith(f"{to_score}:2: step 1 (' ')")

    # a training row: found after the shuffle, still named by its line
    blank_step = json.dumps({"prompt": "start 4", "completions": ["4+1=5", " "], "labels": [1, 0]})
    with_blank = rows_file(tmp_path, *good_rows[:4], blank_step, *good_rows[4:], name="blank.jsonl")
    flags = [*SMALL, "--model", str(model_dir), "--data-path", with_blank, "--total-steps", "1", "--num-eval-rows",
             "0", "--output-dir", str(tmp_path / "blank")]
    code, err = run_main(flags, capsys)
    assert code == 2 and err.strip().splitlines()[-1].startswith(f"error: {with_blank}:5: step 1 (' ')"), err
    code, err = run_main([*flags, "--skip-bad-rows"], capsys)
    assert code == 0 and f"warning: skipped {with_blank}:5: step 1 (' ')" in err, err
    summary = read_summary(tmp_path / "blank")
    assert summary["skipped_rows"] == 1 and summary["train_rows"] == 12


@pytest.mark.parametrize("lora", [False, True])
def test_an_incomplete_saved_prm_is_one_clear_line(lora, tmp_path, capsys):
    """A saved PRM missing its weights or head (a copy cut short) ended in a FileNotFoundError or OSError traceback,
    as did a LoRA PRM whose base model cannot be loaded (here a directory without a model; a hub name that cannot
    be reached fails the same way)."""
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--total-steps",
                          "1", "--num-eval-rows", "0", *(["--lora-r", "4"] if lora else [])], capsys)
    assert code == 0, err
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    for missing in (weights, "reward_head.safetensors"):
        cut_short = tmp_path / f"without-{missing}"
        shutil.copytree(out / "final", cut_short)
        (cut_short / missing).unlink()
        with pytest.raises(prm.UserError, match=f"is an incomplete PRM: no {re.escape(missing)} in it"):
            prm.load_prm(str(cut_short), device="cpu")
    if lora:
        config = json.loads((out / "final" / "prm_config.json").read_text())
        empty = tmp_path / "empty"
        empty.mkdir()
        (out / "final" / "prm_config.json").write_text(json.dumps({**config, "backbone": str(empty)}))
        with pytest.raises(prm.UserError, match=f"cannot load its LoRA adapter's base model '{empty}'"):
            prm.load_prm(str(out / "final"), device="cpu")


def test_existing_run_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "notes.txt").write_text("mine")
    code, err = run_main(["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path)], capsys)
    assert code == 2 and "already holds a run, stopped before its first checkpoint: pass --overwrite" in err
    assert "--resume-from" not in err and err.count("\n") == 1
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "notes.txt"]
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
    code, err = run_main(["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--total-steps",
                          "1", "--overwrite"], capsys)
    assert code == 0, err
    assert len(read_metrics(out)) == 1 and (out / "final").is_dir()
    assert (out / "notes.txt").read_text() == "mine"  # --overwrite removes the run's files, nothing else
    # with a checkpoint or a final model there is something to continue
    code, err = run_main(["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path)], capsys)
    assert code == 2 and "already holds a run: pass --overwrite to replace it, --resume-from latest" in err


def test_output_dir_that_is_a_file_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("not a directory")
    code, err = run_main(["--output-dir", str(out), *QUICK], capsys)
    assert code == 2 and err == f"error: --output-dir {out} exists and is not a directory\n"
    # and a directory that would have to be made below a file, refused before any training
    code, err = run_main(["--output-dir", str(out / "run"), *QUICK], capsys)
    assert code == 2 and err == (f"error: --output-dir {out / 'run'} cannot be created: {out} is a file; choose "
                                 "another --output-dir\n")
    assert out.read_text() == "not a directory"


def test_a_model_directory_without_a_tokenizer_is_one_complete_line(tmp_path, capsys):
    model_dir = str(tmp_path / "no-tokenizer")
    prm.build_tiny_backbone(prm.build_tiny_tokenizer()).save_pretrained(model_dir)
    capsys.readouterr()  # the save's progress bar
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *QUICK, "--model", model_dir], capsys)
    assert code == 2 and err == (f"error: could not load model {model_dir!r}: the directory has no tokenizer; save the "
                                 f"model's tokenizer into it with tokenizer.save_pretrained({model_dir!r})\n")
    assert not out.exists()


def test_a_cuda_device_without_an_index_is_the_local_rank_and_a_bad_device_is_refused(tmp_path, capsys,
                                                                                       monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "device_count", lambda: 4)  # the mapping alone, on any machine
        assert prm.resolve_device("cuda", local_rank=0) == torch.device("cuda:0")
        assert prm.resolve_device("cuda", local_rank=2) == torch.device("cuda:2")  # torchrun's LOCAL_RANK 2
        assert prm.resolve_device("cuda:1", local_rank=2) == torch.device("cuda:1")
        assert prm.resolve_device("cpu", local_rank=2) == torch.device("cpu")
        with pytest.raises(prm.UserError, match=r"--device cuda:4: there is no cuda:4 here \(4 CUDA devices"):
            prm.resolve_device("cuda:4", local_rank=0)
        assert prm.resolve_device("cuda", local_rank=1, local_processes=2) == torch.device("cuda:1")
    # torchrun's 2 processes on this machine of 2 GPUs would share GPU 0 (NCCL refuses that): refused at once
    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "device_count", lambda: 2)
        patch.setenv("WORLD_SIZE", "2")
        patch.setenv("LOCAL_WORLD_SIZE", "2")
        code, err = run_main(["--output-dir", str(out), *QUICK, "--device", "cuda:0"], capsys)
    assert code == 2 and err.startswith("error: --device cuda:0 puts every one of the 2 processes on this machine on")
    assert "use --device cuda (each process takes GPU LOCAL_RANK)" in err and not out.exists()
    code, err = run_main(["--output-dir", str(out), *QUICK, "--device", "foo"], capsys)
    assert code == 2 and err == "error: --device 'foo' is not a device; use auto, cpu, cuda or cuda:N\n"
    if not torch.cuda.is_available():  # a GPU asked for where there is none
        code, err = run_main(["--output-dir", str(out), *QUICK, "--device", "cuda"], capsys)
        assert code == 2 and err == ("error: --device cuda: there is no cuda:0 here (0 CUDA devices visible); use "
                                     "--device cpu or auto\n")
    assert not out.exists()


def test_a_prompt_longer_than_max_length_is_dropped_and_counted(tmp_path, capsys):
    rows = builtin_rows(20) + [{"prompt": "start 1" * 20 + "\n", "completions": ["1+1=2"], "labels": [1]}]
    data = write_rows(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out"
    code, stdout, err = run_main(["--output-dir", str(out), *SMALL, "--total-steps", "1", "--data-path", str(data),
                                  "--max-length", "60", "--num-val-rows", "0"], capsys, with_stdout=True)
    assert code == 0, err
    assert "dropped 1 steps that did not fit whole, and 1 rows left with no step" in stdout
    summary = read_summary(out)
    assert summary["dropped_rows"] == 1 and summary["dropped_steps"] == 1 and summary["train_rows"] == 20


def test_a_backbone_that_is_not_causal_is_refused(tmp_path, capsys):
    """A bidirectional encoder would let each step's score see the steps after it: refused before training, as is an
    encoder-decoder, which cannot encode a sequence on its own (it raised a ValueError from its forward)."""
    from transformers import BertConfig, BertModel, T5Config, T5Model

    tokenizer = prm.build_tiny_tokenizer()
    models = {"bert": BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                           intermediate_size=64, vocab_size=len(tokenizer), pad_token_id=0)),
              "t5": T5Model(T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16,
                                     vocab_size=len(tokenizer)))}
    expected = {"bert": "is not causal: changing a sequence's last token changes the hidden states before it",
                "t5": "its base model cannot encode a token sequence on its own"}
    for name, model in models.items():
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        out = tmp_path / f"out-{name}"
        code, err = run_main(["--output-dir", str(out), *QUICK, "--model", str(tmp_path / name)], capsys)
        assert code == 2 and expected[name] in err and "use a decoder-only (causal LM) model" in err, err
        assert not (out / "final").exists()


def test_a_run_without_held_out_rows_prints_and_logs_no_evaluation(tmp_path, capsys):
    """--data-path without --eval-data-path holds nothing to evaluate: no 'eval at step ... nan' lines, and no
    columns of null eval figures in metrics.jsonl; the summary keeps its keys, as null."""
    out = tmp_path / "run"
    code, stdout, err = run_main(["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path),
                                  "--total-steps", "4", "--eval-every", "2"], capsys, with_stdout=True)
    assert code == 0, err
    assert "eval at step" not in stdout and "step 4 |" in stdout
    assert [sorted(key for key in row if key.startswith("eval_")) for row in read_metrics(out)] == [[]] * 4
    assert read_summary(out)["eval_auroc_end"] is None  # NaN, written as null


def test_a_saved_prm_given_as_model_keeps_its_trained_head(tmp_path, capsys):
    """--model final/ of a full fine-tuning run is a model directory: training goes on from its head too, so with a
    zero learning rate the new run starts where the saved one ended (a new random head started from chance). A LoRA
    PRM is an adapter, refused with what to do instead."""
    first, second = tmp_path / "first", tmp_path / "second"
    code, err = run_main(["--output-dir", str(first), *QUICK, "--total-steps", "12", "--learning-rate", "3e-3",
                          "--eval-every", "0"], capsys)
    assert code == 0, err
    code, out, err = run_main(["--output-dir", str(second), *QUICK, "--total-steps", "1", "--learning-rate", "0",
                               "--model", str(first / "final")], capsys, with_stdout=True)
    assert code == 0, err
    assert f"--model {first / 'final'} is a PRM saved by prm.py: training starts from its reward head too" in out
    trained, continued = read_summary(first), read_summary(second)
    assert trained["eval_auroc_end"] != pytest.approx(trained["eval_auroc_start"], abs=0.05)  # it did learn
    for key in ("eval_auroc", "eval_step_accuracy", "eval_first_error_f1"):
        assert continued[f"{key}_start"] == pytest.approx(trained[f"{key}_end"], abs=1e-6), key
    for flags, named in ((["--loss-kind", "mse"], "--loss-kind 'bce'"),
                         (["--step-separator", " ки"], "--step-separator '\\n'")):
        code, err = run_main(["--output-dir", str(tmp_path / "third"), *QUICK, "--model", str(first / "final"),
                              *flags], capsys)
        assert code == 2 and f"is a PRM trained with {named}, which its head was trained for" in err, err
    lora = tmp_path / "lora"
    code, err = run_main(["--output-dir", str(lora), *QUICK, "--total-steps", "1", "--lora-r", "4"], capsys)
    assert code == 0, err
    code, err = run_main(["--output-dir", str(tmp_path / "third"), *QUICK, "--model", str(lora / "final")], capsys)
    assert code == 2 and "is a PRM that prm.py trained with LoRA" in err and "its base model (tiny)" in err, err


def test_a_held_out_row_with_no_step_kept_is_still_evaluated(tmp_path, capsys):
    """Its first error was truncated away: it counts in first-error F1 as a miss, not left out (which raised F1)."""
    train = write_rows(tmp_path / "train.jsonl", builtin_rows(20))
    held_out = builtin_rows(10) + [{"prompt": "start 1" * 20 + "\n", "completions": ["1+1=3"], "labels": [0]}]
    eval_path = write_rows(tmp_path / "eval.jsonl", held_out)
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *SMALL, "--total-steps", "1", "--data-path", str(train),
                          "--eval-data-path", str(eval_path), "--max-length", "60", "--num-val-rows", "0"], capsys)
    assert code == 0, err
    summary = read_summary(out)
    assert summary["dropped_rows"] == 1 and summary["eval_rows"] == 11 and summary["train_rows"] == 20


def test_skip_bad_rows_skips_and_counts_every_kind(tmp_path, capsys, monkeypatch):
    bad = ['{"prompt": "p", oops', '[1]', '{"prompt": "p", "completions": ["a"]}',
           '{"prompt": "p", "completions": ["a"], "labels": [2]}',
           '{"prompt": "p", "completions": ["a"], "labels": [NaN]}',
           '{"prompt": "p", "completions": ["a", "b"], "labels": [1]}']
    good = [json.dumps(row) for row in builtin_rows(30)]
    data = rows_file(tmp_path, *good[:10], *bad, *good[10:])
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *SMALL, "--total-steps", "1", "--data-path", data,
                          "--skip-bad-rows"], capsys)
    assert code == 0, err
    assert all(f"rows.jsonl:{line}:" in err for line in range(11, 16))  # the first five are named
    assert "skipped 6 invalid rows" in err
    assert read_summary(out)["skipped_rows"] == 6 and read_summary(out)["train_rows"] == 30  # (no eval: no validation)
    # under torchrun every process reads the file: the warnings are printed once, by rank 0
    monkeypatch.setenv("RANK", "1")
    assert prm.load_jsonl_rows(data, skip_bad_rows=True)[1] == 6 and capsys.readouterr().err == ""


@pytest.mark.parametrize("pad", ["none", "past the embeddings"])
def test_tokenizer_without_a_usable_pad_token_falls_back_to_eos(pad, tmp_path, capsys):
    """No pad token, or one added to the tokenizer without resizing the model's embeddings (an IndexError at the
    first padded batch): rows are padded with EOS instead."""
    model_dir = tmp_path / "nopad"
    tokenizer = prm.build_tiny_tokenizer()
    prm.build_tiny_backbone(tokenizer).save_pretrained(model_dir)
    if pad == "past the embeddings":
        tokenizer.add_special_tokens({"pad_token": "<newpad>"})
    tokenizer.save_pretrained(model_dir)
    if pad == "none":
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        config.pop("pad_token", None)
        (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    code, stdout, err = run_main(["--output-dir", str(out), *SMALL, "--total-steps", "1", "--data-path",
                                  small_data(tmp_path), "--model", str(model_dir), "--no-pack-rows"], capsys,
                                 with_stdout=True)
    assert code == 0, err
    problem = "no pad token" if pad == "none" else "a pad id past the model's"
    assert f"has {problem}" in stdout and "using EOS ('<eos>') to pad" in stdout
    assert len(read_metrics(out)) == 1 and (out / "final" / "reward_head.safetensors").is_file()


def test_an_eval_file_replaces_the_builtin_eval_rows(tmp_path, capsys):
    # built-in training rows with an eval file of 5 rows (and a bad line, skipped and counted)
    rows = builtin_rows(5, seed=11)
    eval_file = write_rows(tmp_path / "eval.jsonl", [*rows, "{"])
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), "--total-steps", "1", "--batch-size", "4", "--eval-every", "0",
                          "--num-val-rows", "8", "--num-eval-rows", "20", "--eval-data-path", str(eval_file),
                          "--skip-bad-rows"], capsys)
    assert code == 0, err
    summary = read_summary(out)
    assert summary["eval_rows"] == 5 and summary["skipped_rows"] == 1
    # the end-of-run metrics are the final model's on these 5 rows
    model = prm.load_prm(str(out / "final"), device="cpu")
    scores = prm.score_steps(model, [row["prompt"] for row in rows], [row["completions"] for row in rows])
    expected = prm.evaluate(scores, [row["labels"] for row in rows], summary["eval_first_error_threshold_end"])
    for key, value in expected.items():
        assert summary[f"{key}_end"] == pytest.approx(value, rel=1e-5), key


def test_the_logged_learning_rate_is_the_one_each_update_used(tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--total-steps", "3",
                          "--warmup-steps", "2", "--lr-schedule", "cosine", "--learning-rate", "0.004"], capsys)
    assert code == 0, err
    factor = prm.lr_lambda(prm.Args(warmup_steps=2, lr_schedule="cosine"), 3)
    logged = [row["learning_rate"] for row in read_metrics(out)]
    assert logged == [0.004 * factor(update) for update in range(3)]
    assert logged[:2] == [0.002, 0.004]  # by hand: half the rate in the first of 2 warm-up steps, all of it next


def nan_on_calls(monkeypatch, bad_calls):
    """prm_loss returning NaN on the given (1-based) training calls: one call per step without micro-batches."""
    real_loss, calls = prm.prm_loss, {"n": 0}

    def patched(*args, **kwargs):
        calls["n"] += 1
        loss, stats = real_loss(*args, **kwargs)
        return (loss * float("nan") if bad_calls(calls["n"]) else loss), stats

    monkeypatch.setattr(prm, "prm_loss", patched)


def test_non_finite_loss_skips_updates_then_stops(tmp_path, capsys, monkeypatch):
    nan_on_calls(monkeypatch, lambda n: True)
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--total-steps",
                          "10", "--max-bad-steps", "3"], capsys)
    assert code == 2 and "3 updates in a row had a non-finite loss or gradient" in err
    assert err.count("update skipped") == 3 and err.strip().splitlines()[-1].startswith("error: ")
    metrics = read_metrics(out)
    assert [row["skipped_updates"] for row in metrics] == [1, 2, 3]  # step 3, which stopped the run, logged too
    assert metrics[-1]["step"] == 3 and metrics[-1]["loss"] is None
    assert not (out / "final").exists()


def test_an_isolated_non_finite_loss_is_skipped_and_counted(tmp_path, capsys, monkeypatch):
    nan_on_calls(monkeypatch, lambda n: n in (2, 4))
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--total-steps",
                          "5", "--max-bad-steps", "2"], capsys)
    assert code == 0, err
    assert "non-finite loss or gradient at step 2; update skipped" in err and err.count("update skipped") == 2
    metrics = read_metrics(out)
    assert [row["skipped_updates"] for row in metrics] == [0, 1, 1, 2, 2]
    assert metrics[1]["loss"] is None and metrics[4]["loss"] is not None  # NaN (written as null), then not
    assert read_summary(out)["skipped_updates"] == 2
    weights = load_file(out / "final" / "model.safetensors")
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())


def test_keep_checkpoints_keeps_the_newest_and_a_checkpoint_is_complete(tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--total-steps",
                          "4", "--save-every", "1", "--keep-checkpoints", "2"], capsys)
    assert code == 0, err
    assert prm.checkpoint_steps(str(out)) == [3, 4] and not list(out.glob("*.tmp"))
    checkpoint = out / "checkpoint-4"
    for name in ("model.safetensors", "reward_head.safetensors", "tokenizer.json", "prm_config.json", "args.json"):
        assert (checkpoint / name).is_file(), name
    assert json.loads((checkpoint / "args.json").read_text())["script"] == "prm.py"
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
    assert state["step"] == 4 and state["data_position"] == {"epoch": 0, "row_in_epoch": 16}
    assert {"optimizer", "scheduler", "rng", "master", "eval_start", "data_fingerprint"} <= state.keys()
    assert {"python", "numpy", "torch", "cuda"} <= state["rng"][0].keys()
    # the checkpoint of the last step is the final model
    final, last = load_file(out / "final" / "model.safetensors"), load_file(checkpoint / "model.safetensors")
    assert all(torch.equal(final[name], last[name]) for name in final)
    assert prm.load_prm(str(checkpoint), device="cpu").config["base_model"] == "tiny"  # a checkpoint is a PRM


def copy_run_up_to(source: Path, target: Path, step: int) -> None:
    """target: source's checkpoint-STEP and its metrics rows up to STEP, plus a later row a crash left behind."""
    import shutil

    shutil.copytree(source / f"checkpoint-{step}", target / f"checkpoint-{step}")
    rows = (source / "metrics.jsonl").read_text().splitlines()
    kept = [row for row in rows if json.loads(row)["step"] <= step]  # the start evaluation's row too
    (target / "metrics.jsonl").write_text("\n".join(rows[:len(kept) + 1]) + "\n")  # row step+1 must be dropped


def comparable(rows: list[dict]) -> list[str]:
    """Rows without timings, as JSON text: exact to the last digit (floats round-trip), and NaN equals NaN."""
    return [json.dumps({k: v for k, v in row.items() if k not in TIMING_KEYS}, sort_keys=True) for row in rows]


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name].float() - b[name].float()).abs().max().item() for name in a)


def test_lora_resume_with_dropout_matches_an_uninterrupted_run(tmp_path, capsys):
    # LoRA dropout draws from torch's RNG every step: only a restored RNG state gives the same numbers
    flags = [*SMALL, "--data-path", small_data(tmp_path), "--total-steps", "6", "--save-every", "3",
             "--lora-r", "4", "--lora-dropout", "0.2", "--eval-every", "2", "--num-eval-rows", "16",
             "--eval-data-path", small_data(tmp_path), "--micro-batch-size", "3", "--lr-schedule", "cosine"]
    straight = tmp_path / "straight"
    code, err = run_main(["--output-dir", str(straight), *flags], capsys)
    assert code == 0, err
    resumed = tmp_path / "resumed"
    copy_run_up_to(straight, resumed, 3)
    code, out, err = run_main([*flags, "--resume-from", str(resumed / "checkpoint-3")], capsys, with_stdout=True)
    assert code == 0, err  # --output-dir defaults to the checkpoint's own run directory
    assert f"resumed from {resumed / 'checkpoint-3'} at step 3" in out
    assert comparable(read_all_metrics(resumed)) == comparable(read_all_metrics(straight))
    for name in ("adapter_model.safetensors", "reward_head.safetensors"):
        assert max_difference(load_file(straight / "final" / name), load_file(resumed / "final" / name)) == 0.0
    a, b = read_summary(straight), read_summary(resumed)
    assert b["steps"] == 6 and b["resumed_from_step"] == 3
    assert comparable([{k: v for k, v in a.items() if k.startswith("eval_")}]) == comparable(
        [{k: v for k, v in b.items() if k.startswith("eval_")}])


def test_resume_applies_a_changed_learning_rate_weight_decay_and_betas(tmp_path, capsys):
    flags = [*SMALL, "--data-path", small_data(tmp_path), "--total-steps", "3", "--save-every", "1",
             "--keep-checkpoints", "3", "--warmup-steps", "2", "--learning-rate", "0.001"]
    old = tmp_path / "old"
    code, err = run_main(["--output-dir", str(old), *flags], capsys)
    assert code == 0, err
    new = tmp_path / "new"
    copy_run_up_to(old, new, 2)
    changed = ["--learning-rate", "0.004", "--weight-decay", "0.1", "--adam-betas", "0.8", "0.9"]
    code, stdout, err = run_main([*flags, *changed, "--output-dir", str(new), "--resume-from", "latest"], capsys,
                                 with_stdout=True)
    assert code == 0, err
    assert ("note: --learning-rate 0.001 in the checkpoint, 0.004 now applies; --weight-decay 0.0 in the checkpoint, "
            "0.1 now applies; --adam-betas (0.9, 0.99) in the checkpoint, (0.8, 0.9) now applies") in stdout
    factor = prm.lr_lambda(prm.Args(warmup_steps=2), 3)
    learning_rate, weight_decay, (beta1, beta2) = 0.004 * factor(2), 0.1, (0.8, 0.9)
    assert read_metrics(new)[2]["learning_rate"] == learning_rate
    # the checkpoint after the resumed step holds the new settings, the rate where the schedule has it
    state = torch.load(new / "checkpoint-3" / "trainer_state.pt", weights_only=True)
    matrices, vectors = state["optimizer"]["param_groups"]  # decayed; not (norm gains, biases)
    assert state["scheduler"]["base_lrs"] == [0.004, 0.004] and matrices["initial_lr"] == vectors["initial_lr"] == 0.004
    assert (matrices["lr"], matrices["weight_decay"], tuple(matrices["betas"])) == (0.004 * factor(3), 0.1, (0.8, 0.9))
    assert (vectors["lr"], vectors["weight_decay"], tuple(vectors["betas"])) == (0.004 * factor(3), 0.0, (0.8, 0.9))
    # and the resumed step was AdamW's update with them: by hand on the head (the last parameter of each group)
    before = load_file(new / "checkpoint-2" / "reward_head.safetensors")
    after = load_file(new / "checkpoint-3" / "reward_head.safetensors")
    moments = state["optimizer"]["state"]
    for index, name, decay in ((matrices["params"][-1], "weight", weight_decay), (vectors["params"][-1], "bias", 0.0)):
        m, v, step = moments[index]["exp_avg"], moments[index]["exp_avg_sq"], moments[index]["step"].item()
        assert step == 3
        update = (m / (1 - beta1**step)) / ((v / (1 - beta2**step)).sqrt() + 1e-8)
        expected = before[name] * (1 - learning_rate * decay) - learning_rate * update
        assert torch.allclose(after[name], expected, rtol=0.0, atol=1e-7), name
    # which is not the step the old settings take
    assert max_difference(load_file(old / "checkpoint-3" / "model.safetensors"),
                          load_file(new / "checkpoint-3" / "model.safetensors")) > 1e-3


def test_resume_refuses_another_scripts_models_or_runs_checkpoint(tmp_path, capsys):
    data = small_data(tmp_path)
    source = tmp_path / "source"
    code, err = run_main(["--output-dir", str(source), *SMALL, "--data-path", data, "--total-steps", "1",
                          "--save-every", "1"], capsys)
    assert code == 0, err
    checkpoint = source / "checkpoint-1"

    def refused(*flags: str) -> str:
        out = tmp_path / "out"
        code, err = run_main(["--output-dir", str(out), *SMALL, "--data-path", data, "--total-steps", "2", *flags],
                             capsys)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        assert not out.exists()
        return err

    # another script's checkpoint (grpo.py writes the same two files)
    foreign = tmp_path / "grpo-run" / "checkpoint-3"
    foreign.mkdir(parents=True)
    (foreign / "trainer_state.pt").write_bytes(b"")
    (foreign / "args.json").write_text(json.dumps({"script": "grpo.py", "model": "tiny"}))
    assert "written by grpo.py, not prm.py" in refused("--resume-from", str(foreign))
    # other settings: another model, another batch, LoRA against full fine-tuning
    assert "--model 'tiny' there, 'other/model' here" in refused("--resume-from", str(checkpoint), "--model",
                                                                 "other/model")
    assert "--batch-size 4 there, 8 here" in refused("--resume-from", str(checkpoint), "--batch-size", "8")
    assert "--lora-r 0 there, 4 here" in refused("--resume-from", str(checkpoint), "--lora-r", "4")
    # the same flags, but weights of another shape (e.g. the model behind the name changed)
    import shutil

    changed = tmp_path / "changed" / "checkpoint-1"
    shutil.copytree(checkpoint, changed)
    save_file({"embed_tokens.weight": torch.zeros(3, 3)}, changed / "model.safetensors")
    assert "its weights do not" in refused("--resume-from", str(changed))
    # the same flags, but the data file changed under them
    rows = Path(data).read_text().splitlines()
    Path(data).write_text("\n".join(rows[1:]) + "\n")
    assert "the training rows differ from the checkpoint's" in refused("--resume-from", str(checkpoint))
    assert sorted(p.name for p in source.iterdir()) == ["checkpoint-1", "final", "metrics.jsonl", "summary.json"]


def test_resuming_latest_of_a_run_finished_without_checkpoints_points_to_its_final_model(tmp_path, capsys):
    """The advice was to start again with --overwrite, which would delete the finished run."""
    out = tmp_path / "out"
    flags = ["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--total-steps", "1"]
    assert run_main(flags, capsys)[0] == 0
    code, err = run_main([*flags, "--resume-from", "latest"], capsys)
    assert code == 2 and "finished without a checkpoint" in err and f"--model {out / 'final'}" in err, err
    assert "--overwrite" not in err
    # a LoRA PRM is no --model to start from (refused there): its adapter goes on only from a checkpoint
    lora = ["--output-dir", str(tmp_path / "lora"), *flags[2:], "--lora-r", "4"]
    assert run_main(lora, capsys)[0] == 0
    code, err = run_main([*lora, "--resume-from", "latest"], capsys)
    assert code == 2 and "its LoRA adapter can go on only from a checkpoint of its run" in err, err


def test_resuming_latest_of_a_run_finished_past_its_last_checkpoint_changes_nothing(tmp_path, capsys):
    """`latest` is the newest checkpoint (a final PRM holds no trainer state): step 2 of a run that finished at 3.
    The resume retrained step 3, deleting the finished final/ and summary.json first."""
    out = tmp_path / "out"
    flags = ["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--total-steps", "3",
             "--save-every", "2"]
    assert run_main(flags, capsys)[0] == 0
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    code, stdout, err = run_main([*flags, "--resume-from", "latest"], capsys, with_stdout=True)
    assert code == 0 and f"{out / 'final'} is at step 3: the run already reached --total-steps 3; nothing" in stdout
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before


def test_resuming_a_finished_run_changes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    flags = ["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--total-steps", "2",
             "--save-every", "1"]
    code, err = run_main(flags, capsys)
    assert code == 0, err
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    code, stdout, err = run_main([*flags, "--resume-from", "latest"], capsys, with_stdout=True)
    assert code == 0, err
    assert (f"{out / 'checkpoint-2'} is at step 2: the run already reached --total-steps 2; nothing to do (raise "
            "--total-steps or --epochs to train further)") in stdout
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before
    # without final/ (a signal in the last step leaves none), resuming writes the final model
    import shutil

    shutil.rmtree(out / "final")
    code, err = run_main([*flags, "--resume-from", "latest"], capsys)
    assert code == 0, err
    assert (out / "final" / "reward_head.safetensors").is_file()


def test_resuming_an_earlier_checkpoint_drops_the_later_ones(tmp_path, capsys, monkeypatch):
    """Resuming from checkpoint-1 of a 3-step run starts another branch: the old branch's later checkpoints go
    with its metrics rows, so that `--resume-from latest` cannot pick them up afterwards."""
    out = tmp_path / "out"
    flags = ["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--keep-checkpoints", "3"]
    code, err = run_main([*flags, "--total-steps", "3", "--save-every", "1"], capsys)
    assert code == 0, err
    code, err = run_main([*flags, "--total-steps", "2", "--resume-from", str(out / "checkpoint-1")], capsys)
    assert code == 0, err
    assert prm.checkpoint_steps(str(out)) == [1]
    assert [row["step"] for row in read_metrics(out)] == [1, 2]
    # the abandoned branch's final model goes too: were this run stopped in its last step, a resume would
    # otherwise find a final/ and take the old branch's model for this one's
    real_loss = prm.prm_loss
    calls = []

    def loss_failing_in_the_second_step(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("stop")
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(prm, "prm_loss", loss_failing_in_the_second_step)
    with pytest.raises(RuntimeError, match="stop"):
        run_main([*flags, "--total-steps", "3", "--resume-from", str(out / "checkpoint-1")], capsys)
    assert not (out / "final").exists() and not (out / "summary.json").exists()


def test_a_stop_during_the_final_evaluation_keeps_the_final_model(tmp_path, capsys, monkeypatch):
    """The final model is written before the final evaluation and scoring: a Ctrl-C there (a KeyboardInterrupt once
    the run's handlers are gone) used to lose every step since the last checkpoint."""
    real_evaluate, calls = prm.evaluate_prm, []

    def evaluate_interrupted_at_the_end(*args, **kwargs):  # at the start and at the end (--eval-every 0)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(prm, "evaluate_prm", evaluate_interrupted_at_the_end)
    out = tmp_path / "out"
    flags = ["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--total-steps", "2",
             "--save-every", "2"]
    with pytest.raises(KeyboardInterrupt):
        run_main(flags, capsys)
    assert prm.final_step(str(out)) == 2 and prm.load_prm(str(out / "final"), device="cpu") is not None
    assert not (out / "summary.json").exists()
    # resumed, the run is not taken for finished: it has no summary yet, which the final evaluation writes
    monkeypatch.setattr(prm, "evaluate_prm", real_evaluate)
    with open(out / "metrics.jsonl", "a") as f:  # a row torn by a crash mid-write made every resume a traceback
        f.write('{"step": 3, "los')
    code, stdout, err = run_main([*flags, "--resume-from", "latest"], capsys, with_stdout=True)
    assert code == 0 and "nothing to do" not in stdout, err
    summary = read_summary(out)
    assert summary["steps"] == 2 and prm.final_step(str(out)) == 2
    assert summary["tokens_per_s"] is None and summary["model_tflops_per_s"] is None  # no step ran: not 0.0
    assert all("step_time_s" in row for row in read_all_metrics(out))  # no eval rows: no evaluation rows


def test_a_resume_reuses_its_checkpoints_evaluations_only_on_the_same_held_out_rows(tmp_path, capsys, monkeypatch):
    """A checkpoint keeps the step-0 and last evaluations: resumed on the same held-out rows the run evaluates only
    at its end, and its summary starts at step 0; on other rows (another --eval-data-path) it evaluates at its
    start step too, which its summary then starts from, and logs no second step-0 row."""
    calls, real_evaluate = [], prm.evaluate_prm
    monkeypatch.setattr(prm, "evaluate_prm", lambda *args, **kwargs: calls.append(1) or real_evaluate(*args, **kwargs))
    out = tmp_path / "out"
    flags = ["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--total-steps", "2",
             "--save-every", "1", "--num-eval-rows", "8"]
    same_rows = ["--eval-data-path", str(write_rows(tmp_path / "eval.jsonl", builtin_rows(8)))]
    other_rows = ["--eval-data-path", str(write_rows(tmp_path / "other.jsonl", builtin_rows(16)[8:]))]
    assert run_main([*flags, *same_rows], capsys)[0] == 0 and len(calls) == 2  # at steps 0 and 2
    start = read_summary(out)["eval_auroc_start"]
    assert run_main([*flags, *same_rows, "--resume-from", str(out / "checkpoint-1")], capsys)[0] == 0
    assert len(calls) == 3 and read_summary(out)["eval_auroc_start"] == start
    code, stdout, _ = run_main([*flags, *other_rows, "--resume-from", str(out / "checkpoint-1")], capsys,
                               with_stdout=True)
    assert code == 0 and len(calls) == 5 and "eval at step 1:" in stdout and "eval at step 0:" not in stdout
    assert [row["step"] for row in read_all_metrics(out)] == [0, 1, 2, 2]
    assert read_summary(out)["eval_auroc_start"] != start


def test_a_stop_after_the_final_evaluation_row_logs_it_once(tmp_path, capsys, monkeypatch):
    """A Ctrl-C after the final evaluation's row is logged but before the summary is written (while scoring, say):
    the resume does that evaluation again and logs its row in place of the old one, not beside it."""
    real_throughput = prm.matmul_flops_per_s

    def interrupted(*args, **kwargs):  # measured for the summary, after the final evaluation's row
        raise KeyboardInterrupt

    monkeypatch.setattr(prm, "matmul_flops_per_s", interrupted)
    out = tmp_path / "out"
    flags = ["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--total-steps", "2",
             "--save-every", "2", "--eval-data-path", small_data(tmp_path), "--num-eval-rows", "8"]
    with pytest.raises(KeyboardInterrupt):
        run_main(flags, capsys)
    assert not (out / "summary.json").exists()
    assert [row["step"] for row in read_all_metrics(out)] == [0, 1, 2, 2]
    monkeypatch.setattr(prm, "matmul_flops_per_s", real_throughput)
    assert run_main([*flags, "--resume-from", "latest"], capsys)[0] == 0
    rows = read_all_metrics(out)
    assert [row["step"] for row in rows] == [0, 1, 2, 2] and "step_time_s" in rows[2]
    assert rows[-1]["eval_auroc"] == read_summary(out)["eval_auroc_end"]


def test_a_stop_signal_during_the_final_save_checkpoints_and_skips_the_final_evaluation(tmp_path, capsys,
                                                                                       monkeypatch):
    """A SIGTERM while the final PRM is being written is not dropped: a checkpoint is written beside it (a final
    PRM holds no trainer state), the final evaluation and scoring are skipped, and a resume runs them."""
    import signal as signals

    real_save = prm.save_prm

    def save_receiving_sigterm(path, *args, **kwargs):
        if path.endswith("final"):
            os.kill(os.getpid(), signals.SIGTERM)  # the run's handler only notes it
        return real_save(path, *args, **kwargs)

    monkeypatch.setattr(prm, "save_prm", save_receiving_sigterm)
    out = tmp_path / "out"
    eval_rows = write_rows(tmp_path / "eval.jsonl", builtin_rows(8))
    flags = ["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--total-steps", "2",
             "--eval-data-path", str(eval_rows)]
    code, stdout, err = run_main(flags, capsys, with_stdout=True)
    assert code == 128 + signal.SIGTERM and "stopped by a signal after saving the final model" in stdout, err
    assert "eval at step 2" not in stdout and not (out / "summary.json").exists()
    assert prm.final_step(str(out)) == 2 and prm.checkpoint_steps(str(out)) == [2]
    monkeypatch.setattr(prm, "save_prm", real_save)
    code, stdout, err = run_main([*flags, "--resume-from", "latest"], capsys, with_stdout=True)
    assert code == 0 and "eval at step 2" in stdout and read_summary(out)["steps"] == 2, err


def test_resuming_an_earlier_checkpoint_to_its_own_step_writes_that_model(tmp_path, capsys):
    """A 3-step run resumed from checkpoint-2 with --total-steps 2: its final/ is step 3's, not this run's, so
    there is something to do (it was taken for "nothing to do", and step 3's model stayed as the final one)."""
    out = tmp_path / "out"
    flags = ["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--save-every", "1",
             "--keep-checkpoints", "3"]
    assert run_main([*flags, "--total-steps", "3"], capsys)[0] == 0
    assert prm.final_step(str(out)) == 3
    code, stdout, err = run_main([*flags, "--total-steps", "2", "--resume-from", str(out / "checkpoint-2")], capsys,
                                 with_stdout=True)
    assert code == 0 and "nothing to do" not in stdout, err
    assert prm.final_step(str(out)) == 2
    final, checkpoint = (load_file(out / name / "reward_head.safetensors") for name in ("final", "checkpoint-2"))
    assert all(torch.equal(final[key], checkpoint[key]) for key in final)


@pytest.mark.parametrize("packing", [[], ["--no-pack-rows"]])
def test_a_prm_loads_in_the_dtype_it_was_trained_in_and_batches_as_it_did(packing, tmp_path, capsys):
    """prm_config.json records the training dtype, which load_prm, the score command and grpo.py's --prm-path use
    by default: the scores of the end of training (in fp32 on a CPU, a bf16 PRM scored 1e-3 off). It records
    --no-pack-rows too: a PRM trained on padded rows, reloaded, scored packed rows up to 4e-4 off in bf16."""
    out = tmp_path / "out"
    data = small_data(tmp_path)
    code, err = run_main(["--output-dir", str(out), *SMALL, "--data-path", data, "--total-steps", "2", "--dtype",
                          "bfloat16", "--score-data-path", data, *packing], capsys)
    assert code == 0, err
    config = json.loads((out / "final" / "prm_config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["pack_rows"] == (not packing)
    model = prm.load_prm(str(out / "final"), device="cpu")
    assert {p.dtype for p in model.backbone.parameters()} == {torch.bfloat16} and model.pack_rows == (not packing)
    rows = [json.loads(line) for line in (out / "scores.jsonl").read_text().splitlines()]
    rescored = prm.score_steps(model, [r["prompt"] for r in rows], [r["completions"] for r in rows], 64)
    assert rescored == [r["scores"] for r in rows]


def test_the_tiny_model_in_bf16_keeps_fp32_rotary_frequencies():
    """Module.to(bf16) rounds buffers too: the rotary frequencies (0.5625 for 0.56234) that from_pretrained
    recomputes in fp32 when final/ is loaded, so a reloaded model scored 1e-3 off the trained one."""
    backbone, _ = prm.load_backbone_and_tokenizer("tiny", torch.bfloat16, False)
    assert {p.dtype for p in backbone.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in backbone.buffers() if b.is_floating_point()} == {torch.float32}
    import grpo

    model, _ = grpo.load_model_and_tokenizer("tiny", torch.bfloat16, False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in model.buffers() if b.is_floating_point()} == {torch.float32}


def test_builtin_training_rows_do_not_depend_on_the_held_out_counts():
    train, val, evaluation = prm.builtin_task(seed=3, num_val=20, num_eval=30, num_train=200)
    other_train, other_val, other_evaluation = prm.builtin_task(seed=3, num_val=20, num_eval=50, num_train=200)
    assert other_train == train and other_val == val and other_evaluation[:30] == evaluation
    assert prm.builtin_task(seed=3, num_val=7, num_eval=0, num_train=200)[0] == train
    assert (len(train), len(val), len(evaluation)) == (200, 20, 30)
    key = lambda row: (row["prompt"], *row["completions"])  # noqa: E731
    assert not {key(row) for row in train} & {key(row) for row in val + other_evaluation}
    assert not {key(row) for row in val} & {key(row) for row in other_evaluation}
    with pytest.raises(ValueError, match="holds out 2000"):
        prm.builtin_task(seed=3, num_val=1000, num_eval=1001)


def test_builtin_held_out_rows_look_like_training_rows():
    # one shuffle splits them: the last distinct rows drawn would be rarer ones (about 0.2 steps longer on average)
    train, _, evaluation = prm.builtin_task(seed=1, num_val=0, num_eval=2000)
    mean_steps = lambda rows: sum(len(row["completions"]) for row in rows) / len(rows)  # noqa: E731
    assert abs(mean_steps(evaluation) - mean_steps(train)) < 0.06


def test_resuming_the_builtin_data_with_other_eval_rows_keeps_the_training_rows(tmp_path, capsys):
    # before, the training rows were those left after the held-out ones: another --num-eval-rows changed them
    out = tmp_path / "out"
    flags = ["--output-dir", str(out), "--batch-size", "4", "--eval-every", "0", "--num-val-rows", "4",
             "--num-eval-rows", "4", "--save-every", "1", "--total-steps", "1"]
    code, err = run_main(flags, capsys)
    assert code == 0, err
    code, err = run_main([*flags, "--num-eval-rows", "5", "--total-steps", "2", "--resume-from", "latest"], capsys)
    assert code == 0, err
    assert read_summary(out)["eval_rows"] == 5


def test_resuming_with_another_dtype_is_refused_by_name(tmp_path, capsys):
    # a bf16 checkpoint (as --dtype auto writes on a GPU) resumed in fp32 (what auto gives on a CPU)
    out = tmp_path / "out"
    flags = ["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--total-steps", "1",
             "--save-every", "1"]
    code, err = run_main([*flags, "--dtype", "bfloat16"], capsys)
    assert code == 0, err
    checkpoint = out / "checkpoint-1"
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
    assert state["dtype"] == "bfloat16"
    resume = [*flags, "--total-steps", "2", "--resume-from", "latest"]
    code, err = run_main([*resume, "--dtype", "float32"], capsys)
    expected = "computed in bfloat16, this one would in float32 (--dtype float32); resume with --dtype bfloat16"
    assert code == 2 and err == f"error: --resume-from {checkpoint}: the checkpoint's run {expected}\n"
    # a checkpoint older than the dtype record is not checked
    del state["dtype"]
    torch.save(state, checkpoint / "trainer_state.pt")
    code, err = run_main([*resume, "--dtype", "bfloat16"], capsys)
    assert code == 0, err
    assert read_summary(out)["steps"] == 2


def test_sigterm_checkpoints_and_resume_matches_an_uninterrupted_run(tmp_path):
    total = 100
    flags = [*QUICK, "--total-steps", str(total), "--eval-every", "25", "--micro-batch-size", "3",
             "--warmup-steps", "10", "--lr-schedule", "cosine"]
    straight = tmp_path / "straight"
    run_prm("--output-dir", str(straight), *flags)

    interrupted = tmp_path / "interrupted"
    process = subprocess.Popen([sys.executable, "prm.py", "--output-dir", str(interrupted), *flags], cwd=REPO_ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    metrics_file = interrupted / "metrics.jsonl"
    deadline = time.time() + 240
    # (3 rows: the start evaluation's and two steps')
    while time.time() < deadline and not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3):
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=240)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    steps = prm.checkpoint_steps(str(interrupted))
    assert len(steps) == 1, stdout[-3000:]
    stopped_at = steps[0]
    assert f"stopped by a signal after step {stopped_at}" in stdout and "--resume-from" in stdout
    assert not (interrupted / "final").exists() and read_summary(interrupted)["interrupted"] is True
    assert 2 <= stopped_at < total, "the run finished before the signal arrived; nothing was tested"

    run_prm("--output-dir", str(interrupted), *flags, "--resume-from", "latest")
    resumed = read_metrics(interrupted)
    assert [row["step"] for row in resumed] == list(range(1, total + 1))
    assert comparable(resumed) == comparable(read_metrics(straight))  # to the last digit, rows k+1.. included
    assert comparable(read_all_metrics(interrupted)) == comparable(read_all_metrics(straight))  # evaluations too
    for name in ("model.safetensors", "reward_head.safetensors"):
        difference = max_difference(load_file(straight / "final" / name), load_file(interrupted / "final" / name))
        print(f"resume after step {stopped_at}: max |weight difference| in {name} = {difference}")
        assert difference == 0.0


def test_sigint_finishes_the_step_then_checkpoints(tmp_path, capsys, monkeypatch):
    # Ctrl-C arrives in the middle of step 2 (inside its loss): step 2 completes, is logged and checkpointed
    real_loss, calls = prm.prm_loss, {"n": 0}

    def interrupting_loss(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(prm, "prm_loss", interrupting_loss)
    handler_before = signal.getsignal(signal.SIGINT)  # the default, or SIG_IGN in a shell's background job
    out = tmp_path / "out"
    code, stdout, err = run_main(["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path),
                                  "--total-steps", "10"], capsys, with_stdout=True)
    assert code == 128 + signal.SIGINT, err
    assert (f"stopped by a signal after step 2; {out / 'checkpoint-2'} saved; continue with: python "
            f"{os.path.abspath('prm.py')} <the same flags> --output-dir {out} --resume-from latest") in stdout
    assert prm.checkpoint_steps(str(out)) == [2] and len(read_metrics(out)) == 2
    assert not (out / "final").exists() and read_summary(out)["interrupted"] is True
    assert read_summary(out)["stop_signal"] == "SIGINT"  # and the exit status is 130, as for a process it ended
    assert signal.getsignal(signal.SIGINT) is handler_before  # the handlers are put back


def test_two_processes_make_the_same_update_as_one(tmp_path, capsys):
    # 2 processes of 4 rows against 1 of 8, and a different micro-batch split: the same update to 1e-5. A modest
    # learning rate: Adam's first step moves every weight by about lr, so rounding noise scales with it.
    data = small_data(tmp_path)
    flags = ["--data-path", data, "--total-steps", "2", "--save-every", "1", "--batch-size", "8", "--eval-every", "0",
             "--num-val-rows", "4", "--warmup-steps", "0", "--learning-rate", "1e-4"]
    single = tmp_path / "single"
    run_prm("--output-dir", str(single), *flags)
    double = tmp_path / "double"
    process = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                              "prm.py", "--output-dir", str(double), *flags, "--micro-batch-size", "3"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=300, env=ENV)
    assert process.returncode == 0, process.stderr[-3000:]
    assert process.stdout.count("step 1 |") == 1  # rank 0 alone logs
    # each process draws its own random stream (dropout masks): the states the checkpoint keeps per rank differ
    states = torch.load(double / "checkpoint-1" / "trainer_state.pt", weights_only=True)["rng"]
    assert len(states) == 2 and not torch.equal(states[0]["torch"], states[1]["torch"])
    for name in ("model.safetensors", "reward_head.safetensors"):
        one = load_file(single / "checkpoint-1" / name)
        two = load_file(double / "checkpoint-1" / name)
        difference = max_difference(one, two)
        with capsys.disabled():  # shown with -s
            print(f"2 processes vs 1 after one step: max |weight difference| in {name} = {difference:.2e}")
        assert difference < 1e-5
    # and the update was not a no-op: the weights moved from their (seeded, identical) initial values
    prm.seed_everything(1)
    initial, _ = prm.build_prm(prm.Args(), torch.float32)
    moved_backbone = max_difference(load_file(double / "checkpoint-1" / "model.safetensors"),
                                    initial.backbone.state_dict())
    moved_head = max_difference(load_file(double / "checkpoint-1" / "reward_head.safetensors"),
                                initial.head.state_dict())
    assert moved_backbone > 5e-5 and moved_head > 5e-5  # Adam moves ~lr = 1e-4
    # metrics are reduced over processes: the same numbers as one process on the same batch
    for a, b in zip(read_metrics(single), read_metrics(double), strict=True):
        for key in ("loss", "accuracy", "score_mean", "grad_norm", "labelled_steps"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    assert len(torch.load(double / "checkpoint-2" / "trainer_state.pt", weights_only=True)["rng"]) == 2
    final_difference = max_difference(load_file(single / "final" / "model.safetensors"),
                                      load_file(double / "final" / "model.safetensors"))
    assert final_difference < 1e-4  # a second step on top: still the same run
    # a 2-process checkpoint resumes in 1 process (the update does not depend on the process count)
    code, err = run_main([*flags, "--resume-from", str(double / "checkpoint-1")], capsys)
    assert code == 0, err
    assert max_difference(load_file(single / "final" / "model.safetensors"),
                          load_file(double / "final" / "model.safetensors")) < 1e-4


def test_weights_saved_under_hub_names_load_back(tmp_path):
    """save_pretrained writes a mixture of experts' fused weights one expert at a time: read by their names alone, a
    full fine-tuning checkpoint of a Mixtral or Qwen3-MoE backbone did not fit its own backbone on --resume-from."""
    from transformers import LlamaConfig, LlamaModel, MixtralConfig, MixtralModel

    small = dict(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    config = MixtralConfig(**small, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1)
    torch.manual_seed(0)
    saved = MixtralModel(config)
    saved.save_pretrained(tmp_path / "mixtral")
    assert not set(load_file(tmp_path / "mixtral" / "model.safetensors")) >= set(saved.state_dict())
    torch.manual_seed(1)
    backbone = MixtralModel(config)
    assert prm.load_saved_weights(backbone, str(tmp_path / "mixtral")) == ([], [])
    for name, weight in saved.state_dict().items():
        assert torch.equal(backbone.state_dict()[name], weight), name
    missing, unexpected = prm.load_saved_weights(LlamaModel(LlamaConfig(**small)), str(tmp_path / "mixtral"))
    assert "layers.0.mlp.gate_proj.weight" in missing and unexpected  # another architecture: named, not loaded


def test_token_ids_past_the_embeddings_and_layers_peft_refuses_are_one_line(tmp_path, capsys):
    """Tokens added to a tokenizer without resizing the model crashed the embedding lookup (IndexError); peft's
    refusal of some layers (Mamba's out_proj) was a traceback under --lora-r."""
    from transformers import LlamaConfig, LlamaModel, MambaConfig, MambaModel

    with pytest.raises(prm.UserError, match="peft cannot adapt them on MambaModel .*out_proj"):
        prm.apply_lora(MambaModel(MambaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, state_size=4)),
                       prm.Args(lora_r=4))
    tokenizer = prm.build_tiny_tokenizer()
    LlamaModel(LlamaConfig(vocab_size=len(tokenizer) - 3, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32)).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    capsys.readouterr()  # (save_pretrained's progress bar)
    code, err = run_main(["--model", str(tmp_path / "model"), "--output-dir", str(tmp_path / "run"), *QUICK], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"past {tmp_path / 'model'}'s {len(tokenizer) - 3} embeddings" in err and "resize_token_embeddings" in err
    # LoRA on the embeddings wraps them in a layer without num_embeddings, which that check read: an AttributeError
    code, err = run_main(["--output-dir", str(tmp_path / "lora"), *QUICK, "--lora-r", "4", "--lora-target-modules",
                          "embed_tokens,q_proj"], capsys)
    assert code == 0, err


def test_a_trainer_state_that_is_no_torch_archive_is_named_without_torchs_advice(tmp_path):
    """torch's message for such a file advises loading it with weights_only=False, which would run any pickle."""
    (tmp_path / "trainer_state.pt").write_bytes(b"garbage" * 20)
    with pytest.raises(prm.UserError) as raised:
        prm.load_trainer_state(str(tmp_path))
    assert "not tensors and plain values: corrupt, or not saved by this script" in str(raised.value)
    assert "weights_only" not in str(raised.value)
