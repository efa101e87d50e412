"""prm.py: flags and entry points that are easy to break without any other test noticing. --epochs sets the number
of steps and shows every row the promised number of times; --gradient-checkpointing is really on and changes
nothing but memory; --max-grad-norm bounds the gradient the optimiser applies; importing prm does nothing; a wandb
that cannot start costs a warning, not the run; train() returns what summary.json holds. All runs are in-process,
on a small data file, 1-10 steps of the tiny model."""

import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.multiprocessing.reductions import StorageWeakRef

import prm
from test_prm import REPO_ROOT, builtin_rows, read_eval_rows, read_metrics, read_summary, write_rows
from test_prm_reliability import SMALL, max_difference, nan_on_calls, run_main, small_data

# wall-clock and memory readings differ between any two runs; everything else in a metrics row must not
TIMING_KEYS = {"step_time_s", "memory_mb"}
# what the spies below call through to (never a spy set up for an earlier run of the same test)
REAL_ADAMW, REAL_BUILD_PRM, REAL_COLLATE = torch.optim.AdamW, prm.build_prm, prm.collate
# no held-out metrics during the run, no warm-up (the first steps move the weights at the full rate)
FEW = ["--eval-every", "0", "--warmup-steps", "0"]


@pytest.fixture(autouse=True)
def one_thread():
    """One thread, as the subprocess runs use: a tiny model gains nothing from more, and the comparisons of two
    runs below then see the same reduction order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_matmul_probe(monkeypatch):
    """The summary's 0.5 s matmul measurement (for the FLOP-floor fraction) is not under test here."""
    monkeypatch.setattr(prm, "matmul_flops_per_s", lambda *args, **kwargs: 1e12)


def data_file(tmp_path: Path, count: int, name: str = "train.jsonl", seed: int = 7) -> str:
    return str(write_rows(tmp_path / name, builtin_rows(count, seed)))


def train_ok(argv: list[str], capsys) -> tuple[str, str]:
    code, out, err = run_main(argv, capsys, with_stdout=True)
    assert code == 0, f"rc {code}\n{out[-3000:]}\n{err[-3000:]}"
    return out, err


# ---------------------------------------------------------------------------------------------------------------
# --epochs


@pytest.mark.parametrize("epochs, steps, seen_twice", [(2, 10, 40), (1.5, 8, 24)])
def test_epochs_set_the_steps_and_show_each_row_as_often_as_promised(epochs, steps, seen_twice, tmp_path, capsys,
                                                                     monkeypatch, no_matmul_probe):
    # 40 training rows (none held out for validation), batches of 8: --epochs E is ceil(E * 40 / 8) steps, whatever
    # --total-steps says, and each epoch is one pass over a fresh permutation of the rows
    batches = []

    def spy_collate(examples, *args, **kwargs):
        batches.append([id(example) for example in examples])
        return REAL_COLLATE(examples, *args, **kwargs)

    monkeypatch.setattr(prm, "collate", spy_collate)
    out = tmp_path / "out"
    train_ok(["--output-dir", str(out), *FEW, "--data-path", data_file(tmp_path, 40), "--num-val-rows", "0",
              "--batch-size", "8", "--total-steps", "3", "--epochs", str(epochs)], capsys)
    assert read_summary(out)["steps"] == steps == math.ceil(epochs * 40 / 8)
    assert [row["step"] for row in read_metrics(out)] == list(range(1, steps + 1))
    # no held-out rows and no micro-batches: every collate call is one training step's whole batch
    assert len(batches) == steps and all(len(batch) == 8 for batch in batches)
    assert read_summary(out)["train_rows"] == 40
    first_epoch = [i for batch in batches[:5] for i in batch]
    second_epoch = [i for batch in batches[5:] for i in batch]
    assert len(set(first_epoch)) == 40  # the first 5 steps: every row exactly once
    assert len(set(second_epoch)) == len(second_epoch) == seen_twice  # then a second pass, no row twice in it
    assert second_epoch != first_epoch[:len(second_epoch)]  # a new order, not the first epoch's again
    times_seen = Counter(Counter(first_epoch + second_epoch).values())  # how many rows were seen once, twice
    assert times_seen == Counter({2: seen_twice, 1: 40 - seen_twice}) - Counter()  # (- drops a zero count)


