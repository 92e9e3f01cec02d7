"""python -m tools.gen_fewbit_tables   (about a minute)

Regenerate memopt/fewbit/default_tables.json: the uniform-weight tables on (-10, 10), 4096 cells,
for every table activation at its default hyper-parameters (plus tanh-approximated GELU), bits 1-8.

tests/fewbit/test_fewbit_tables.py checks that the shipped data equals a fresh computation.
"""
from __future__ import annotations

import argparse
import json
import time

from memopt.fewbit.activations import ACTIVATIONS, TABLE_ACTIVATIONS
from memopt.fewbit.tables import SHIPPED, compute_table, shipped_key

EXTRA_PARAMS = {"gelu": [{"approximate": "tanh"}]}


def shipped_entries():
    for name in TABLE_ACTIVATIONS:
        for given in [{}] + EXTRA_PARAMS.get(name, []):
            yield name, ACTIVATIONS[name].params(given)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    data = {}
    start = time.perf_counter()
    for name, params in shipped_entries():
        for bits in range(1, 9):
            borders, levels, error = compute_table(name, bits, params=params)
            data[shipped_key(name, params, bits)] = {"borders": borders.tolist(), "levels": levels.tolist(),
                                                     "error": error}
    SHIPPED.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")
    print(f"wrote {len(data)} tables to {SHIPPED} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
