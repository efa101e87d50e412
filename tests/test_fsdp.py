"""--fsdp in both scripts. Users get an error for it on CPU; the tests lift that (tests/fsdp_on_cpu.py) and run
FSDP2 over gloo with 2 processes, against one plain process on the same global batch: same metrics, same weights
(to 1e-5), and an exact resume from a sharded checkpoint. Also a stop signal under torchrun while rank 0 writes the
final model, with and without --fsdp, and a process that reads --model late while rank 0 would clear the output
directory it lies in."""

import json
import os
import signal
import subprocess
import time
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import grpo
import prm
from conftest import run_script_main

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
TIMING_KEYS = {"step_time_s", "generation_time_s", "reward_time_s", "reference_time_s", "update_time_s", "memory_mb"}

# --share-prompts always: two forward passes (prompts, then completions) before each backward pass under FSDP
GRPO_FLAGS = ["--total-steps", "3", "--prompts-per-step", "4", "--group-size", "8", "--micro-batch-size", "8",
              "--kl-coef", "0.05", "--learning-rate", "1e-3", "--eval-every", "2", "--num-eval-prompts", "8",
              "--save-every", "2", "--share-prompts", "always", "--weight-decay", "0.1"]
PRM_FLAGS = ["--total-steps", "3", "--batch-size", "16", "--micro-batch-size", "4", "--eval-every", "2",
             "--num-eval-rows", "40", "--num-val-rows", "40", "--learning-rate", "1e-3", "--save-every", "2",
             "--weight-decay", "0.1"]  # (decayed matrices, undecayed vectors: the groups survive a sharded resume)


def run_one(script: str, out: Path, *flags: str) -> None:
    process = subprocess.run([sys.executable, f"{script}.py", "--output-dir", str(out), *flags], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=300, env=ENV)
    assert process.returncode == 0, process.stderr[-3000:]


def run_fsdp(script: str, out: Path, *flags: str, timeout: int = 300, record_dir: Path = None) -> None:
    """torchrun with 2 processes; a run past the timeout (a deadlock) fails the test and leaves no worker behind.
    record_dir: the launcher that records some of grpo.py's calls there (tests/fsdp_record_calls.py)."""
    launcher, env = "tests/fsdp_on_cpu.py", ENV
    if record_dir is not None:
        launcher, env = "tests/fsdp_record_calls.py", {**ENV, "FSDP_RECORD_DIR": str(record_dir)}
    process = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                "2", launcher, script, "--fsdp", "--output-dir", str(out), *flags],
                               cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)  # torchrun starts each worker in a session of its own: found by parent id
        process.communicate()
        pytest.fail(f"{script} under FSDP did not finish in {timeout} s (deadlocked collectives?)")
    assert process.returncode == 0, stderr[-3000:]


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (Linux: parent ids from /proc), children first."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "(command name)": state, ppid, ...
        except OSError:
            continue  # exited meanwhile
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    for child in children:
        kill_tree(child)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


def weights(directory: Path) -> dict:
    return {f"{file.name}/{name}": tensor for file in sorted(directory.glob("*.safetensors"))
            for name, tensor in load_file(file).items()}


def assert_close_metrics(sharded: list[dict], plain: list[dict]) -> None:
    assert [row["step"] for row in sharded] == [row["step"] for row in plain]
    for a, b in zip(sharded, plain):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6, nan_ok=True), (a["step"], key)