def test_epochs_of_fewer_rows_than_a_batch_say_how_many_passes_they_make(tmp_path, capsys, no_matmul_probe):
    """A step is a whole batch: --epochs 1 of 5 rows in batches of 32 is one step that shows each row 6.4 times."""
    code, stdout, err = run_main(["--output-dir", str(tmp_path / "out"), *FEW, "--data-path", data_file(tmp_path, 5),
                                  "--num-val-rows", "0", "--batch-size", "32", "--epochs", "1"], capsys,
                                 with_stdout=True)
    assert code == 0 and read_summary(tmp_path / "out")["steps"] == 1, err
    assert ("note: --epochs 1.0 of 5 training rows in steps of --batch-size 32 is 6.4 passes over the rows; lower "
            "--batch-size for fewer") in stdout
    code, stdout, err = run_main(["--output-dir", str(tmp_path / "out"), "--overwrite", *FEW, "--data-path",
                                  data_file(tmp_path, 40), "--num-val-rows", "0", "--batch-size", "8", "--epochs",
                                  "1.1"], capsys, with_stdout=True)
    assert code == 0 and "passes over the rows" not in stdout, err  # 6 steps of 8: 1.2 passes, as good as asked


# ---------------------------------------------------------------------------------------------------------------
# --gradient-checkpointing


def capture_prm(monkeypatch) -> dict:
    """Keeps the PRM that train builds, and counts its training forwards and the runs of its decoder layers' MLPs
    (inside the layer: what a checkpointed layer's recomputation in the backward pass runs again). Counted by
    wrapping the MLPs' forward: module hooks would see no recomputation (transformers checkpoints the layer's
    forward, not its __call__, and torch runs no forward hooks while recomputing)."""
    captured = {"layer_calls": 0, "training_forwards": 0}

    def spy_build(*args, **kwargs):
        model, base = REAL_BUILD_PRM(*args, **kwargs)
        captured["prm"] = model
        layers = [m for m in model.backbone.modules() if type(m).__name__ == "LlamaDecoderLayer"]
        captured["layers"] = len(layers)
        for layer in layers:
            def counted(*args, _forward=layer.mlp.forward, **kwargs):
                captured["layer_calls"] += 1
                return _forward(*args, **kwargs)

            layer.mlp.forward = counted
        model.register_forward_hook(lambda module, *_: captured.__setitem__(
            "training_forwards", captured["training_forwards"] + module.training))
        return model, base

    monkeypatch.setattr(prm, "build_prm", spy_build)
    return captured


def final_weights(out: Path) -> dict:
    weights = {}
    for name in ("model.safetensors", "adapter_model.safetensors", "reward_head.safetensors"):
        if (out / "final" / name).exists():
            weights.update({f"{name}:{key}": value for key, value in load_file(out / "final" / name).items()})
    return weights


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gradient_checkpointing_is_on_and_changes_nothing_but_memory(lora, tmp_path, capsys, monkeypatch,
                                                                     no_matmul_probe):
    data = data_file(tmp_path, 24)
    flags = [*FEW, "--data-path", data, "--num-val-rows", "0", "--batch-size", "4", "--micro-batch-size", "2",
             "--total-steps", "2", *(["--lora-r", "4"] if lora else [])]
    runs = {}
    for checkpointing in (False, True):
        captured = capture_prm(monkeypatch)
        out = tmp_path / f"checkpointing-{checkpointing}"
        train_ok(["--output-dir", str(out), *flags, *(["--gradient-checkpointing"] if checkpointing else [])], capsys)
        runs[checkpointing] = out, captured
    (plain, off), (checkpointed, on) = runs[False], runs[True]
    # the flag reached the backbone: transformers says so ...
    base_model = lambda model: next(m for m in model.backbone.modules() if type(m).__name__ == "LlamaModel")
    is_on = lambda model: getattr(base_model(model), "is_activation_checkpointing",
                                  getattr(base_model(model), "is_gradient_checkpointing", None))
    assert is_on(on["prm"]) is True and is_on(off["prm"]) is False
    # ... and it acted: every decoder layer ran once more for each training forward (its recomputation in the
    # backward pass), and nowhere else (the packing check runs without gradients, and is not checkpointed)
    assert on["training_forwards"] == off["training_forwards"] == 2 * 2  # 2 steps of 2 micro-batches
    assert on["layer_calls"] == off["layer_calls"] + on["layers"] * on["training_forwards"]
    # the same run: metrics rows (loss to 1e-5) and final weights
    rows_off, rows_on = read_metrics(plain), read_metrics(checkpointed)
    assert len(rows_off) == len(rows_on) == 2
    for a, b in zip(rows_off, rows_on, strict=True):
        assert a.keys() == b.keys()
        for key in a.keys() - TIMING_KEYS:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), key
    weights_off, weights_on = final_weights(plain), final_weights(checkpointed)
    assert weights_off.keys() == weights_on.keys()
    assert any(key.startswith("adapter_model") for key in weights_on) == lora
    for key in weights_off:
        torch.testing.assert_close(weights_on[key], weights_off[key], rtol=1e-5, atol=1e-6, msg=key)


