#!/usr/bin/env bash
# The wheels that the lent GPU machine (nvidia-h200: Python 3.12, torch 2.11, transformers 5.17, no tyro) lacks or
# has too old for grpo.py / prm.py, downloaded into .whl/ for `run` to carry (see benchmarks/README.md). Run here,
# from the repository root, once per session; .whl/ is ignored through the repository's info/exclude (.git/info/exclude,
# or the main checkout's in a git worktree, where .git is a file), never .gitignore.
#
#   tyro 1.0.17        grpo.py / prm.py parse their flags with it; not on the device
#   typeguard 4.6.1    tyro: typeguard>=4.0.0; not on the device
#   docstring-parser   tyro: docstring-parser>=0.16; not on the device
#   typing-extensions  tyro: >=4.13, typeguard 4.6: >=4.14; on the device, its version unread: carried to be sure
#   transformers 5.24  the code needs 5.24 (the device has 5.17). Its Requires-Dist is met there: huggingface-hub
#                      >=1.31,<3 (1.33), tokenizers >=0.23.1,<0.24 (0.23.2), safetensors >=0.8.0 (0.8.0), regex
#                      >=2025.10.22 (5.17 asks the same), numpy, packaging, pyyaml, typer, tqdm >=4.60 (all there)
#   peft 0.21.2        requirements.txt asks >=0.21; the device's version is unread; only LoRA runs import it.
#                      Its Requires-Dist (accelerate >=0.21: 1.15 there, huggingface_hub >=0.25, psutil, ...) is met
#
# All pure-Python (py3-none-any): about 15 MiB together.
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
