"""grpo.py end to end: short CPU runs of its command line, as a user would launch them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import grpo
from conftest import run_in_process

REPO_ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--total-steps", "3", "--prompts-per-step", "4", "--group-size", "4", "--eval-every", "0",
         "--num-eval-prompts", "16"]


def run_grpo(output_dir: Path, *flags: str, env: dict | None = None, expect_rc: int = 0, timeout: int = 300):
    """`python grpo.py --output-dir OUTPUT_DIR FLAGS`: (returncode, stdout, stderr). With env (variables read when
    torch is imported, such as TORCH_LOGS) in a subprocess, else in this process (run_in_process)."""
    argv = ["--output-dir", str(output_dir), *flags]
    if env is not None:
        process = subprocess.run([sys.executable, "grpo.py", *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                                 timeout=timeout, env={**os.environ, "WANDB_MODE": "disabled", **env})
    else:
        process = run_in_process(grpo, argv, timeout)
    assert process.returncode == expect_rc, (f"rc {process.returncode}\n{process.stdout[-3000:]}\n"
                                             f"{process.stderr[-3000:]}")
    return process


def read_all_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def read_metrics(output_dir: Path) -> list[dict]:
    """The training rows, one per step (the evaluations at the start and the end have rows of their own)."""
    return [row for row in read_all_metrics(output_dir) if "step_time_s" in row]


def read_eval_rows(output_dir: Path) -> list[dict]:
    """The rows of the evaluations at the start and the end: their step and metrics, nothing else."""
    return [row for row in read_all_metrics(output_dir) if "step_time_s" not in row]


def read_summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "summary.json").read_text())


# a chat template over the tiny alphabet, to exercise the template path with the tiny model
TINY_CHAT_TEMPLATE = ("{% for message in messages %}({{ message['content'] }}){% endfor %}"
                      "{% if add_generation_prompt %}={% endif %}")


def save_tiny(path: Path, chat_template: bool = False) -> Path:
    tokenizer = grpo.build_tiny_tokenizer()
    if chat_template:
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
    grpo.build_tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


SUMMARY_KEYS = {"steps", "total_time_s", "step_time_s_mean", "generation_time_s", "update_time_s",
                "generated_tokens_per_s", "trained_tokens_per_s", "peak_memory_mb", "eval_accuracy_start",
                "eval_accuracy_end"}


def test_default_task_few_steps(tmp_path):
    out = tmp_path / "run"
    process = run_grpo(out, *QUICK, "--kl-coef", "0")
    summary = read_summary(out)
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["steps"] == 3 and summary["generated_tokens_per_s"] > 0
    assert summary["peak_memory_mb"] >= max(row["memory_mb"] for row in read_metrics(out))  # a peak of the samples
    # on CPU: model FLOP/s against the matmul throughput measured in the same run
    assert summary["matmul_tflops_measured"] > 0 and 0 < summary["flop_floor_fraction"] < 1.5
    assert summary["flop_floor_fraction"] == pytest.approx(
        summary["model_tflops_per_s"] / summary["matmul_tflops_measured"])
    metrics = read_metrics(out)
    assert [row["step"] for row in metrics] == [1, 2, 3]
    # the start and final evaluations: rows of their own (--eval-every 0), the summary's figures
    assert read_eval_rows(out) == [{"step": 0, "eval_accuracy": summary["eval_accuracy_start"]},
                                   {"step": 3, "eval_accuracy": summary["eval_accuracy_end"]}]
    # tokens/s over the timed steps, as the step time: the first pays for warm-up (kernel loading, on a GPU)
    timed = metrics[1:]
    generated = sum(row["completion_length"] * 16 for row in timed)  # 4 prompts x 4 completions
    assert summary["generated_tokens_per_s"] == pytest.approx(
        generated / sum(row["generation_time_s"] for row in timed), rel=1e-6)
    assert summary["generation_time_s"] == pytest.approx(sum(row["generation_time_s"] for row in metrics), rel=1e-6)
    for key in ("reward", "accuracy", "clip_frac_low", "clip_frac_high", "ratio_mean", "entropy",
                "completion_length", "logp_gap_max", "generation_time_s", "update_time_s"):
        assert key in metrics[0], key
    # one update per rollout: the ratio against the rollout policy is exactly 1, nothing clips
    assert all(row["ratio_mean"] == pytest.approx(1.0) and row["clip_frac_low"] == 0 for row in metrics)
    # the training pass and the sampler see the same tokens with the same weights: log-probs agree
    assert all(row["logp_gap_max"] < 1e-4 for row in metrics)
    assert not any("kl_mean" in row for row in metrics)  # --kl-coef 0: no reference policy, no KL to report
    assert "step 3" in process.stdout and "summary" in process.stdout
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(out / "final")
    assert AutoTokenizer.from_pretrained(out / "final").eos_token == "<eos>"


def test_full_finetune_kl_uses_frozen_copy(tmp_path):
    out = tmp_path / "run"
    run_grpo(out, *QUICK, "--kl-coef", "0.05")
    kl = [row["kl_mean"] for row in read_metrics(out)]
    assert kl[0] == pytest.approx(0.0, abs=1e-6)  # the policy starts equal to its reference
    assert kl[-1] > 1e-6  # and moves away from the frozen copy


def test_lora_kl_reference_is_adapter_disabled(tmp_path):
    out = tmp_path / "run"
    run_grpo(out, *QUICK, "--lora-r", "4", "--kl-coef", "0.05", "--learning-rate", "1e-2", "--gradient-checkpointing")
    kl = [row["kl_mean"] for row in read_metrics(out)]
    assert kl[0] == pytest.approx(0.0, abs=1e-6)  # LoRA's B starts at zero: adapter on == adapter off
    assert kl[-1] > 1e-6
    assert (out / "final" / "adapter_config.json").exists()
    assert not (out / "final" / "model.safetensors").exists()  # only the adapter is saved


def test_num_iterations_2_moves_the_ratio(tmp_path):
    out = tmp_path / "run"
    run_grpo(out, *QUICK, "--num-iterations", "2", "--clip-eps-low", "0.001", "--clip-eps-high", "0.001")
    metrics = read_metrics(out)
    # stats come from the second pass, after one update: ratios leave 1 and the tiny clip range bites
    assert any(abs(row["ratio_mean"] - 1.0) > 1e-5 for row in metrics)
    assert any(row["clip_frac_low"] + row["clip_frac_high"] > 0 for row in metrics)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_give_the_same_update(loss_type, tmp_path):
    """Each loss type's normaliser is the whole batch's (sequences, tokens, or sequences x max length), whatever
    the micro-batches: the default dapo would otherwise divide each micro-batch by its own token count."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    flags = [*QUICK, "--total-steps", "1", "--loss-type", loss_type, "--kl-coef", "0.05"]
    run_grpo(whole, *flags)
    run_grpo(split, *flags, "--micro-batch-size", "4")
    a, b = read_metrics(whole)[0], read_metrics(split)[0]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_shared_prompts_give_the_same_run(tmp_path):
    """Each prompt encoded once (--share-prompts always), in micro-batches of 6 that cut groups of 4, against every
    row's prompt encoded: the same metrics and weights, with the frozen reference copy, with LoRA, and under
    gradient checkpointing (where only the reference pass shares: transformers drops the cache in training)."""
    from safetensors.torch import load_file

    for name, lr, extra in [("full", 3e-4, []), ("lora", 1e-2, ["--lora-r", "4"]),
                            ("checkpointing", 3e-4, ["--gradient-checkpointing"])]:
        every, shared = tmp_path / f"{name}-every", tmp_path / f"{name}-shared"
        flags = [*QUICK, "--total-steps", "2", "--kl-coef", "0.05", "--micro-batch-size", "6",
                 "--learning-rate", str(lr), *extra]
        run_grpo(every, *flags, "--share-prompts", "never")
        run_grpo(shared, *flags, "--share-prompts", "always")
        for a, b in zip(read_metrics(every), read_metrics(shared), strict=True):
            for key, value in a.items():
                if not key.endswith("time_s") and not key.startswith("memory"):
                    assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), (name, key)
        assert read_metrics(shared)[-1]["kl_mean"] > 1e-6  # the reference pass was exercised on a moved policy
        weights = [load_file(next((out / "final").glob("*.safetensors"))) for out in (every, shared)]
        # Adam divides each gradient entry by its own RMS: fp32 rounding in near-zero entries moves weights by a
        # few percent of a step (measured: 2% full, 0.7% LoRA); an error in the shared pass moves them by whole steps
        assert max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0]) < 0.05 * lr
        if name == "checkpointing":  # training turns the KV cache off; the saved model generates with it on
            assert json.loads((shared / "final" / "config.json").read_text())["use_cache"] is True