# ---------------------------------------------------------------------------------------------------------------
# --max-grad-norm


def spy_optimizer_grad_norms(monkeypatch) -> list[float]:
    """The global norm of the gradients the optimiser holds at each of its steps (what it is about to apply)."""
    seen = []

    class SpyAdamW(REAL_ADAMW):
        def step(self, closure=None):
            grads = [p.grad.float() for group in self.param_groups for p in group["params"] if p.grad is not None]
            seen.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())
            return super().step(closure)

    monkeypatch.setattr(torch.optim, "AdamW", SpyAdamW)
    return seen


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_max_grad_norm_bounds_the_gradient_the_optimiser_applies(lora, tmp_path, capsys, monkeypatch,
                                                                 no_matmul_probe):
    data = data_file(tmp_path, 24)
    flags = [*FEW, "--data-path", data, "--num-val-rows", "0", "--batch-size", "4", "--total-steps", "2",
             *(["--lora-r", "4"] if lora else [])]
    results = {}
    for limit in ("1e-3", "1e6", "0"):
        seen = spy_optimizer_grad_norms(monkeypatch)
        out = tmp_path / f"limit-{limit}"
        train_ok(["--output-dir", str(out), *flags, "--max-grad-norm", limit], capsys)
        logged = [row["grad_norm"] for row in read_metrics(out)]  # the norm before clipping
        assert len(seen) == len(logged) == 2
        results[limit] = seen, logged
    seen, logged = results["1e-3"]
    assert all(norm > 1e-2 for norm in logged)  # clipping had something to do ...
    assert all(0.999e-3 <= norm <= 1e-3 * (1 + 1e-5) for norm in seen), seen  # ... and scaled down to the limit
    for limit in ("1e6", "0"):  # far above every norm, and 0 = off: the optimiser gets the gradient as it is
        seen, logged = results[limit]
        assert all(norm > 1e-2 for norm in seen)
        assert seen == pytest.approx(logged, rel=1e-5)
    # the first step starts from the same weights and batch: the same gradient before clipping, whatever the limit
    assert results["1e-3"][1][0] == pytest.approx(results["1e6"][1][0], rel=1e-6)


