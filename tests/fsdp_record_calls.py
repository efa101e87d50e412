"""fsdp_on_cpu.py with two of grpo.py's functions recorded, one JSON line per call, in
$FSDP_RECORD_DIR/calls-<rank>.jsonl: micro_batch_rows (its prompt lengths and the rows it chose) and
completion_logprobs (whether it shared prompts). For tests that check what each process did.

    FSDP_RECORD_DIR=<dir> torchrun --nproc_per_node 2 tests/fsdp_record_calls.py grpo --fsdp <grpo.py flags>
"""
import json
import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo  # noqa: E402  (fsdp_on_cpu.py imports this same module, wrapped below)


def record(name: str, describe) -> None:
    real = getattr(grpo, name)
    calls = Path(os.environ["FSDP_RECORD_DIR"]) / f"calls-{os.environ['RANK']}.jsonl"

    def wrapper(*args, **kwargs):
        result = real(*args, **kwargs)
        with calls.open("a") as file:
            file.write(json.dumps([name, describe(args, kwargs, result)]) + "\n")
        return result

    setattr(grpo, name, wrapper)


if __name__ == "__main__":
    record("micro_batch_rows", lambda args, kwargs, result: [args[1], result])
    record("completion_logprobs", lambda args, kwargs, result: kwargs.get("prompt_of_row") is not None)
    runpy.run_path(str(Path(__file__).with_name("fsdp_on_cpu.py")), run_name="__main__")
