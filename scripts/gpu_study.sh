#!/usr/bin/env bash
# The GPU-scale study, one chunk of at most 7 minutes: by default
# results/study/qwen3_gpu_corrected/protocol.toml (the (a)(ii) arm as configured on the CPU, and
# (a)(i) against (a)(iii) on 40 seeds; results/study/qwen3_gpu/README.md says why), which follows
# results/study/qwen3_gpu/protocol-wider.toml (GPU_STUDY_PROTOCOL picks it or another).
#
# Each chunk runs `equiopt compare` on the protocol under a time limit: finished runs are
# skipped, a run the limit interrupts starts again in the next chunk (the configs keep no
# checkpoints). After the chunk the finished runs' directories (config and log) under every
# config's log directory (a protocol may reuse another study's runs) are packed into
# $OUT/gpu-study-logs.tgz, with the report (the protocol's path, -report.md for .toml) once every
# run is done; unpack it in the repository root on the CPU machine and commit, so the next chunk
# skips them:
#   tar xzf gpu-study-logs.tgz && git add results/study/qwen3_gpu results/study/qwen3_gpu_corrected && git commit
#
# Data (gitignored; made on the CPU machine, about 47 MB in all, carried to the device):
#   equiopt data train-bpe --corpus poetry --vocab-size 4096 --out data/bpe4096.json
#   equiopt data prepare --corpus poetry --tokenizer bpe:data/bpe4096.json --out data/poetry-bpe4096-gpu --max-documents 6000
#   equiopt data prepare --corpus sotu --tokenizer bpe:data/bpe4096.json --out data/sotu-bpe4096 --val-fraction 1
# and, with the device tool, carry = ["data/poetry-bpe4096-gpu", "data/sotu-bpe4096"].
#
# The runs train GPU_STUDY_JOBS at a time (default 1), each in its own process (`equiopt compare
# --jobs`): one 42 M-parameter run leaves the GPU mostly idle, waiting on its Python process, so
# 6 side by side finished a run every 45 s on an H100, against 75 s one at a time (1.7x), each
# training exactly as it would alone. On an H200, twice, one of 6 side-by-side runs died with
# "CUDA error: unspecified launch failure", which ends the whole chunk; one at a time the same
# runs finished (results/gpu/README.md, commit 40a09c9), so 1 is the default.
#
# Usage: bash scripts/gpu_study.sh [seconds]   (default 420; GPU_STUDY_PROTOCOL picks another protocol)
set -u
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-results/gpu/raw}
PROTOCOL=${GPU_STUDY_PROTOCOL:-results/study/qwen3_gpu_corrected/protocol.toml}
REPORT=${PROTOCOL%.toml}-report.md
mkdir -p "$OUT"
{
  echo "commit ${EQUIOPT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  python -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no cuda')"
  date -u
} > "$OUT/gpu-study.txt" 2>&1
timeout --signal=TERM --kill-after=20 "${1:-420}" \
  python -m equiopt compare --protocol "$PROTOCOL" --report "$REPORT" --jobs "${GPU_STUDY_JOBS:-1}" >> "$OUT/gpu-study.txt" 2>&1
echo "compare exit $? (124 when the time limit ended the chunk)" >> "$OUT/gpu-study.txt"
python - "$PROTOCOL" "$OUT/gpu-study-logs.tgz" "$REPORT" >> "$OUT/gpu-study.txt" 2>&1 <<'PY'
import json, sys, tarfile
from pathlib import Path

from equiopt.study.protocol import load_protocol
from equiopt.train.config import load_config

protocol, target, report = load_protocol(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
logs = sorted({load_config(c).out_path for c in protocol.configs})  # each arm's runs: <out_dir>/lrx<m>-s<seed>


def finished(log: Path) -> bool:
    lines = log.read_text().strip().splitlines() if log.exists() else []
    if not lines:
        return False
    last = json.loads(lines[-1])
    return last.get("kind") == "end" and last.get("status") == "done"


runs = sorted(d for log in logs for d in log.glob("*") if d.is_dir() and finished(d / "log.jsonl"))
with tarfile.open(target, "w:gz") as tar:
    for d in runs:
        tar.add(d)
    if report.exists():
        tar.add(report)
print(f"packed {len(runs)} finished runs" + (" and the report" if report.exists() else ""))
for d in sorted(d for log in logs for d in log.glob("*") if d.is_dir() and d not in runs and (d / "log.jsonl").exists()):
    tail = (d / "log.jsonl").read_text().strip().splitlines()[-2:]  # where an unfinished run stopped
    print(f"unfinished {d}:", *tail, sep="\n  ")
PY