def gradients_held_at_each_backward(monkeypatch) -> list[int]:
    """Counts, at every backward pass after the first update, the gradients of earlier updates that something still
    holds. Each is as large as its weight: one set held over doubles the gradient memory at the peak, where the
    next backward allocates its own."""
    applied, held = [], []

    class SpyAdamW(REAL_ADAMW):
        def step(self, closure=None):
            applied.extend(StorageWeakRef(p.grad.untyped_storage()) for group in self.param_groups
                           for p in group["params"] if p.grad is not None)
            return super().step(closure)

    real_backward = torch.Tensor.backward

    def backward(self, *args, **kwargs):
        if applied:
            held.append(sum(not ref.expired() for ref in applied))
        return real_backward(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", SpyAdamW)
    monkeypatch.setattr(torch.Tensor, "backward", backward)
    return held


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_no_gradient_outlives_its_update(lora, tmp_path, capsys, monkeypatch, no_matmul_probe):
    held = gradients_held_at_each_backward(monkeypatch)
    train_ok(["--output-dir", str(tmp_path / "run"), *FEW, "--data-path", data_file(tmp_path, 24), "--num-val-rows",
              "0", "--batch-size", "4", "--micro-batch-size", "2", "--total-steps", "3",
              *(["--lora-r", "4"] if lora else [])], capsys)
    assert len(held) == 4  # two micro-batches in each of steps 2 and 3
    assert held == [0] * 4, f"gradients of an earlier update still held at each later backward: {held}"


def test_bf16_micro_batch_gradients_are_added_in_fp32(tmp_path, capsys, monkeypatch, no_matmul_probe):
    """bf16 weights, 4 micro-batches of 2 rows: each micro-batch's (bf16) gradient, captured by a hook, summed in
    fp64, is what the optimiser gets, to fp32 rounding (added in bf16 p.grad, they were a bf16 rounding or more
    off)."""
    captured, trainable, checked = {}, [], []

    def hooking_build_prm(*args, **kwargs):
        model, base = REAL_BUILD_PRM(*args, **kwargs)
        trainable.extend(p for p in model.parameters() if p.requires_grad)  # in the order of the optimiser's copies
        for p in trainable:
            p.register_hook(lambda g, p=p: captured.__setitem__(id(p), captured.get(id(p), 0) + g.double()))
        return model, base

    real_clip = torch.nn.utils.clip_grad_norm_

    def checking_clip(master, *args, **kwargs):
        pairs = [(p, m) for p, m in zip(trainable, master, strict=True) if p.dtype == torch.bfloat16]
        difference = sum(float((m.grad.double() - captured[id(p)]).square().sum()) for p, m in pairs)
        exact = sum(float(captured[id(p)].square().sum()) for p, _ in pairs)
        checked.append((difference / exact) ** 0.5)
        captured.clear()
        return real_clip(master, *args, **kwargs)

    monkeypatch.setattr(prm, "build_prm", hooking_build_prm)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", checking_clip)
    train_ok(["--output-dir", str(tmp_path / "run"), *FEW, "--data-path", data_file(tmp_path, 24), "--num-val-rows",
              "0", "--batch-size", "8", "--micro-batch-size", "2", "--total-steps", "2", "--dtype", "bfloat16"],
             capsys)
    assert len(checked) == 2 and all(error < 1e-6 for error in checked), checked


# ---------------------------------------------------------------------------------------------------------------
# import, wandb, train()


def test_import_has_no_side_effects(tmp_path):
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    marker = "import done: "
    code = (f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); import prm; import json, torch; "
            f"print({marker!r} + json.dumps({{'wandb': 'wandb' in sys.modules, "
            "'distributed': torch.distributed.is_initialized(), 'cuda': torch.cuda.is_initialized()}))")
    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}  # nothing written there either
    process = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                             env=env)
    assert process.returncode == 0, process.stderr[-3000:]
    assert process.stderr == ""
    # the import printed nothing: the marker (printed after it) is all of stdout
    assert process.stdout.startswith(marker) and process.stdout.count("\n") == 1, process.stdout
    assert json.loads(process.stdout[len(marker):]) == {"wandb": False, "distributed": False, "cuda": False}
    assert list(cwd.iterdir()) == [] and list(home.iterdir()) == []


def test_a_wandb_that_cannot_start_is_a_warning_not_a_failed_run(tmp_path, capsys, monkeypatch, no_matmul_probe):
    try:
        import wandb
    except ImportError:  # the same code path with a stand-in module
        wandb = type(sys)("wandb")
        monkeypatch.setitem(sys.modules, "wandb", wandb)
    calls = []

    def failing_init(*args, **kwargs):
        calls.append(kwargs)
        raise RuntimeError("no network here")

    monkeypatch.setattr(wandb, "init", failing_init, raising=False)
    monkeypatch.setenv("WANDB_MODE", "disabled")  # should the patch miss, no network either
    out = tmp_path / "out"
    _, err = train_ok(["--output-dir", str(out), *FEW, "--data-path", data_file(tmp_path, 24), "--batch-size", "4",
                       "--total-steps", "2", "--track", "--wandb-project-name", "prm-test"], capsys)
    assert len(calls) == 1 and calls[0]["project"] == "prm-test"  # --track tried to start wandb
    assert ("WARNING: wandb could not start (RuntimeError: no network here); continuing without it. "
            "Run `wandb login`, or set WANDB_MODE=offline to log locally.") in err
    assert [row["step"] for row in read_metrics(out)] == [1, 2]
    assert read_summary(out)["steps"] == 2 and (out / "final" / "reward_head.safetensors").exists()


