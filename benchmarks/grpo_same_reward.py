"""grpo.py with the TRL harness's reward: 1 when the completion's leading run of digits is the answer, else 0.

grpo.py's own answer_reward reads the answer a text states last and checks expressions with Math-Verify; on the
benchmark's random-init completions (random characters) that costs more than the training step. With the same reward
on both sides, bench_vs_trl.py compares the two trainers on the same work.
"""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpo  # noqa: E402

LEADING_INTEGER = re.compile(r"\s*(\d+)")


def leading_integer_reward(completion: str, answer: str) -> float:
    match = LEADING_INTEGER.match(completion)
    return float(match is not None and match[1] == answer)


if __name__ == "__main__":
    grpo.answer_reward = leading_integer_reward
    grpo.main()
