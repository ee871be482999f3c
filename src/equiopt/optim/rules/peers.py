"""torch's own optimizers as rules, the outside reference arms of a comparison
(:mod:`equiopt.optim.peers` steps them): ``torch_adamw`` (``torch.optim.AdamW``) and
``torch_muon`` (``torch.optim.Muon``, torch >= 2.9)."""

from __future__ import annotations

from .base import Rule, polar_flops
from .elementwise import ADAM_STATE


class TorchAdamW(Rule):
    name = "torch_adamw"
    kind = "peer"
    fields = ("betas", "adam_eps")
    state = ADAM_STATE
    complex = True
    doc = "torch.optim.AdamW"


class TorchMuon(Rule):
    name = "torch_muon"
    kind = "peer"
    fields = ("beta", "nesterov", "steps", "lr_scale")
    defaults = {"nesterov": True}
    # torch's Muon knows Jordan's factor ("original") and Moonlight's ("match_rms_adamw") only
    lr_scales = ("spectral", "match_adamw")
    doc = "torch.optim.Muon"

    def flops(self, key, batch: int, m: int, n: int, gram_rows: int | None) -> int:
        return polar_flops(key, batch, m, n)
