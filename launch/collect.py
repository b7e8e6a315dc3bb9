"""Collect run directories into the paper's tables (markdown and CSV), our numbers beside the paper's.

    python launch/collect.py runs/repro [more roots] [--out DIR] [--tables table1,table5]

See memoria_ds/repro/collect.py and docs/reproduction.md.
"""

import sys

import project_env  # noqa: F401  (first: runs this script under the project's .venv when needed)

from memoria_ds.repro.collect import main

if __name__ == "__main__":
    sys.exit(main())
