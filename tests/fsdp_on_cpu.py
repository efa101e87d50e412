"""Runs `grpo.py` or `prm.py` with --fsdp allowed on CPU (FSDP2 over gloo), under torchrun, so that the tests can
check the sharded path on a machine without GPUs. Users get an error for --fsdp on CPU: see FSDP_DEVICE_TYPES.

    torchrun --nproc_per_node 2 tests/fsdp_on_cpu.py grpo --fsdp <grpo.py flags>
"""
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__":
    script = importlib.import_module(sys.argv[1])
    script.FSDP_DEVICE_TYPES = ("cuda", "cpu")
    sys.argv = [f"{sys.argv[1]}.py", *sys.argv[2:]]
    script.main()