def assert_close_weights(a: dict, b: dict, tolerance: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    assert max((a[name] - b[name]).abs().max().item() for name in a) < tolerance


@pytest.mark.parametrize("script, flags", [("grpo", GRPO_FLAGS), ("prm", PRM_FLAGS)])
def test_fsdp_equals_one_process_and_resumes_exactly(script, flags, tmp_path):
    plain, sharded = tmp_path / "plain", tmp_path / "sharded"
    run_one(script, plain, *flags)
    run_fsdp(script, sharded, *flags)
    assert_close_metrics(metrics(sharded), metrics(plain))
    assert_close_weights(weights(sharded / "final"), weights(plain / "final"))
    # the update did something: weights moved away from the plain run's step-2 checkpoint
    assert max((weights(plain / "final")[n] - w).abs().max().item()
               for n, w in weights(plain / "checkpoint-2").items()) > 1e-4
    # a sharded checkpoint holds whole weights, loadable without FSDP, equal to the plain run's
    assert_close_weights(weights(sharded / "checkpoint-2"), weights(plain / "checkpoint-2"))
    if script == "grpo":  # tokens/s count every process's tokens (completion lengths differ between processes)
        rows = [row for row in map(json.loads, (sharded / "metrics.jsonl").read_text().splitlines())
                if "generation_time_s" in row][1:]  # the timed training rows (not the start and end evaluations')
        summary = json.loads((sharded / "summary.json").read_text())
        assert summary["generated_tokens_per_s"] == pytest.approx(
            sum(row["completion_length"] * 32 for row in rows) / sum(row["generation_time_s"] for row in rows))

    # resume the sharded run from step 2: step 3 and the final weights repeat exactly
    uninterrupted, final = metrics(sharded), weights(sharded / "final")
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (resumed / "metrics.jsonl").write_text("".join(  # the rows up to the checkpoint, the start evaluation's too
        line + "\n" for line in (sharded / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 2))
    os.rename(sharded / "checkpoint-2", resumed / "checkpoint-2")
    run_fsdp(script, resumed, *flags, "--resume-from", "latest")
    assert metrics(resumed) == uninterrupted
    assert_close_weights(weights(resumed / "final"), final, tolerance=1e-7)


@pytest.mark.parametrize("script, flags", [
    ("grpo", ["--total-steps", "2", "--prompts-per-step", "4", "--group-size", "8", "--lora-r", "8",
              "--kl-coef", "0.05", "--eval-every", "0", "--num-eval-prompts", "8", "--share-prompts", "always",
              "--num-minibatches", "2"]),  # (each process holds one prompt of each minibatch)
    ("prm", ["--total-steps", "2", "--batch-size", "16", "--lora-r", "8", "--eval-every", "0",
             "--num-eval-rows", "40", "--num-val-rows", "40"]),
])
def test_fsdp_with_lora_equals_one_process(script, flags, tmp_path):
    plain, sharded = tmp_path / "plain", tmp_path / "sharded"
    run_one(script, plain, *flags)
    run_fsdp(script, sharded, *flags)
    assert_close_metrics(metrics(sharded), metrics(plain))
    adapters = weights(sharded / "final")
    assert any("lora_A" in name for name in adapters)  # the adapter, not the whole model
    assert_close_weights(adapters, weights(plain / "final"))


def test_fsdp_processes_agree_on_sharing_prompts(tmp_path):
    """--share-prompts auto decides per micro-batch from the prompt width; a process whose prompts are 18 positions
    wide skips 7 x 18 = 126 < 128 (one pass), one at 19 skips 133 (two passes). Under FSDP every forward is a
    collective, so the processes decide from the widest prompt of any: otherwise they would run different
    numbers of passes and deadlock (the timeout) or pair all-gathers wrongly."""
    rows = [{"prompt": f"({i:0{digits}d}+7)%10=", "answer": str((i + 7) % 10)}  # 17 or 18 characters, + BOS
            for i in range(4) for digits in (9, 10)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = ["--data-path", str(data), "--no-chat-template", "--total-steps", "3", "--prompts-per-step", "4",
             "--group-size", "8", "--micro-batch-size", "8", "--kl-coef", "0.05", "--eval-every", "0",
             "--num-eval-prompts", "0", "--share-prompts", "auto"]
    plain, sharded = tmp_path / "plain", tmp_path / "sharded"
    run_one("grpo", plain, *flags)
    run_fsdp("grpo", sharded, *flags, timeout=120)
    assert_close_metrics(metrics(sharded), metrics(plain))


def test_fsdp_processes_grouped_by_length_agree_on_sharing_prompts(tmp_path):
    """--group-by-length under FSDP: each process orders its own rows, so one process's micro-batch may hold two
    prompts' rows where the other's holds one prompt's. With --share-prompts auto and 19-token prompts (7 repeats x 19
    = 133 positions skipped: shared; 6 x 19 = 114: not) the processes would then make different numbers of passes
    and deadlock (the timeout). Seed 0's first step is such a batch (checked from what each process did): prompts
    are shared where every process would share them, and the run equals one process's."""
    rows = [{"prompt": f"{i:015d}+7=", "answer": str(i + 7)} for i in range(4)]  # 18 characters, + BOS
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    group_size = 8
    flags = ["--data-path", str(data), "--no-chat-template", "--total-steps", "1", "--prompts-per-step", "4",
             "--group-size", str(group_size), "--micro-batch-size", "8", "--max-new-tokens", "64", "--kl-coef",
             "0.05", "--eval-every", "0", "--num-eval-prompts", "0", "--share-prompts", "auto", "--seed", "0"]
    plain, sharded, record_dir = tmp_path / "plain", tmp_path / "sharded", tmp_path / "calls"
    record_dir.mkdir()
    run_one("grpo", plain, *flags)
    run_fsdp("grpo", sharded, *flags, timeout=120, record_dir=record_dir)
    assert_close_metrics(metrics(sharded), metrics(plain))

    calls = [[json.loads(line) for line in (record_dir / f"calls-{rank}.jsonl").read_text().splitlines()]
             for rank in (0, 1)]
    batchings = [[value for name, value in process_calls if name == "micro_batch_rows"] for process_calls in calls]
    assert [len(steps) for steps in batchings] == [1, 1]  # one step each
    (prompt_lengths, arrangement), (other_prompt_lengths, other_arrangement) = batchings[0][0], batchings[1][0]
    assert prompt_lengths == other_prompt_lengths == [19, 19]
    assert [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]] in (arrangement[0], other_arrangement[0])
    assert arrangement != other_arrangement  # one process sorted its rows by length, the other kept them in order
    would_share = [[grpo.prompt_sharing([row // group_size for row in rows], 19, "auto") is not None
                    for rows in micro_batches[0]] for micro_batches in (arrangement, other_arrangement)]
    assert would_share[0] != would_share[1]  # (else the test would not need the processes to agree)
    shared = [[value for name, value in process_calls if name == "completion_logprobs"] for process_calls in calls]
    agreed = [a and b for a, b in zip(*would_share)]
    assert shared[0] == shared[1] == agreed * 2  # the reference pass, then the update's


def test_fsdp_processes_agree_when_one_process_stops_at_once(tmp_path):
    """A micro-batch whose completions are all one token long (EOS first) takes one forward pass with shared prompts
    (no completion token is fed back), a longer one two. One process gets a prompt after which the model always
    says EOS, the other one after which it never does first: the processes must cut their micro-batches to the
    same completion width, or they run different numbers of collectives and deadlock (the timeout)."""
    torch.manual_seed(0)
    tokenizer = grpo.build_tiny_tokenizer()
    model = grpo.build_tiny_model(tokenizer).eval()
    stops, goes_on = "(100+7)%10=", "(188+7)%10="
    with torch.no_grad():  # the EOS row of the tied embedding: towards the first prompt's last hidden state, away
        last = [model(input_ids=torch.tensor([tokenizer(p)["input_ids"]]), output_hidden_states=True)
                .hidden_states[-1][0, -1] for p in (stops, goes_on)]  # from the second's (no EOS in the prompts)
        model.get_input_embeddings().weight[tokenizer.eos_token_id] = 20 * (last[0] / last[0].norm()
                                                                            - last[1] / last[1].norm())
        logits = [model(input_ids=torch.tensor([tokenizer(p)["input_ids"]])).logits[0, -1] for p in (stops, goes_on)]
    assert logits[0].argmax() == tokenizer.eos_token_id and logits[0].max() - logits[0].topk(2).values[1] > 20
    assert logits[1][tokenizer.eos_token_id] < logits[1].max() - 20
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "7"}) + "\n" for p in (stops, goes_on)))
    # one step: the rewards are all 0 here, so later steps would compare Adam's amplification of rounding noise
    flags = ["--model", str(tmp_path / "model"), "--data-path", str(data), "--no-chat-template", "--total-steps", "1",
             "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "4", "--kl-coef", "0.05",
             "--eval-every", "0", "--num-eval-prompts", "0", "--share-prompts", "always"]
    plain, sharded = tmp_path / "plain", tmp_path / "sharded"
    run_one("grpo", plain, *flags)
    run_fsdp("grpo", sharded, *flags, timeout=120)
    assert_close_metrics(metrics(sharded), metrics(plain))
    assert 1 < metrics(plain)[0]["completion_length"] < 4  # one prompt's completions stop at once, the other's not