@pytest.mark.parametrize("name, flags", [
    # bf16 (compiled, its fused intermediates would stay fp32: a log-prob gap to the eager training pass); greedy
    # evaluation in batches of 6, 6 and 4 rows
    ("full", ["--dtype", "bfloat16", "--kl-coef", "0.05", "--eval-every", "2", "--eval-batch-size", "6",
              "--learning-rate", "1e-3"]),
    ("lora", ["--lora-r", "4", "--learning-rate", "1e-2", "--gradient-checkpointing"]),
])
def test_compiled_decoding_gives_the_same_run(name, flags, tmp_path):
    """--compile-decoding: the same samples, rewards, losses and weights as the eager run, over 16 new tokens (15
    one-token passes, the KV cache one position longer in each)."""
    from safetensors.torch import load_file

    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    flags = [*QUICK, "--max-new-tokens", "16", *flags]
    run_grpo(eager, *flags)
    process = run_grpo(compiled, *flags, "--compile-decoding", env={"TORCH_LOGS": "guards,recompiles"})
    for a, b in zip(read_metrics(eager), read_metrics(compiled), strict=True):
        assert b["reward"] == a["reward"] and b["completion_length"] == a["completion_length"], name
        for key, value in a.items():
            if not key.endswith("time_s") and not key.startswith("memory"):
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), (name, key)
    assert read_summary(compiled)["eval_accuracy_end"] == read_summary(eager)["eval_accuracy_end"]
    weights = [load_file(next((out / "final").glob("*.safetensors"))) for out in (eager, compiled)]
    assert weights[0].keys() == weights[1].keys()  # saved under the module's own names, not a compiled wrapper's
    assert max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0]) < 1e-5
    # compiled (torch's log shows each graph's guards), once: one graph for every step, sampled or greedy, whatever
    # the cache's length
    assert "[__guards]" in process.stderr and "[__recompiles]" not in process.stderr


