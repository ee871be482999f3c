"""Learnable synthetic token sequences for the examples: arithmetic progressions modulo the vocabulary."""

import torch


class Progressions(torch.utils.data.Dataset):
    """``n`` sequences ``(start + stride * t) % vocab``: a tiny model learns them in a few dozen steps."""

    def __init__(self, vocab: int, n: int = 256, length: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 5, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
