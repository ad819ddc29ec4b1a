"""Randomized fault trials on real daemons in network namespaces (as root).

    python tests/fault_trials.py --trials N --seed S [--nodes 4] [--trial K]

See tests/faults/trials.py and docs/FAULT-TRIALS.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faults.trials import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
