"""python -m tools.gen_fewbit_tables [--all]

Regenerate memopt/fewbit/default_tables.json: the uniform-weight and the normal-weight (scale 1, FewBitConfig's
default) tables on (-10, 10), 4096 cells, for every table activation at its default hyper-parameters (plus
tanh-approximated GELU), bits 1-8. Without --all it computes only the tables the file lacks (a new activation or
weight) and keeps the others; --all recomputes every one (the exact DP: 8 bits take about a minute per table on a
2-core machine, so hours in all).

tests/fewbit/test_fewbit_tables.py checks that the shipped data equals a fresh computation.
"""
from __future__ import annotations

import argparse
import json
import time

from memopt.fewbit.activations import ACTIVATIONS, TABLE_ACTIVATIONS
from memopt.fewbit.tables import SHIPPED, SHIPPED_WEIGHTS, compute_table, shipped_key

EXTRA_PARAMS = {"gelu": [{"approximate": "tanh"}]}


def shipped_entries():
    for name in TABLE_ACTIVATIONS:
        for given in [{}] + EXTRA_PARAMS.get(name, []):
            yield name, ACTIVATIONS[name].params(given)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true", help="recompute the tables the file has too")
    args = parser.parse_args()
    old = {} if args.all or not SHIPPED.exists() else json.loads(SHIPPED.read_text())
    data = {}
    start = time.perf_counter()
    for name, params in shipped_entries():
        for weight in SHIPPED_WEIGHTS:
            for bits in range(1, 9):
                key = shipped_key(name, params, bits, weight)
                if key in old:
                    data[key] = old[key]
                    continue
                borders, levels, error = compute_table(name, bits, params=params, weight=weight)
                data[key] = {"borders": borders.tolist(), "levels": levels.tolist(), "error": error}
                SHIPPED.write_text(json.dumps(dict(old, **data), indent=0, sort_keys=True) + "\n")  # resumable
    SHIPPED.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")
    print(f"wrote {len(data)} tables ({len(data) - len(old.keys() & data.keys())} computed) to {SHIPPED} in "
          f"{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
