"""The models the planner's notebook, benches and calculator plan: Llama-shaped decoders (notebook 11).

``decoder(size)`` is a ``model_fn`` for ``planner.plan``, at one of :data:`SIZES` (a toy to Llama-2-13B's).
"""

import torch
import torch.nn.functional as F
from torch import nn


class _Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm decoder block: RMSNorm, causal attention (SDPA), RMSNorm, SwiGLU MLP."""

    def __init__(self, d, heads, ffn):
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.RMSNorm(d), _Attention(d, heads), nn.RMSNorm(d)
        self.gate, self.up = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    """A Llama-shaped decoder: token embedding, blocks, final norm, untied head; tokens -> logits."""

    def __init__(self, vocab, d, layers, heads, ffn):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, ffn) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


SIZES = {  # name: (vocab, d, layers, heads, ffn); "7B" is Llama-2-7B's shape (6.74B parameters)
    "tiny": (512, 64, 2, 4, 172),
    "small": (4096, 256, 4, 4, 688),
    "1B": (32000, 4096, 4, 32, 11008),  # four of 7B's blocks: 1.07B parameters, traced in seconds
    "7B": (32000, 4096, 32, 32, 11008),
    "13B": (32000, 5120, 40, 40, 13824),
}


def _named(model_fn, name: str):
    """``model_fn`` named for the planner's tables."""
    model_fn.__name__ = model_fn.__qualname__ = name
    return model_fn


def _sized(cls, size: str, name: str):
    if size not in SIZES:
        raise ValueError(f"size must be one of {list(SIZES)}, got {size!r}")
    return _named(lambda: cls(*SIZES[size]), f"{name}_{size}")


def decoder(size: str = "tiny"):
    """A ``model_fn`` for :data:`SIZES`: ``plan(decoder("7B"), ...)``."""
    return _sized(Decoder, size, "decoder")


def lm_loss(logits, targets):
    """Next-token cross-entropy over every position (logits [B, T, V], targets [B, T])."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def token_batch(batch_size: int, seq_len: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# --- two more families the planner is held against (tests, bench/planner_ranks.py) ------------------

class ConvBlock(nn.Module):
    """Conv 3x3, BatchNorm, ReLU, plus a residual: the shape of a ResNet stage's block."""

    def __init__(self, c):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return x + F.relu(self.bn(self.conv(x)))


class ConvNet(nn.Module):
    """A small conv net with BatchNorm: stem conv, ``layers`` residual conv blocks, pooled linear head.
    On the CPU its convolutions' oneDNN scratch is the allocator's, not the plan's (no tensor owns it)."""

    def __init__(self, channels=32, layers=4, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels))
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(layers))
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        x = F.relu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


class TiedFrozenLM(Decoder):
    """A decoder whose head shares the embedding's weight (tied: one tensor, one gradient) and whose
    first block is frozen (no gradients, no optimizer state): what fine-tuning often looks like."""

    def __init__(self, vocab, d, layers, heads, ffn):
        super().__init__(vocab, d, layers, heads, ffn)
        self.head.weight = self.embed.weight
        self.blocks[0].requires_grad_(False)


def convnet(channels: int = 32, layers: int = 4):
    """A ``model_fn`` for :class:`ConvNet`; its batch: ``image_batch``."""
    return _named(lambda: ConvNet(channels, layers), f"convnet_{channels}x{layers}")


def tied_frozen(size: str = "tiny"):
    """A ``model_fn`` for :class:`TiedFrozenLM` of one of :data:`SIZES`; its batch: ``token_batch``."""
    return _sized(TiedFrozenLM, size, "tied_frozen")


def image_batch(batch_size: int, size: int = 32, classes: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, 3, size, size, generator=g), torch.randint(0, classes, (batch_size,), generator=g)
