"""Fetch what the real-model recipes read, once, on a machine with network access:
``python scripts/fetch_assets.py qwen2.5-0.5b qwen2.5-1.5b gsm8k``.

Models go to ``~/.cache/skyrl/models/<name>/`` (an HF model directory, via huggingface_hub, which
also fills the HF cache), GSM8K to ``~/.cache/skyrl/data/gsm8k/{train,test}.jsonl`` as rows of
``backends.data.gsm8k``. These are the paths the recipes name; a model already in the HF cache can
be used in place with ``--set model.path=$(hf download Qwen/Qwen2.5-1.5B-Instruct)``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path.home() / ".cache" / "skyrl"
MODELS = {"qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B-Instruct", "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B-Instruct"}


def fetch_model(repo: str, root: Path) -> Path:
    from huggingface_hub import snapshot_download

    target = root / "models" / repo.split("/")[-1]
    snapshot_download(repo, local_dir=str(target), allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
    return target


def fetch_gsm8k(root: Path) -> Path:
    import datasets

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from backends.data.gsm8k import gsm8k_row

    target = root / "data" / "gsm8k"
    target.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        rows = datasets.load_dataset("openai/gsm8k", "main", split=split)
        with open(target / f"{split}.jsonl", "w", encoding="utf-8") as out:
            for r in rows:
                out.write(json.dumps(gsm8k_row(r["question"], r["answer"])) + "\n")
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("assets", nargs="+", choices=[*MODELS, "gsm8k"])
    parser.add_argument("--root", type=Path, default=ROOT, help="default: ~/.cache/skyrl (the recipes' paths)")
    args = parser.parse_args(argv)
    for asset in args.assets:
        where = fetch_gsm8k(args.root) if asset == "gsm8k" else fetch_model(MODELS[asset], args.root)
        print(f"{asset}: {where}")


if __name__ == "__main__":
    main()
