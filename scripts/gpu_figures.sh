#!/usr/bin/env bash
# GPU figures: figures.json (scripts/gpu_figures.py: the vocabulary rules against fused AdamW,
# whole Qwen3-0.6B stacks against a forward+backward, eager / CUDA graph / compiled, compile
# time, memory, the CUDA tests; about 5 minutes on one H100), and the longer tables (one matrix
# per rule, whole stacks with bfloat16 Grams, the Gram-precision study), each with its own time
# limit, outputs under $OUT (default results/gpu/raw).
# Usage: bash scripts/gpu_figures.sh [figures] [compile] [speed] [stack] [study] [tests] [profile]   (default: figures)
set -u
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-results/gpu/raw}
mkdir -p "$OUT"
parts=${*:-figures}
{
  echo "commit ${EQUIOPT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  python -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
} > "$OUT/env.txt" 2>&1
for part in $parts; do
  case $part in
    figures) timeout 450 python scripts/gpu_figures.py --out "$OUT/figures.json" > "$OUT/figures.txt" 2>&1 ;;
    compile) timeout 240 python benchmarks/gpu_compile_check.py > "$OUT/compile.txt" 2>&1 ;;
    speed) timeout 150 python -m equiopt.bench --speed --device cuda > "$OUT/speed.txt" 2>&1 ;;
    stack) timeout 200 python -m equiopt.bench --stack --device cuda --recipes paper:qwen3:a-i,paper:qwen3:b-ii \
             --gram-dtype float32,bfloat16 --compile off > "$OUT/stack.txt" 2>&1 ;;
    study) timeout 280 python -m equiopt compare --protocol results/study/gram_dtype/protocol.toml \
             --report results/study/gram_dtype/protocol-report.md > "$OUT/study.txt" 2>&1
           tar czf "$OUT/study.tgz" results/study/gram_dtype ;;
    profile) timeout 120 python benchmarks/gpu_profile_map.py > "$OUT/profile.txt" 2>&1 ;;
    tests) timeout 420 python -m pytest -q -x -p no:cacheprovider > "$OUT/tests.txt" 2>&1 ;;
  esac
  echo "$part exit $?" >> "$OUT/env.txt"
done
