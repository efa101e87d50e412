#!/usr/bin/env bash
# Downloads into .whl/ the pure-Python wheels that grpo.py / prm.py need on a GPU machine without network access
# whose Python 3.12 has torch but no tyro and an older transformers; there:
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# .whl/ is ignored through the repository's info/exclude (the main checkout's in a git worktree), not .gitignore.
#
#   tyro 1.0.17, typeguard 4.6.1, docstring-parser 0.18.0, typing-extensions 4.16.0   the flag parser and its needs
#   transformers 5.24.0   the version the code is written for (its dependencies are the older release's)
#   peft 0.21.2           requirements.txt asks >=0.21 (LoRA runs; prm.py imports it)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-path info/exclude)  # .git/info/exclude, but not in a worktree
grep -qxF /.whl/ "$exclude" 2>/dev/null || { mkdir -p "$(dirname "$exclude")" && echo /.whl/ >> "$exclude"; }
rm -rf .whl
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    tyro==1.0.17 typeguard==4.6.1 docstring-parser==0.18.0 typing-extensions==4.16.0 \
    transformers==5.24.0 peft==0.21.2
ls -l .whl
du -ch .whl/*.whl | tail -1