@pytest.mark.parametrize("flags, reference_plans, training_plans", [
    # 4 prompts of 12 positions (with BOS) x group 4: one micro-batch of 16 rows skips 12 x 12 = 144 >= 128 positions
    (["--share-prompts", "auto"], "shared", "shared"),
    # micro-batches of 4 rows hold one prompt each: 3 x 12 = 36 skipped, not worth a second forward call
    (["--share-prompts", "auto", "--micro-batch-size", "4"], None, None),
    (["--share-prompts", "never"], None, None),
    # transformers drops the cache in checkpointed layers while training, and the reference must be scored as the
    # policy is (see test_with_equal_rewards_the_kl_to_an_identical_reference_is_exactly_zero): neither pass shares
    (["--share-prompts", "always", "--gradient-checkpointing"], None, None),
])
def test_train_shares_prompts_when_its_flag_says(flags, reference_plans, training_plans, tmp_path, monkeypatch,
                                                 capsys):
    """What train() hands completion_logprobs: the rows of each micro-batch numbered by prompt, or None; and the
    prompt tokens step_flops counts for each pass: 4 x 12 when shared, 16 x 12 when every row encodes its own."""
    import grpo
    from conftest import run_script_main

    calls, flop_counts = [], []
    score, count_flops = grpo.completion_logprobs, grpo.step_flops

    def spy(*args, prompt_of_row=None, with_entropy=False, **kwargs):
        calls.append(("training" if with_entropy else "reference", prompt_of_row))
        return score(*args, prompt_of_row=prompt_of_row, with_entropy=with_entropy, **kwargs)

    monkeypatch.setattr(grpo, "completion_logprobs", spy)
    monkeypatch.setattr(grpo, "step_flops", lambda *args, **kwargs: flop_counts.append(kwargs) or count_flops(
        *args, **kwargs))
    argv = ["--output-dir", str(tmp_path / "run"), *QUICK, "--total-steps", "1", "--kl-coef", "0.05", *flags]
    assert run_script_main(grpo.main, "grpo.py", argv, capsys)[0] == 0
    shared = [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    for which, expected in (("reference", reference_plans), ("training", training_plans)):
        plans = [plan for kind, plan in calls if kind == which]
        assert plans and all(plan == (shared if expected == "shared" else None) for plan in plans), (which, plans)
    (counted,) = flop_counts
    assert counted["unique_prompt_tokens"] == 4 * 12
    assert counted["reference_prompt_tokens"] == (4 if reference_plans == "shared" else 16) * 12
    assert counted["update_prompt_tokens"] == (4 if training_plans == "shared" else 16) * 12


def test_micro_batches_are_cut_to_their_own_longest_prompt_and_completion(tmp_path, monkeypatch, capsys):
    """Columns that are padding in every row of a micro-batch never reach the model: micro-batches of one row get
    that row's prompt width (5 or 13 positions with BOS, not the batch's 13) and its completion's length; and the
    run's metrics and weights equal those of the whole batch at once."""
    import grpo
    from conftest import run_script_main
    from safetensors.torch import load_file

    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "(123+45)%10=", "answer": "8"}]
    data = write_rows(tmp_path / "rows.jsonl", rows)
    seen = []
    score = grpo.completion_logprobs

    def spy(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *args, **kwargs):
        seen.append((prompt_mask.clone(), completion_mask.clone()))
        return score(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *args, **kwargs)

    monkeypatch.setattr(grpo, "completion_logprobs", spy)
    flags = ["--data-path", str(data), "--no-chat-template", "--prompts-per-step", "2", "--group-size", "4",
             "--max-new-tokens", "24", "--total-steps", "3", "--kl-coef", "0.05", "--eval-every", "0",
             "--num-eval-prompts", "0", "--share-prompts", "never"]
    argv = ["--output-dir", str(tmp_path / "split"), *flags, "--micro-batch-size", "1"]
    assert run_script_main(grpo.main, "grpo.py", argv, capsys)[0] == 0
    assert {prompt_mask.shape[1] for prompt_mask, _ in seen} == {5, 13}
    for prompt_mask, completion_mask in seen:  # no column is padding in every row
        assert prompt_mask.any(0).all() and completion_mask.any(0).all()
    assert len({completion_mask.shape[1] for _, completion_mask in seen}) > 1  # completions of different lengths
    monkeypatch.setattr(grpo, "completion_logprobs", score)
    argv = ["--output-dir", str(tmp_path / "whole"), *flags]
    assert run_script_main(grpo.main, "grpo.py", argv, capsys)[0] == 0
    for a, b in zip(read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "split"), strict=True):
        for key, value in a.items():
            if not key.endswith("time_s") and not key.startswith("memory"):
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), key
    weights = [load_file(tmp_path / run / "final" / "model.safetensors") for run in ("whole", "split")]
    assert max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0]) < 0.05 * 3e-4


