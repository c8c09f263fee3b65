"""Sequence architectures of the zoo: a stacked LSTM and BERT-style transformer encoders.

Encoder segments pass ``(hidden, mask_bias)`` along, so every layer is a segment of its
own that takes and returns plain tensors. Token ids arrive as INT32 (what clients send)
and must lie in ``[0, vocab)``; an id outside it makes the embedding lookup raise.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from splitserve.models.segmented import SegmentedModel, balanced_segments

BERT_VOCAB = 30522
# Added to attention scores of padding tokens. Finite, unlike -inf, so a row that is all
# padding gives uniform attention instead of NaN.
_MASKED = -10000.0


class LSTMLayer(nn.Module):
    """One LSTM layer over batch-first sequences, returning every step or only the last one."""

    def __init__(self, cin: int, hidden: int, last_only: bool) -> None:
        super().__init__()
        self.lstm = nn.LSTM(cin, hidden, batch_first=True)
        self.last_only = last_only

    def forward(self, x: Tensor) -> Tensor:
        """``[B, T, cin]`` -> ``[B, T, hidden]``, or ``[B, hidden]`` when ``last_only``."""
        out, _ = self.lstm(x)
        return out[:, -1] if self.last_only else out


def lstm(features: int, hidden: int, layers: int, outputs: int) -> SegmentedModel:
    """Stacked LSTM (one segment per layer) whose last state feeds a linear layer."""
    return SegmentedModel([
        *(LSTMLayer(features if i == 0 else hidden, hidden, last_only=i == layers - 1) for i in range(layers)),
        nn.Linear(hidden, outputs),
    ])


class Embeddings(nn.Module):
    """Word + position (+ token type) embeddings and LayerNorm; also turns the mask into a score bias."""

    def __init__(self, hidden: int, seq_len: int, token_types: int) -> None:
        super().__init__()
        self.word = nn.Embedding(BERT_VOCAB, hidden)
        self.position = nn.Embedding(seq_len, hidden)
        self.token_type = nn.Embedding(token_types, hidden) if token_types else None
        self.norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, input_ids: Tensor, attention_mask: Tensor,
                token_type_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Return ``hidden [B, S, H]`` and ``mask_bias [B, 1, 1, S]`` (0 to attend, large negative not to)."""
        h = self.word(input_ids.long()) + self.position.weight[: input_ids.shape[1]]
        if self.token_type is not None and token_type_ids is not None:
            h = h + self.token_type(token_type_ids.long())
        bias = (attention_mask[:, None, None, :] == 0).to(h.dtype) * _MASKED
        return self.norm(h), bias


class EncoderLayer(nn.Module):
    """Post-norm transformer encoder layer (BERT): self-attention, then a GELU feed-forward."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm1 = nn.LayerNorm(hidden, eps=1e-12)
        self.ffn = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
        self.norm2 = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, h: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        """Return the new hidden states and the mask bias, passed on unchanged."""
        b, s, d = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, s, d)
        h = self.norm1(h + self.proj(a))
        return self.norm2(h + self.ffn(h)), bias


class SpanHead(nn.Module):
    """Question-answering head: a start and an end logit per token."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.qa = nn.Linear(hidden, 2)

    def forward(self, h: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        """``[B, S, H]`` -> ``start_logits [B, S]``, ``end_logits [B, S]``."""
        start, end = self.qa(h).unbind(-1)
        return start.contiguous(), end.contiguous()


class ClassifierHead(nn.Module):
    """Sequence classification from the first token (DistilBERT's pre-classifier and classifier)."""

    def __init__(self, hidden: int, classes: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, h: Tensor, bias: Tensor) -> Tensor:
        """``[B, S, H]`` -> ``logits [B, classes]``."""
        return self.mlp(h[:, 0])


def bert_qa(seq_len: int, hidden: int, layers: int, heads: int) -> SegmentedModel:
    """BERT encoder with a span head; segments: embeddings, each layer, head."""
    return SegmentedModel([
        Embeddings(hidden, seq_len, token_types=2),
        *(EncoderLayer(hidden, heads, 4 * hidden) for _ in range(layers)),
        SpanHead(hidden),
    ])


def distilbert_classifier(seq_len: int, hidden: int, layers: int, heads: int, classes: int,
                          segments: int) -> SegmentedModel:
    """DistilBERT-style encoder (no token types) with a classifier, cut into ``segments`` even parts."""
    units = [Embeddings(hidden, seq_len, token_types=0),
             *(EncoderLayer(hidden, heads, 4 * hidden) for _ in range(layers)),
             ClassifierHead(hidden, classes)]
    sample = (torch.zeros(1, seq_len, dtype=torch.int32), torch.ones(1, seq_len, dtype=torch.int32))
    return balanced_segments(units, sample, segments)
