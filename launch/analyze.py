"""Plot what the memory does in a run (paper Figures 5, 6, 8-9 as PNGs).

    python launch/analyze.py RUN_DIR [--trace test] [--max-steps N] [--out DIR]
    python launch/analyze.py --state MEMORY.safetensors [--trace-file TRACE.jsonl] --out DIR

See memoria_ds/analysis/analyze.py and docs/reproduction.md.
"""

import sys

import project_env  # noqa: F401  (first: runs this script under the project's .venv when needed)

from memoria_ds.analysis.analyze import main

if __name__ == "__main__":
    sys.exit(main())