def same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def test_train_returns_the_summary_it_writes(tmp_path):
    out = tmp_path / "out"
    args = prm.Args(output_dir=str(out), data_path=data_file(tmp_path, 24),
                    eval_data_path=data_file(tmp_path, 8, "eval.jsonl", seed=8), num_val_rows=2, batch_size=4,
                    total_steps=2, eval_every=0, warmup_steps=0)
    returned = prm.train(args)
    written = read_summary(out)
    assert isinstance(returned, dict) and returned.keys() == written.keys()
    assert {"steps", "eval_auroc_end", "tokens_per_s", "peak_memory_mb"} <= returned.keys()
    assert returned["steps"] == 2 and returned["eval_rows"] == 8
    different = {key: (returned[key], written[key]) for key in returned if not same(returned[key], written[key])}
    assert not different
    # and the values are plain Python numbers, not tensors or numpy scalars (the file holds them as they are)
    assert all(isinstance(value, (bool, int, float, str, type(None))) for value in returned.values())


# ---------------------------------------------------------------------------------------------------------------
# Wiring that a helper's mutation audit found untested: each test fails on the mutation named in its docstring


def test_bf16_training_moves_the_backbone_weights(tmp_path, capsys):
    """The optimiser steps the fp32 masters; the bf16 weights the model computes with are copied from them after
    each update (without that copy only the fp32 head would train)."""
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--total-steps",
                          "2", "--dtype", "bfloat16"], capsys)
    assert code == 0, err
    prm.seed_everything(1)
    initial, _ = prm.build_prm(prm.Args(), torch.bfloat16)
    assert max_difference(load_file(out / "final" / "model.safetensors"), initial.backbone.state_dict()) > 0


def test_bf16_resume_matches_an_uninterrupted_run(tmp_path, capsys):
    """The checkpoint's fp32 masters are restored, not rebuilt from the rounded bf16 weights (4.9e-4 off)."""
    import shutil

    flags = [*SMALL, "--data-path", small_data(tmp_path), "--total-steps", "3", "--save-every", "1",
             "--keep-checkpoints", "3", "--dtype", "bfloat16", "--learning-rate", "1e-4"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_main(["--output-dir", str(straight), *flags], capsys)[0] == 0
    shutil.copytree(straight / "checkpoint-1", resumed / "checkpoint-1")
    assert run_main(["--output-dir", str(resumed), *flags, "--resume-from", "latest"], capsys)[0] == 0
    assert max_difference(load_file(straight / "final" / "model.safetensors"),
                          load_file(resumed / "final" / "model.safetensors")) == 0.0


def test_no_pack_rows_is_obeyed(tmp_path, capsys, monkeypatch):
    packed = []
    monkeypatch.setattr(prm, "collate", lambda examples, pad_id, device, pack=False: (
        packed.append(pack), REAL_COLLATE(examples, pad_id, device, pack))[1])
    code, err = run_main(["--output-dir", str(tmp_path / "out"), *SMALL, "--data-path", small_data(tmp_path),
                          "--total-steps", "1", "--no-pack-rows"], capsys)
    assert code == 0, err
    assert packed and not any(packed)


def test_the_logged_accuracy_is_the_batch_accuracy(tmp_path, capsys, monkeypatch):
    """Each micro-batch's accuracy weighted by its labelled steps, not their plain mean."""
    calls, real_loss = [], prm.prm_loss

    def spy(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        calls.append((stats["accuracy"].item() * stats["steps"].item(), stats["steps"].item()))
        return loss, stats

    monkeypatch.setattr(prm, "prm_loss", spy)
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--total-steps", "1",
                          "--micro-batch-size", "2"], capsys)
    assert code == 0, err
    assert len(calls) == 2 and calls[0][1] != calls[1][1]  # two micro-batches with different step counts
    assert read_metrics(out)[0]["accuracy"] == pytest.approx(sum(a for a, _ in calls) / sum(n for _, n in calls))


def test_num_eval_rows_caps_an_eval_file(tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--total-steps", "1",
                          "--eval-data-path", small_data(tmp_path), "--num-eval-rows", "5"], capsys)
    assert code == 0, err
    assert read_summary(out)["eval_rows"] == 5


def test_a_finite_loss_with_a_non_finite_gradient_skips_the_update(tmp_path, capsys, monkeypatch):
    real_loss = prm.prm_loss

    def nan_gradient(logits, *args, **kwargs):
        loss, stats = real_loss(logits, *args, **kwargs)
        return loss + 0.0 * torch.sqrt(logits.sum() * 0.0), stats  # the same value, a NaN gradient (d sqrt(0))

    monkeypatch.setattr(prm, "prm_loss", nan_gradient)
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--total-steps", "2",
                          "--max-bad-steps", "5"], capsys)
    assert code == 0, err
    assert read_summary(out)["skipped_updates"] == 2
    assert all(torch.isfinite(t).all() for t in load_file(out / "final" / "model.safetensors").values())