@pytest.mark.parametrize("module, script", [(grpo, "grpo.py"), (prm, "prm.py")])
def test_fsdp_is_refused_on_cpu_and_in_one_process(module, script, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # not under torchrun
    code, err = run_script_main(module.main, script, ["--fsdp", "--output-dir", str(out)], capsys)
    assert code == 2 and err.startswith("error: --fsdp needs CUDA") and err.count("\n") == 1
    monkeypatch.setattr(module, "FSDP_DEVICE_TYPES", ("cuda", "cpu"))
    code, err = run_script_main(module.main, script, ["--fsdp", "--output-dir", str(out)], capsys)
    assert code == 2 and "launch with torchrun" in err and err.count("\n") == 1
    assert not out.exists()
    assert torch.distributed.is_initialized() is False


def test_compiled_decoding_is_refused_with_fsdp(tmp_path, capsys, monkeypatch):
    """Measured on 2 CPU processes: graph breaks at FSDP's hooks, recompiles per layer, no faster rollout."""
    out = tmp_path / "out"
    monkeypatch.setattr(grpo, "FSDP_DEVICE_TYPES", ("cuda", "cpu"))
    code, err = run_script_main(grpo.main, "grpo.py", ["--fsdp", "--compile-decoding", "--output-dir", str(out)],
                                capsys)
    assert code == 2 and err.startswith("error: --compile-decoding with --fsdp") and err.count("\n") == 1
    assert not out.exists()


def test_a_checkpoint_from_before_the_fsdp_flag_resumes(tmp_path, capsys):
    """Checkpoints written before --fsdp existed have no such key in args.json: it counts as the default (off)."""
    from test_grpo_runs import QUICK

    out = tmp_path / "run"
    flags = ["--output-dir", str(out), *QUICK, "--total-steps", "2", "--save-every", "1"]
    assert run_script_main(grpo.main, "grpo.py", flags, capsys)[0] == 0
    args_file = out / "checkpoint-1" / "args.json"
    saved = json.loads(args_file.read_text())
    del saved["fsdp"]
    args_file.write_text(json.dumps(saved))
    code, err = run_script_main(grpo.main, "grpo.py", [*flags, "--resume-from", str(out / "checkpoint-1")], capsys)
    assert code == 0, err
    code, err = run_script_main(grpo.main, "grpo.py", [*flags, "--resume-from", str(out / "checkpoint-1"),
                                                       "--kl-coef", "0.5"], capsys)
    assert code == 2 and "--kl-coef" in err  # the other settings are still compared


SLOW_FINAL_SAVE = '''"""torchrun launcher: grpo.py or prm.py whose rank 0 writes final/ slowly (a large model) and says
when it starts.
    torchrun ... slow_final_save.py <repo> <grpo|prm> <marker file> <flags>"""
import importlib, os, sys, time
sys.path.insert(0, sys.argv[1])
script, marker = importlib.import_module(sys.argv[2]), sys.argv[3]
script.FSDP_DEVICE_TYPES = ("cuda", "cpu")
name = "save_checkpoint" if sys.argv[2] == "grpo" else "save_prm"
save = getattr(script, name)
def slow_save(path, *args, **kwargs):
    if os.path.basename(path.rstrip("/")) == "final":
        open(marker, "w").close()
        time.sleep(6)
    return save(path, *args, **kwargs)
setattr(script, name, slow_save)
sys.argv = [sys.argv[2] + ".py", *sys.argv[4:]]
script.main()
'''


@pytest.mark.parametrize("script, flags", [("grpo", []), ("prm", ["--fsdp"])])
def test_a_stop_signal_while_rank_0_writes_the_final_model_stops_every_process_cleanly(script, flags, tmp_path):
    """torchrun passes a SIGTERM to every process. While rank 0 writes final/, the others wait for it; if they
    already had the default handlers back, the signal killed them, and rank 0's next collective failed with a
    traceback (prm.py's checkpoint beside final/, which a resume needs, was never written). Under --fsdp every
    process first gathers the weights; without it the others reach the wait at once: both must stop as one
    process does, with the stop message and the checkpoint."""
    launcher, marker, out = tmp_path / "slow_final_save.py", tmp_path / "final-save-started", tmp_path / "run"
    launcher.write_text(SLOW_FINAL_SAVE)
    quick = (["--total-steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--eval-every", "0",
              "--num-eval-prompts", "8"] if script == "grpo" else
             ["--total-steps", "2", "--batch-size", "8", "--eval-every", "0", "--num-eval-rows", "20",
              "--num-val-rows", "20"])
    process = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                "2", str(launcher), str(REPO_ROOT), script, str(marker), "--output-dir", str(out),
                                *quick, *flags], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=ENV)
    try:
        deadline = time.time() + 200
        while not marker.exists() and process.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the run never reached its final save"
        time.sleep(1.5)  # the other process is now waiting for rank 0
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=120)
    except (subprocess.TimeoutExpired, AssertionError):
        kill_tree(process.pid)
        raise
    assert "stopped by a signal after saving the final model" in stdout, stderr[-3000:]
    # (torchrun itself ends with a traceback of its SignalException; the workers' own would name their files)
    assert f'{script}.py", line' not in stderr and "Connection closed" not in stderr, stderr[-3000:]
    assert (out / "final").is_dir() and not (out / "final.tmp").exists()
    if script == "prm":  # (a final PRM has no trainer state: the checkpoint is what a resume continues)
        assert (out / "checkpoint-2").is_dir()


