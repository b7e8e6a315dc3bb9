"""Upload a run's export to the Hugging Face hub as a model repository.

    python launch/push.py runs/x your-name/memoria-gpt2 [--private] [--dry-run]

See memoria_ds/train/push.py and docs/training.md ("Share a model").
"""

import project_env  # noqa: F401  (first: runs this script under the project's .venv when needed)

from memoria_ds.train.push import main

if __name__ == "__main__":
    main()