def test_resume_refuses_another_step_separator(tmp_path, capsys):
    data, first = small_data(tmp_path), tmp_path / "first"
    assert run_main(["--output-dir", str(first), *SMALL, "--data-path", data, "--total-steps", "1", "--save-every",
                     "1"], capsys)[0] == 0
    code, err = run_main(["--output-dir", str(tmp_path / "out"), *SMALL, "--data-path", data, "--total-steps", "2",
                          "--resume-from", str(first / "checkpoint-1"), "--step-separator", "\n\n"], capsys)
    assert code == 2 and "--step-separator" in err


def test_micro_batches_make_the_same_update_in_one_process(tmp_path, capsys):
    """Each micro-batch's loss is divided by the whole batch's labelled steps (a per-micro-batch count: 2e-4 off)."""
    data, finals, losses = small_data(tmp_path), [], []
    for micro_batch in ("0", "1"):
        out = tmp_path / f"micro-{micro_batch}"
        code, err = run_main(["--output-dir", str(out), *SMALL, "--data-path", data, "--total-steps", "1",
                              "--micro-batch-size", micro_batch, "--learning-rate", "1e-4"], capsys)
        assert code == 0, err
        finals.append(load_file(out / "final" / "model.safetensors"))
        losses.append(read_metrics(out)[0]["loss"])
    assert max_difference(*finals) < 1e-5 and losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_no_second_evaluation_at_the_last_step(tmp_path, capsys):
    """The last step's evaluation is the final one, in summary.json and in a row of its own after the last training
    row, not also in that row."""
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--total-steps", "2",
                          "--eval-every", "1", "--eval-data-path", small_data(tmp_path), "--num-eval-rows", "8"],
                         capsys)
    assert code == 0, err
    metrics = read_metrics(out)
    assert "eval_auroc" in metrics[0] and "eval_auroc" not in metrics[1]
    final_evaluation = read_eval_rows(out)[-1]
    assert final_evaluation["step"] == 2 and final_evaluation["eval_auroc"] == read_summary(out)["eval_auroc_end"]


def test_resume_keeps_the_skipped_update_count(tmp_path, capsys, monkeypatch):
    nan_on_calls(monkeypatch, lambda n: n == 1)  # the first run's only step; the resumed run's calls are 2 and on
    out = tmp_path / "out"
    flags = ["--output-dir", str(out), *SMALL, "--data-path", small_data(tmp_path), "--save-every", "1"]
    assert run_main([*flags, "--total-steps", "1"], capsys)[0] == 0
    assert run_main([*flags, "--total-steps", "2", "--resume-from", "latest"], capsys)[0] == 0
    assert read_summary(out)["skipped_updates"] == 1 and read_metrics(out)[1]["skipped_updates"] == 1


def test_validation_rows_are_a_seeded_shuffle_not_the_head_of_the_file(tmp_path, capsys, monkeypatch):
    """A tenth of the rows at most, drawn by a seeded shuffle, and only when an eval file is given: they choose the
    threshold of the eval's first-error F1 and serve nothing else, so without one every row is trained on."""
    seen, real_encode = {}, prm.encode_rows
    monkeypatch.setattr(prm, "encode_rows", lambda tokenizer, rows, separator, length, what="training", **kwargs: (
        seen.setdefault(what, rows), real_encode(tokenizer, rows, separator, length, what, **kwargs))[1])
    rows = builtin_rows(40)
    data = write_rows(tmp_path / "rows.jsonl", rows)
    eval_data = write_rows(tmp_path / "eval.jsonl", builtin_rows(44)[40:])
    assert run_main(["--output-dir", str(tmp_path / "out"), *SMALL, "--data-path", str(data), "--total-steps", "1",
                     "--eval-data-path", str(eval_data)], capsys)[0] == 0
    assert len(seen["validation"]) == 4 and seen["validation"] != rows[:4] and len(seen["training"]) == 36
    seen.clear()
    code, out, _ = run_main(["--output-dir", str(tmp_path / "no-eval"), *SMALL, "--data-path", str(data),
                             "--total-steps", "1"], capsys, with_stdout=True)
    assert code == 0 and len(seen["training"]) == 40 and seen["validation"] == []
    assert "40 training rows, 0 validation, 0 eval" in out