def test_saved_model_and_jsonl_with_chat_template(tmp_path):
    model_dir = save_tiny(tmp_path / "tiny-saved", chat_template=True)
    rows = [{"prompt": f"({a}+{b})%10=", "answer": str((a + b) % 10)} for a in range(10, 20) for b in range(20, 24)]
    data = write_rows(tmp_path / "train.jsonl", rows)
    evals = write_rows(tmp_path / "eval.jsonl", rows[:8])
    out = tmp_path / "run"
    process = run_grpo(out, "--model", str(model_dir), "--data-path", str(data), "--eval-data-path", str(evals),
                       "--lora-r", "8", "--kl-coef", "0.05", "--total-steps", "2", "--prompts-per-step", "4",
                       "--group-size", "4", "--eval-every", "0")
    assert read_summary(out)["steps"] == 2
    assert "tiny-saved" in process.stdout
    # the start says which prompts the model is given, and how they are written
    assert (f"40 training prompts ({data}), 8 held out ({evals}); prompts in the chat template, the first: "
            f"'((10+20)%10=)='") in process.stdout
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out / "final")
    # the chat template is applied when the tokenizer has one, and --no-chat-template turns it off
    import grpo
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    templated = grpo.encode_prompts(tokenizer, ["(1+2)%10="], True, 64)[0]
    plain = grpo.encode_prompts(tokenizer, ["(1+2)%10="], False, 64)[0]
    assert tokenizer.decode(templated) == "((1+2)%10=)="
    assert tokenizer.decode(plain) == "<bos>(1+2)%10="
    process = run_grpo(tmp_path / "plain", "--model", str(model_dir), "--data-path", str(data), "--no-chat-template",
                       "--total-steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--eval-every", "0")
    assert f"40 training prompts ({data}), 0 held out (none); prompts as raw text, the first: '<bos>(10+20)%10='" in (
        process.stdout)
    # a system message goes before every prompt through the template; without a template there is nowhere to put it
    process = run_grpo(tmp_path / "system", "--model", str(model_dir), "--data-path", str(data), "--eval-data-path",
                       str(evals), "--system-prompt", "0", "--total-steps", "1", "--prompts-per-step", "2",
                       "--group-size", "2", "--eval-every", "0")
    assert "prompts in the chat template, the first: '(0)((10+20)%10=)='" in process.stdout
    assert grpo.encode_prompts(tokenizer, ["(1+2)%10="], True, 64, system_prompt="0") == [
        tokenizer("(0)((1+2)%10=)=", add_special_tokens=False)["input_ids"]]
    with pytest.raises(grpo.UserError, match="--system-prompt needs a chat template: the tokenizer has none, or "
                                             "--no-chat-template turned it off"):
        grpo.encode_prompts(tokenizer, ["(1+2)%10="], False, 64, system_prompt="0")
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role "
                               "not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")  # (Gemma's refuses it)
    with pytest.raises(grpo.UserError, match="the chat template refuses the system message .System role not "
                                             "supported.; leave out --system-prompt"):
        grpo.encode_prompts(tokenizer, ["(1+2)%10="], True, 64, system_prompt="0")


