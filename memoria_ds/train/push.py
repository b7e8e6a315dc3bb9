"""Share an export on the Hugging Face hub: `<run_dir>/export` as a model repository.

    python launch/push.py runs/x your-name/memoria-gpt2 [--private] [--dry-run]

What goes up is the export as it is: the weights (safetensors), config.json with its
`auto_map` and its two one-line modules (so `AutoModelForCausalLM.from_pretrained(repo,
trust_remote_code=True)` works where memoria_ds is installed, without importing it first),
the tokenizer, the model card (README.md)
and a LoRA adapter if the run kept one apart. The directory is checked first (a run
directory or an export; config.json, weights and card present, every weight file whole),
so a mistake stops with exit status 2 before anything touches the network. `--dry-run`
lists what would be uploaded and stops there. Uploading needs a token (`hf auth login`, or
`HF_TOKEN`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .parse import ConfigError
from .saved_model import check_saved_model

REQUIRED = ("config.json", "README.md")


def export_dir(path: str | Path) -> Path:
    """The export to upload: `path/export` for a run directory, else `path` itself."""
    p = Path(path)
    if (p / "config.yaml").is_file() and (p / "export").is_dir():
        p = p / "export"
    if not p.is_dir():
        raise ConfigError(f"{path} does not exist; give a run directory or its export/")
    missing = [f for f in REQUIRED if not (p / f).is_file()]
    if not list(p.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ConfigError(f"{p} is not a memoria_ds export (missing {', '.join(missing)}); train with "
                          f"checkpoint.export=true and give <run_dir> or <run_dir>/export")
    check_saved_model(p)  # a damaged export is not uploaded
    return p


def files_to_upload(directory: Path) -> list[str]:
    return sorted(str(f.relative_to(directory)) for f in directory.rglob("*") if f.is_file()
                  and not any(part.startswith(".") for part in f.relative_to(directory).parts))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run directory (its export/ is uploaded) or an export directory")
    p.add_argument("repo_id", help="the hub repository, e.g. your-name/memoria-gpt2")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--revision", default=None, help="the branch to upload to (default: main)")
    p.add_argument("--dry-run", action="store_true", help="list what would be uploaded, upload nothing")
    a = p.parse_args(argv)
    try:
        if a.repo_id.count("/") != 1 or not all(a.repo_id.split("/")):
            raise ConfigError(f"repo_id {a.repo_id!r} must look like `owner/name`")
        directory = export_dir(a.run)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    files = files_to_upload(directory)
    print(f"{directory} -> https://huggingface.co/{a.repo_id} ({len(files)} files: {', '.join(files)})")
    if a.dry_run:
        return
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(a.repo_id, private=a.private, exist_ok=True, repo_type="model")
    commit = api.upload_folder(folder_path=str(directory), repo_id=a.repo_id, revision=a.revision,
                               commit_message="Upload memoria_ds export", ignore_patterns=[".*"])
    print(f"uploaded: {commit}")
