"""The token choice of one decode step, on the device: HF's logits processors and sampling, graph-safe.

Every value a call sets (temperature, top-p, penalty, eos ids, the step count) lives in a device tensor of
:class:`ChoiceState`, so one captured graph serves every call of the same :attr:`DecodeOptions.mode`; nothing
reads a value back to the host and no shape depends on the data.

HF's order: repetition penalty, then eos masked out below ``min_new_tokens``, then (sampling) temperature,
top-k, top-p. Sampling draws with the exponential-race form of ``multinomial``: ``argmax(p / E)`` with E
~ Exp(1) i.i.d. picks token i with probability p_i, with no host sync and a fixed shape.
"""

from __future__ import annotations

import torch
import transformers
from packaging.version import Version
from torch import Tensor

from fuselm.generation.options import DecodeOptions
from fuselm.ops.argmax import row_argmax

# HF's generate leaves each row's left padding out of its repetition penalty from transformers 5.23 on; before, the
# padding's token ids count as seen
PENALTY_SKIPS_PADDING = Version(transformers.__version__).release >= (5, 23)


class ChoiceState:
    """One batch bucket's decoding state, [B] rows, on ``device``; a call loads it with :meth:`start`.

    Buffers: ``tokens`` [B, 1] int64, the last chosen token (the next step's input); ``positions`` [B, 1] int64,
    its position id; ``generated`` [B, capacity] int64, the tokens chosen so far; ``done`` [B] bool, rows that
    stopped; ``finish`` [B] int64, the step at which each row emitted eos (-1: not yet, or a filler row);
    ``count`` [1] int64, tokens chosen so far; ``seen`` [B, V] bool, tokens in each row (past its left padding
    where HF's penalty skips it: PENALTY_SKIPS_PADDING) for the repetition penalty; ``scores``/``logits`` [B, V]
    fp32, the last step's processed scores and raw logits.
    """

    def __init__(self, batch: int, vocab: int, capacity: int, device: torch.device):
        long = dict(dtype=torch.long, device=device)
        self.tokens = torch.zeros(batch, 1, **long)
        self.positions = torch.zeros(batch, 1, **long)
        self.generated = torch.zeros(batch, capacity, **long)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.finish = torch.full((batch,), -1, **long)
        self.count = torch.zeros(1, **long)
        self.seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
        self.scores = torch.zeros(batch, vocab, dtype=torch.float32, device=device)
        self.logits = torch.zeros_like(self.scores)
        # one eos buffer per count of eos ids, kept: a graph captured for one count reads its buffer on every replay
        self._eos_buffers: dict[int, Tensor] = {}
        self.eos = self.eos_buffer(0)
        fp32 = dict(dtype=torch.float32, device=device)
        # temperature, top_p, repetition penalty; min_new_tokens and the pad id
        self.values = torch.ones(3, **fp32)
        self.limits = torch.zeros(2, **long)
        self._loaded: tuple | None = None  # the option values in values, limits and eos (skip copying them again)

    def start(self, options: DecodeOptions, prompt: Tensor, mask: Tensor | None, real_rows: int) -> None:
        """Load a call: ``prompt`` [B, S] (the bucket's rows, fillers after the ``real_rows``) and its attention
        ``mask`` [B, S] (None: no padding). Device work only."""
        values, limits = (options.temperature, options.top_p, options.repetition_penalty), (options.min_new_tokens,
                                                                                             options.pad or 0)
        self.eos = self.eos_buffer(len(options.eos))
        if self._loaded != (values, limits, options.eos):  # host-to-device copies: the first token waits for them
            self.values.copy_(torch.tensor(values), non_blocking=True)
            self.limits.copy_(torch.tensor(limits), non_blocking=True)
            self.eos.copy_(torch.tensor(options.eos, dtype=torch.long), non_blocking=True)
            self._loaded = (values, limits, options.eos)
        self.count.zero_()
        self.finish.fill_(-1)
        self.done.zero_()
        self.done[real_rows:].fill_(True)  # filler rows only pad the batch to its bucket
        if options.repetition_penalty != 1.0:
            if mask is not None and PENALTY_SKIPS_PADDING:  # up to each row's first non-zero mask value
                padding = (mask != 0).int().argmax(dim=1, keepdim=True)
                ignored = torch.arange(prompt.shape[1], device=prompt.device) < padding
                prompt = torch.where(ignored, prompt[:, -1:], prompt)  # the row's last token, seen anyway
            self.seen.zero_()
            self.seen.scatter_(1, prompt, True)

    def eos_buffer(self, count: int) -> Tensor:
        """The [count] int64 buffer the eos ids of calls with ``count`` of them live in (the same tensor each time)."""
        if count not in self._eos_buffers:
            self._eos_buffers[count] = torch.zeros(count, dtype=torch.long, device=self.tokens.device)
        return self._eos_buffers[count]

    def choose(self, logits: Tensor, options: DecodeOptions) -> Tensor:
        """Pick each row's next token from ``logits`` [B, V] (the model's dtype) and record it; returns the tokens
        [B]. The logits are processed in fp32, as HF's generate does; greedy choice without processing takes the
        argmax of the logits as they are, the same token (fp32 holds every bf16 and fp16 value exactly)."""
        if options.output_logits:
            self.logits.copy_(logits)
        processed = (options.repetition_penalty != 1.0 or (options.min_new_tokens > 0 and options.eos)
                     or options.do_sample or options.output_scores)
        scores = logits.float() if processed else logits
        if options.repetition_penalty != 1.0:
            penalty = self.values[2]
            scores = torch.where(self.seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
        if options.min_new_tokens > 0 and options.eos:
            early = self.count < self.limits[0]  # [1]
            eos_scores = scores.index_select(1, self.eos)
            scores = scores.index_copy(1, self.eos, eos_scores.masked_fill(early, float("-inf")))
        if options.do_sample:
            scores = _warped(scores, options, self.values[0], self.values[1])
            race = torch.empty_like(scores).exponential_()
            tokens = row_argmax(scores.softmax(-1) / race)
        else:
            tokens = row_argmax(scores)
        if options.output_scores:
            self.scores.copy_(scores)
        self._record(tokens, options)
        return self.tokens[:, 0]

    def _record(self, tokens: Tensor, options: DecodeOptions) -> None:
        if options.eos:
            tokens = torch.where(self.done, self.limits[1], tokens)
            newly = torch.isin(tokens, self.eos) & ~self.done
            self.finish.copy_(torch.where(newly, self.count, self.finish))
            self.done.logical_or_(newly)
        self.tokens.copy_(tokens.unsqueeze(1))
        self.generated.index_copy_(1, self.count, self.tokens)
        self.count.add_(1)
        if options.repetition_penalty != 1.0:
            self.seen.scatter_(1, self.tokens, True)

    def advance_positions(self) -> None:
        self.positions.add_(1)


def _warped(scores: Tensor, options: DecodeOptions, temperature: Tensor, top_p: Tensor) -> Tensor:
    """HF's sampling warpers in its order: temperature, top-k (keep the k best), top-p (keep the smallest set of
    best tokens whose probability reaches top_p, at least one). scores [B, V] fp32 -> [B, V]."""
    scores = scores / temperature
    if options.top_k:
        kth = torch.topk(scores, min(options.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if options.top_p < 1.0:
        ascending, order = torch.sort(scores, dim=-1)
        cumulative = ascending.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p
        drop[:, -1] = False
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return scores