@pytest.mark.parametrize("script", ["grpo", "prm"])
def test_track_with_wandb_offline_and_a_resume_continues_the_same_run(script, tmp_path):
    """The checkpoint records the wandb run's id: a resumed launch logs into that run (its curve continued, not
    split over two unrelated runs); a resume from an earlier checkpoint, a branch, is a wandb run of its own (wandb
    would ignore its rows at the steps the first branch logged), in the first run's group."""
    flags = ([*QUICK, "--num-eval-prompts", "0"] if script == "grpo" else
             ["--batch-size", "4", "--num-val-rows", "0", "--num-eval-rows", "0", "--eval-every", "0"])
    out, env = tmp_path / "run", {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
                                  "OMP_NUM_THREADS": "1"}
    for more in (["--total-steps", "2"], ["--total-steps", "3", "--resume-from", "latest"],
                 ["--total-steps", "3", "--resume-from", str(out / "checkpoint-2"), "--learning-rate", "1e-2"]):
        process = subprocess.run([sys.executable, f"{script}.py", "--output-dir", str(out), *flags, *more,
                                  "--save-every", "1", "--keep-checkpoints", "3", "--track"], cwd=REPO_ROOT,
                                 capture_output=True, text=True, env=env, timeout=600)
        assert process.returncode == 0, process.stderr[-3000:]
    ids = [run.name.rsplit("-", 1)[1] for run in sorted((tmp_path / "wandb").glob("offline-run-*"))]
    assert len(ids) == 3 and ids[1] == ids[0] and ids[2] != ids[0], ids
    first, branch = (torch.load(out / f"checkpoint-{step}" / "trainer_state.pt", weights_only=True) for step in (1, 3))
    assert first["wandb_id"] == ids[0] and branch["wandb_id"] == ids[2]
    assert first["wandb_group"].startswith(f"{script}__") and branch["wandb_group"] == first["wandb_group"]


