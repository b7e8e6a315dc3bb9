"""Evaluate a saved model (a run, an export, a hub id) on a corpus split, without training.

    python launch/evaluate.py runs/quickstart eval.split=validation eval.protocols=[full,paper]
    deepspeed --num_gpus 4 launch/evaluate.py runs/x eval.split=test

See `python launch/evaluate.py --help` and memoria_ds/train/evaluate.py.
"""

import project_env  # noqa: F401  (first: runs this script under the project's .venv when needed)

from memoria_ds.train.evaluate import main

if __name__ == "__main__":
    main()
