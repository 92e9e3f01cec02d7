"""python -m tools.fuzz_nightly --examples 2000   (about 10 minutes per 1000 examples on 2 CPU cores)

Nightly profile of the property-based tests (tests/reliability/test_fuzz.py): many more random models and Configs
than CI's fixed 130, drawn afresh each run (hypothesis prints the failing seed; ``check_seed(seed, dtype)``
in tests/reliability/test_fuzz.py replays it).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=2000, help="fp32 examples (bf16: 30%% of that)")
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, MEMOPT_FUZZ_EXAMPLES=str(args.examples))
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/reliability/test_fuzz.py",
                            "-k", "random_models", "--hypothesis-show-statistics"], cwd=root, env=env)


if __name__ == "__main__":
    sys.exit(main())
