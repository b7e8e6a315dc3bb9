"""Fine-tune Memoria GPT-2 (or the `transformer` / `xl` baselines) from a pretrained GPT-2.

    deepspeed launch/finetune.py --deepspeed ds_configs/zero2.json --config my_run.yaml optim.lr=5e-5

See `python launch/finetune.py --help` and memoria_ds/train/config.py for every setting.
"""

import project_env  # noqa: F401  (first: runs this script under the project's .venv when needed)

from memoria_ds.train.cli import main

if __name__ == "__main__":
    main(description=__doc__.splitlines()[0])
