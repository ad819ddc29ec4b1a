"""Randomized fault trials on real daemons in network namespaces (as root).

    python tests/cluster/fault_trials.py --trials N --seed S [--nodes 4] [--trial K]

See tests/cluster/faults/trials.py and docs/FAULT-TRIALS.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "support")]  # faults/, and countingfs

from faults.trials import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