def test_bfloat16_on_cpu(tmp_path):
    out = tmp_path / "run"
    process = run_grpo(out, *QUICK, "--dtype", "bfloat16")
    assert "torch.bfloat16" in process.stdout
    assert all(row["loss"] is not None for row in read_metrics(out))  # no NaN (written as null)


def test_prompts_the_tokenizer_cannot_read_and_a_warm_up_past_the_run_are_noted(tmp_path):
    digits = tmp_path / "digits.jsonl"
    digits.write_text("".join(json.dumps({"prompt": f"({n}+1)%10=", "answer": str((n + 1) % 10)}) + "\n"
                              for n in range(10)))
    words = tmp_path / "words.jsonl"
    words.write_text(digits.read_text() + json.dumps({"prompt": "What is 1+1?", "answer": "2"}) + "\n")
    flags = ["--total-steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--eval-every", "0"]
    process = run_grpo(tmp_path / "digits", "--data-path", str(digits), *flags)
    assert "unknown token" not in process.stderr and "note: --warmup-steps" not in process.stdout
    process = run_grpo(tmp_path / "words", "--data-path", str(words), *flags, "--warmup-steps", "4")
    assert (f"warning: 7 of the prompts' 113 tokens are the tokenizer's unknown token '<unk>' (the first in {words}:11)"
            ": --model tiny knows only the characters '0123456789+-*/%()= '") in process.stderr
    # (and a warm-up longer than the run, which never reaches the learning rate)
    assert ("note: --warmup-steps 4 is more than the run's 1 optimiser updates: the learning rate never reaches "
            "--learning-rate (at most 0.25 of it)") in process.stdout


def test_invalid_jsonl_names_the_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    process = run_grpo(tmp_path / "run", "--data-path", str(data), expect_rc=2)
    assert f"{data}:2: invalid JSON" in process.stderr
    assert "Traceback" not in process.stderr