LATE_RANK_1 = '''"""torchrun launcher: grpo.py or prm.py (--fsdp allowed on CPU) whose rank 1 loads its model 3 s
    late (a slow file system).
    torchrun ... late_rank_1.py <repo> <grpo|prm> <flags>"""
import importlib, os, sys, time
sys.path.insert(0, sys.argv[1])
script = importlib.import_module(sys.argv[2])
script.FSDP_DEVICE_TYPES = ("cuda", "cpu")
name = "load_model_and_tokenizer" if sys.argv[2] == "grpo" else "load_backbone_and_tokenizer"
load = getattr(script, name)
def late_load(*args, **kwargs):
    if os.environ["RANK"] == "1":
        time.sleep(3)
    return load(*args, **kwargs)
setattr(script, name, late_load)
sys.argv = [sys.argv[2] + ".py", *sys.argv[3:]]
script.main()
'''


# prm.py: sharded (no broadcast of the weights, whose wait on gloo would hide the race) and without the packing check
# (whose forward waits too)
@pytest.mark.parametrize("script, flags", [("grpo", ["--prompts-per-step", "2", "--group-size", "4",
                                                      "--num-eval-prompts", "8"]),
                                           ("prm", ["--batch-size", "8", "--num-eval-rows", "20", "--num-val-rows",
                                                    "20", "--fsdp", "--no-pack-rows"])])
def test_rank_0_changes_the_output_dir_only_once_every_process_has_read_the_model(script, flags, tmp_path):
    """--overwrite with --model <output dir>/final (start again from the last run's weights, in its place): rank 0
    deletes final/ when it clears the run; a process still loading that model must have read it first."""
    out = tmp_path / "run"
    run_one("grpo", out, "--total-steps", "1", "--prompts-per-step", "2", "--group-size", "4", "--eval-every", "0",
            "--num-eval-prompts", "8")
    launcher = tmp_path / "late_rank_1.py"
    launcher.write_text(LATE_RANK_1)
    process = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                              str(launcher), str(REPO_ROOT), script, "--model", str(out / "final"), "--overwrite",
                              "--output-dir", str(out), "--total-steps", "1", "--eval-every", "0", *flags],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert process.returncode == 0, process.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == 1
