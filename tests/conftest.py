import sys
from pathlib import Path

# The scripts live at the repository root and are imported as modules (grpo, prm), not installed.
REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