def test_scoring_skips_bad_rows_when_asked_and_keeps_their_lines(tmp_path, capsys):
    """Output line k is input line k's, whether scored by a saved PRM or at the end of training: a skipped row
    leaves {"skipped": "line N: what is wrong", "scores": null} in its place."""
    model, _ = prm.build_prm(prm.Args(), torch.float32)
    prm.save_prm(str(tmp_path / "prm"), model)
    good = [{"prompt": "start 1\n", "completions": ["1+1=2"], "id": 1},
            {"prompt": "start 2\n", "completions": ["2+1=3", "3+1=4"], "id": 3}]
    data = write_rows(tmp_path / "rows.jsonl", [good[0], "{", good[1], {"prompt": "p"}])
    runs = {"score": ["--prm-path", str(tmp_path / "prm")],
            "train": ["--output-dir", str(tmp_path / "run"), *SMALL, "--total-steps", "1"]}
    for name, flags in runs.items():
        out = tmp_path / f"{name}.jsonl"
        code, stdout, err = run_main([*flags, "--score-data-path", str(data), "--scores-output", str(out),
                                      "--skip-bad-rows"], capsys, with_stdout=True)
        assert code == 0, err
        assert f"scored 3 steps of 2 rows into {out} (0 steps truncated away, 2 rows skipped)" in stdout, name
        written = [json.loads(line) for line in out.read_text().splitlines()]
        assert [row.get("id") for row in written] == [1, None, 3, None], name
        assert [len(row["scores"]) for row in (written[0], written[2])] == [1, 2]
        assert written[1]["scores"] is None and written[1]["skipped"].startswith("line 2: ")
        assert written[3] == {"skipped": "line 4: " + written[3]["skipped"][8:], "scores": None}
        assert "completions" in written[3]["skipped"]


def test_a_score_that_is_not_finite_is_written_as_null_with_a_warning(tmp_path, capsys):
    """JSON has no NaN: json.dumps' bare NaN made a scores file that strict parsers reject. An input row's own NaN
    and Infinity (which Python's json reads) are written as null too."""
    rows = [{"prompt": "p", "completions": ["a", "b", "c"]}, {"prompt": "q", "completions": ["d"]},
            {"prompt": "r", "completions": ["e"], "reward": float("nan"), "meta": {"bounds": [1.5, -float("inf")]}}]
    written = prm.write_scores(str(tmp_path / "scores.jsonl"), rows, [[0.25, float("nan"), float("inf")], [], [0.5]])
    assert written == {"rows": 3, "skipped_rows": 0, "scored_steps": 4, "dropped_steps": 1}

    def no_constants(name):
        raise ValueError(f"{name} is not JSON")
    lines = (tmp_path / "scores.jsonl").read_text().splitlines()
    written_rows = [json.loads(line, parse_constant=no_constants) for line in lines]
    assert [row["scores"] for row in written_rows] == [[0.25, None, None], [], [0.5]]
    assert written_rows[2] == {**rows[2], "reward": None, "meta": {"bounds": [1.5, None]}, "scores": [0.5]}
    assert "warning: 2 scores are not finite (written as null)" in capsys.readouterr().err


def test_notes_for_metrics_that_one_kind_of_label_leaves_nan_and_for_steps_holding_the_separator(tmp_path, capsys):
    """Eval rows whose steps are all correct leave AUROC and first-error F1 NaN: said before training, so that the
    NaN is not read as a diverged model. A training step with the separator inside is scored whole, which a
    solution split on every separator is not."""
    rows = builtin_rows(48)
    rows[0] = {**rows[0], "completions": [rows[0]["completions"][0] + "\nand so", *rows[0]["completions"][1:]]}
    rows[1] = {**rows[1], "completions": [*rows[1]["completions"], " "], "labels": [*rows[1]["labels"], 0]}
    data = write_rows(tmp_path / "train.jsonl", rows)
    correct = [row for row in builtin_rows(200) if min(row["labels"]) == 1][:6]
    wrong_only = [{**row, "labels": [0] * len(row["labels"])} for row in correct]
    for eval_rows, nan_metrics in ((correct, ["auroc", "first_error_f1"]), (wrong_only, ["auroc", "first_error_f1"]),
                                   ([*correct, *builtin_rows(12)], [])):
        evals = write_rows(tmp_path / "eval.jsonl", eval_rows)
        code, stdout, err = run_main(["--output-dir", str(tmp_path / "run"), "--overwrite", *SMALL, "--total-steps",
                                      "1", "--data-path", str(data), "--eval-data-path", str(evals)], capsys,
                                     with_stdout=True)
        assert code == 0, err
        noted = re.findall(r"note: eval (\w+) will be nan: it needs both", stdout)
        assert noted == nan_metrics, stdout
        assert "note: 1 training steps contain the separator '\\n': each is one step here" in stdout
        assert "note: 1 training steps are blank: trained as steps here, but split_steps" in stdout
        summary = read_summary(tmp_path / "run")
        assert all(summary[f"eval_{metric}_end"] is None for metric in nan_metrics)


