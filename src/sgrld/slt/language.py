"""The language-model path of the LLC: token-id batches, the per-token cross-entropy with
``ignore_index``, a small causal transformer built from ``torch.nn`` and a synthetic language it
can learn (nothing is downloaded).

The attention is written out (masked softmax of QKᵀ): ``torch.vmap`` has no batching rule for
CPU's fused attention kernel and would loop over the chains (``docs/llc.md``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

#: the target marking a token that no loss is taken at (padding), as ``cross_entropy``'s default
IGNORE_INDEX = -100


class CausalBlock(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention, then a GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, h: Tensor) -> Tensor:
        b, t, d = h.shape
        qkv = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        h = h + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return h + self.mlp(self.norm2(h))


class CausalLM(nn.Module):
    """A small decoder-only transformer: token and position embeddings, ``layers`` causal
    blocks, a final norm and the unembedding; ``model(ids)`` gives ``(B, T, vocab)`` logits."""

    def __init__(
        self, vocab: int = 16, width: int = 32, heads: int = 2, layers: int = 2, context: int = 16
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(CausalBlock(width, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.unembed = nn.Linear(width, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids) + self.position.weight[: ids.shape[-1]]
        return self.unembed(self.norm(self.blocks(h)))


def next_token_loss(model: nn.Module, ids: Tensor) -> Tensor:
    """The mean next-token cross-entropy of a ``(B, T + 1)`` batch of token ids over the
    positions whose target is not :data:`IGNORE_INDEX` (padding: ``ids`` holds IGNORE_INDEX
    there; it is fed to the model as token 0, whose predictions no loss is taken at)."""
    inputs, targets = ids[:, :-1].clamp_min(0), ids[:, 1:]
    logits = model(inputs)
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX
    )


def synthetic_language(
    num_sequences: int,
    length: int,
    vocab: int = 16,
    *,
    sharpness: float = 3.0,
    padded: float = 0.25,
    seed: int = 0,
) -> Tensor:
    """Token ids ``(num_sequences, length + 1)`` from a random second-order Markov chain.

    Its transition rows are softmax(``sharpness``·z), z standard normal (a few likely next
    tokens per context: a language a small transformer learns in a few hundred steps). A fraction
    ``padded`` of the sequences end early, the rest of the row :data:`IGNORE_INDEX`.
    """
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(vocab * vocab, vocab, generator=g, dtype=torch.float64)
    table = torch.softmax(sharpness * z, -1)
    ids = torch.empty(num_sequences, length + 1, dtype=torch.int64)
    ids[:, :2] = torch.randint(0, vocab, (num_sequences, 2), generator=g)
    for t in range(2, length + 1):
        context = ids[:, t - 2] * vocab + ids[:, t - 1]
        ids[:, t] = torch.multinomial(table[context], 1, generator=g).squeeze(-1)
    short = torch.rand(num_sequences, generator=g) < padded
    ends = torch.randint(3, length + 1, (num_sequences,), generator=g)
    positions = torch.arange(length + 1).expand(num_sequences, -1)
    ids[short[:, None] & (positions >= ends[:, None])] = IGNORE_INDEX
    return ids


def train(
    model: nn.Module,
    ids: Tensor,
    checkpoints: list[int],
    *,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
) -> dict[int, dict[str, Tensor]]:
    """Train ``model`` with AdamW on random batches of ``ids`` (next-token loss) and keep a copy
    of its parameters after each step count in ``checkpoints`` (0: the initialisation).

    Returns:
        ``{step: state_dict}`` for every checkpoint, in order.
    """
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    saved: dict[int, dict[str, Tensor]] = {}
    for step in range(max(checkpoints) + 1):
        if step in checkpoints:
            saved[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if step == max(checkpoints):
            break
        batch = ids[torch.randint(0, len(ids), (batch_size,), generator=g)]
        opt.zero_grad()
        next_token_loss(model, batch).backward()
        opt.step()
    return saved
