import sys
from pathlib import Path

# benchmarks/ is not an installed package: make the repository root importable.
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