def test_notes_on_data_and_settings_that_cannot_train_as_meant(tmp_path, capsys):
    rows = builtin_rows(12)
    plain = write_rows(tmp_path / "plain.jsonl", rows)
    correct = [{**row, "labels": [1] * len(row["labels"])} for row in rows]
    odd = write_rows(tmp_path / "odd.jsonl", [{**correct[0], "prompt": " "}, {**correct[1], "prompt": "Start 3?"},
                                              *correct[2:]])
    outputs = []
    for data, flags in ((plain, []), (odd, ["--batch-size", "16", "--warmup-steps", "3"])):
        code, stdout, err = run_main(["--output-dir", str(tmp_path / "run"), "--overwrite", *SMALL, "--total-steps",
                                      "1", "--num-val-rows", "0", "--data-path", str(data), *flags], capsys,
                                     with_stdout=True)
        assert code == 0, err
        outputs.append(stdout + err)
    for message in ("note: 1 training rows have a blank prompt", "warning: every training label is correct (>= 0.5)",
                    "warning: 2 of the rows' ", " tokens are the tokenizer's unknown token '<unk>': --model tiny knows "
                    "only the characters '0123456789abcdefghijklmnopqrstuvwxyz",
                    "note: --batch-size 16 is more than the 12 training rows: each step repeats rows",
                    "note: --warmup-steps 3 is more than the run's 1 steps: the learning rate never reaches "
                    "--learning-rate (at most 0.33 of it)"):
        assert message not in outputs[0] and message in outputs[1], message
    assert all("note: --eval-every, --num-val-rows set the evaluation, but --data-path without --eval-data-path "
               "holds no rows out to evaluate on" in output for output in outputs)


def test_an_unknown_token_that_is_also_bos_is_not_counted_as_unreadable_text(tmp_path, capsys):
    """GPT-2's <|endoftext|> is its BOS, EOS and unknown token at once: the BOS before every row is no character
    the tokenizer failed to read."""
    tokenizer = prm.build_tiny_tokenizer()
    tokenizer.bos_token = tokenizer.unk_token
    prm.build_tiny_backbone(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    code, stdout, err = run_main(["--output-dir", str(tmp_path / "run"), *SMALL, "--total-steps", "1", "--model",
                                  str(tmp_path / "model"), "--data-path", small_data(tmp_path, 12)], capsys,
                                 with_stdout=True)
    assert code == 0, err
    assert "unknown token" not in stdout + err


# listed here, not read from RESUME_MUST_MATCH; the data is checked by its content, not its path (see
# test_a_run_resumes_with_its_data_file_given_by_another_path)
OTHER_SETTINGS = {"model": "other", "num_val_rows": 7, "step_separator": "\n\n",
                  "max_length": 64, "lora_r": 4, "lora_alpha": 8, "lora_target_modules": "q_proj", "loss_kind": "mse",
                  "batch_size": 3, "seed": 2, "fsdp": True}


@pytest.mark.parametrize("key", OTHER_SETTINGS)
def test_every_setting_a_resume_must_match_is_checked(key, tmp_path):
    other = OTHER_SETTINGS[key]
    assert getattr(prm.Args(), key) != other
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.pt").write_bytes(b"")
    (checkpoint / "args.json").write_text(json.dumps({"script": "prm.py", **vars(prm.Args(**{key: other}))}))
    with pytest.raises(prm.UserError, match=re.escape(f"--{key.replace('_', '-')} {other!r} there")):
        prm.resolve_resume(prm.Args(resume_from=str(checkpoint)), str(tmp_path))