def test_import_has_no_side_effects(tmp_path):
    process = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); import grpo"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert process.returncode == 0 and process.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_help_documents_every_flag():
    process = subprocess.run([sys.executable, "grpo.py", "--help"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=120)
    assert process.returncode == 0
    for flag in ("--model", "--data-path", "--output-dir", "--seed", "--total-steps", "--prompts-per-step",
                 "--group-size", "--max-new-tokens", "--temperature", "--top-p", "--top-k", "--learning-rate",
                 "--kl-coef", "--clip-eps-low", "--clip-eps-high", "--loss-type", "--scale-rewards",
                 "--num-iterations", "--micro-batch-size", "--lora-r", "--dtype", "--gradient-checkpointing",
                 "--eval-every", "--save-every", "--track"):
        assert flag in process.stdout, flag


@pytest.mark.slow
def test_default_run_learns_the_task(tmp_path):
    out = tmp_path / "run"
    run_grpo(out, timeout=600)
    summary = read_summary(out)
    assert summary["eval_accuracy_start"] <= 0.3
    assert summary["eval_accuracy_end"] >= 0.9


def test_prm_reward_from_a_trained_prm(tmp_path, capsys, monkeypatch):
    import prm

    prm_dir = tmp_path / "prm"
    process = subprocess.run([sys.executable, "prm.py", "--output-dir", str(prm_dir), "--total-steps", "3",
                              "--eval-every", "0"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "WANDB_MODE": "disabled"})
    assert process.returncode == 0, process.stderr[-2000:]
    out = tmp_path / "run"
    run_grpo(out, *QUICK, "--prm-path", str(prm_dir / "final"), "--prm-aggregate", "prod",
             "--answer-reward-weight", "0", "--format-reward-weight", "0")
    for row in read_metrics(out):
        assert 0.0 <= row["reward_prm"] <= 1.0  # a product of step probabilities
        assert row["reward"] == pytest.approx(row["reward_prm"])  # the PRM alone is the reward
        assert "reward_answer" not in row
        assert 0.0 <= row["accuracy"] <= 1.0  # the answer reward, still logged though not in the reward
    both = tmp_path / "both"
    run_grpo(both, *QUICK, "--prm-path", str(prm_dir / "final"), "--prm-weight", "0.5")
    for row in read_metrics(both):
        expected = row["reward_answer"] + 0.1 * row["reward_format"] + 0.5 * row["reward_prm"]
        assert row["reward"] == pytest.approx(expected, abs=1e-5) and row["accuracy"] == row["reward_answer"]

    # an empty completion has no step: 0.0, not the score of one made-up empty step (which the PRM may like)
    args = grpo.Args(prm_path=str(prm_dir / "final"), answer_reward_weight=0, format_reward_weight=0)
    (_, prm_reward, _), = grpo.make_reward_fns(args, torch.device("cpu"))
    empty, whitespace, step = prm_reward(["start 3\n"] * 3, ["", "  ", "3+1=4"])
    assert empty == whitespace == 0.0 and 0.0 < step < 1.0
    # steps past the PRM's max length, which it cannot see, score 0 (writing on past them gains nothing), and a
    # warning says so (once)
    config_path = prm_dir / "final" / "prm_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "max_length": 18}))
    for aggregate in ("min", "mean"):
        (_, prm_reward, _), = grpo.make_reward_fns(grpo.Args(**{**vars(args), "prm_aggregate": aggregate}),
                                                   torch.device("cpu"))
        cut, short = prm_reward(["start 3\n"] * 2, ["3+1=4\n4+1=5\n5-1=4", "3+1=4"])
        seen = prm.score_steps(prm.load_prm(str(prm_dir / "final")), ["start 3\n"], [["3+1=4", "4+1=5", "5-1=4"]])[0]
        assert 0 < len(seen) < 3 and short > 0.0  # the last step does not fit
        assert cut == pytest.approx(0.0 if aggregate == "min" else sum(seen) / 3, abs=1e-6)
    capsys.readouterr()
    (_, prm_reward, _), = grpo.make_reward_fns(args, torch.device("cpu"))
    prm_reward(["start 3\n"] * 2, ["3+1=4\n4+1=5\n5-1=4", "3+1=4"])
    prm_reward(["start 3\n"], ["3+1=4\n4+1=5\n5-1=4"])
    err = capsys.readouterr().err
    assert err.count("warning: 1 of 2 completions have steps past the PRM's max length (18 tokens), which score 0") == 1
    assert "of 1 completions" not in err
    # a training prompt that fills the max length by itself leaves no step to score: warned, or refused for all
    long_prompt = "start 3\n" + "1" * 20
    grpo.make_reward_fns(args, torch.device("cpu"), ["start 3\n", long_prompt])
    assert ("warning: 1 of the 2 training prompts fill the PRM's max length (18 tokens) by themselves, leaving no "
            "room for a step: their completions get a PRM reward of 0") in capsys.readouterr().err
    with pytest.raises(grpo.UserError, match="--prm-path: 1 of the 1 training prompts fill the PRM's max length"):
        grpo.make_reward_fns(args, torch.device("cpu"), [long_prompt])
    # under torchrun each process scores its share and warns of its own: the counts say whose they are
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    (_, prm_reward, _), = grpo.make_reward_fns(args, torch.device("cpu"))
    prm_reward(["start 3\n"] * 2, ["3+1=4\n4+1=5\n5-1=4", "3+1=4"])
    assert "warning (process 1 of 2): 1 of 2 completions have steps past" in capsys.readouterr().err
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    # prod multiplies probabilities: an mse PRM's raw scores would make two negatives a positive reward
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "loss_kind": "mse"}))
    with pytest.raises(grpo.UserError, match="--prm-aggregate prod multiplies probabilities.*use min, last or mean"):
        grpo.make_reward_fns(grpo.Args(prm_path=str(prm_dir / "final"), prm_aggregate="prod"), torch.device("cpu"))
