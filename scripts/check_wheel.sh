#!/usr/bin/env bash
# Release check: build the sdist and wheel, run `twine check --strict`, check what the
# wheel and sdist hold, install the wheel into a fresh virtual environment (reusing the
# installed torch through --system-site-packages; the wheel itself with --no-deps) and, from
# a directory outside the checkout, import equiopt and step an optimizer built by
# `equiopt.build_optimizer`.
#
#   bash scripts/check_wheel.sh            # needs: pip install build twine
#   KEEP=1 bash scripts/check_wheel.sh     # keep the work directory (dist/, venv) for inspection
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d "${TMPDIR:-/tmp}/equiopt-wheel.XXXXXX")"
if [[ -z "${KEEP:-}" ]]; then trap 'rm -rf "$work"' EXIT; else echo "work directory: $work"; fi

echo "== build (sdist, then the wheel from the sdist)"
"$python" -m build --outdir "$work/dist" "$repo" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
ls -l "$work/dist"
wheel=("$work"/dist/equiopt-*.whl)
sdist=("$work"/dist/equiopt-*.tar.gz)
[[ ${#wheel[@]} -eq 1 && -f "${wheel[0]}" && ${#sdist[@]} -eq 1 && -f "${sdist[0]}" ]] \
    || { echo "expected one wheel and one sdist in $work/dist"; exit 1; }

echo "== twine check --strict"
"$python" -m twine check --strict "${wheel[0]}" "${sdist[0]}"

echo "== contents"
"$python" - "${wheel[0]}" "${sdist[0]}" <<'EOF'
import sys
import tarfile
import zipfile

wheel, sdist = sys.argv[1], sys.argv[2]
names = zipfile.ZipFile(wheel).namelist()
info = [n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")]
assert info, "the wheel has no .dist-info"
outside = [n for n in names if not (n.startswith("equiopt/") or n.split("/")[0] == info[0])]
assert not outside, f"the wheel holds files outside the package: {outside[:10]}"
banned = [n for n in names if any(part in ("tests", "results", "examples", "configs", "docs", "scripts")
                                      for part in n.split("/")[:-1])]
assert not banned, f"the wheel holds tests, results or other repository files: {banned[:10]}"
for needed in ("equiopt/__init__.py", "equiopt/optim/engine.py", "equiopt/recipes/registry.py", "equiopt/cli.py"):
    assert needed in names, f"the wheel lacks {needed}"
assert any(n.endswith("licenses/LICENSE") for n in names), "the wheel lacks its LICENSE"
meta = zipfile.ZipFile(wheel).read(f"{info[0]}/METADATA").decode()
assert "Description-Content-Type: text/markdown" in meta, "the wheel's metadata has no markdown readme"
print(f"wheel: {len(names)} files, {sum(n.startswith('equiopt/') for n in names)} in equiopt/; no tests or results")

members = tarfile.open(sdist).getnames()
top = members[0].split("/")[0]
rel = ["/".join(m.split("/")[1:]) for m in members]
big = [r for r in rel if r.split("/")[0] in ("results", "runs", "data", "site", "build", "dist")]
assert not big, f"the sdist holds results or build outputs: {big[:10]}"
for needed in ("pyproject.toml", "README.md", "LICENSE", "src/equiopt/__init__.py"):
    assert needed in rel, f"the sdist lacks {needed}"
print(f"sdist: {len(members)} entries under {top}/; no results")
EOF

echo "== install into a fresh venv (--system-site-packages for torch; the wheel with --no-deps)"
"$python" -m venv --system-site-packages "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --no-deps --ignore-installed "${wheel[0]}"

echo "== import and step, outside the checkout"
mkdir "$work/elsewhere"
cd "$work/elsewhere"
env -u PYTHONPATH EQUIOPT_CHECKOUT="$repo" "$work/venv/bin/python" - <<'EOF'
import os
from importlib.metadata import version
from pathlib import Path

import torch
from torch import nn

import equiopt

where = Path(equiopt.__file__).resolve()
checkout = Path(os.environ["EQUIOPT_CHECKOUT"]).resolve()
assert checkout not in where.parents, f"equiopt was imported from the checkout: {where}"
assert Path(os.environ.get("VIRTUAL_ENV", Path(os.sys.prefix))).resolve() in where.parents, where
assert equiopt.__version__ == version("equiopt"), (equiopt.__version__, version("equiopt"))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        h = self.embed(x)
        return self.lm_head(self.norm(h + self.mlp(h)))


torch.manual_seed(0)
model = TinyLM()
optimizer, scheduler = equiopt.build_optimizer(model, total_steps=10)
tokens = torch.randint(0, 64, (2, 8))
before = {n: p.detach().clone() for n, p in model.named_parameters()}
for _ in range(2):
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
moved = [n for n, p in model.named_parameters() if not torch.equal(before[n], p)]
assert moved == list(before), f"parameters that did not move: {sorted(set(before) - set(moved))}"
assert all(torch.isfinite(p).all() for p in model.parameters())
print(f"equiopt {equiopt.__version__} from {where.parent}: two steps of {type(optimizer).__name__}, "
      f"{len(optimizer.param_groups)} groups, loss {loss.item():.4f}")
EOF
echo "wheel check passed"
