"""Batched sampling: one token per row of logits, each row with its own SamplingParams.

Greedy rows take the argmax. Other rows apply temperature, then top-k, then top-p, and draw with
the exponential race: argmax(probs / E) with E ~ Exp(1) i.i.d. picks token i with probability
probs[i], and needs no cumulative sum or search. A seeded row draws its noise from a generator
seeded by (seed, output_index) alone, so its tokens never depend on what else is in the batch,
and a request preempted and recomputed draws the same noise again.

On CPU, rows with a temperature and neither top-k nor top-p (the OpenAI API's defaults) draw in
one pass of our kernel instead (cpu_kernels ops.sample: the same race in log space, the Gumbel-max
trick, its noise a hash of the row's seed and the token index): torch's softmax, noise and
division over a batch of 64 rows of SmolLM2's 49,152 logits took about 28 ms a step, the kernel
about 3 (docs/benchmarks.md, 'sixth pass'). A seeded row's seed is still (seed, output_index)
alone; an unseeded row's comes from the sampler's generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from contracts.sampling import SamplingParams
from model_worker.runner.cpu_kernels import ops as cpu_ops

# Mixes (seed, output_index) into one generator seed; a prime multiplier keeps neighbouring
# (seed, index) pairs apart.
_SEED_MULTIPLIER = 1_000_003
_SEED_MODULUS = 2**63


def row_seed(seed: int, output_index: int) -> int:
    return (seed * _SEED_MULTIPLIER + output_index) % _SEED_MODULUS


class Sampler:
    """On CUDA it never waits for the GPU before the caller reads the token ids: per-row settings go
    up from pinned memory without blocking, and top-p takes a full sort rather than a branch on the
    data (which would need a sync)."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        # Noise for unseeded rows; seeded once, so a fresh runner replays the same stream.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._row_generator = torch.Generator(device=device)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               output_indices: Sequence[int]) -> list[int]:
        """logits (N, vocab) in float32 or the model's dtype (upcast here where a row samples; the
        argmax of a greedy row is the same either way, the upcast being exact); params and
        output_indices have N entries. Returns N token ids."""
        if not params:
            return []
        greedy = [p.temperature == 0.0 for p in params]
        if all(greedy):
            return self._argmax(logits).tolist()
        vocab_size = logits.shape[1]
        fused = ([not g and not _filters(p, vocab_size) for g, p in zip(greedy, params)]
                 if self._has_fused_kernel(logits) else [False] * len(params))
        if not any(fused):
            return self._torch_sample(logits, params, output_indices).tolist()
        if all(fused):
            return self._fused(logits, params, output_indices).tolist()
        # Rows of both kinds: each drawn its own way (greedy rows with the others, by argmax), then
        # put back in order.
        tokens = [0] * len(params)
        for rows, how in ((_where(fused), self._fused), (_where(not f for f in fused), self._torch_sample)):
            drawn = how(logits[rows], [params[i] for i in rows], [output_indices[i] for i in rows])
            for row, token in zip(rows, drawn.tolist()):
                tokens[row] = token
        return tokens

    def _has_fused_kernel(self, logits: torch.Tensor) -> bool:
        return (logits.device.type == "cpu" and cpu_ops.supports(logits.dtype) and logits.stride(1) == 1
                and cpu_ops.kernels() is not None)

    def _fused(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               output_indices: Sequence[int]) -> torch.Tensor:
        """Rows with a temperature and no top-k or top-p, drawn by the CPU kernel."""
        inv_temperatures = torch.tensor([1.0 / p.temperature for p in params], dtype=torch.float32)
        unseeded = [p.seed is None for p in params]
        seeds = (torch.randint(0, 2**63 - 1, (len(params),), generator=self.generator) if any(unseeded)
                 else torch.empty(len(params), dtype=torch.int64))
        for row, (p, output_index) in enumerate(zip(params, output_indices)):
            if p.seed is not None:
                seeds[row] = row_seed(p.seed, output_index)
        return cpu_ops.sample(logits.contiguous(), inv_temperatures, seeds)

    def _torch_sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                      output_indices: Sequence[int]) -> torch.Tensor:
        """Each row drawn by torch ops (top-k and top-p included); greedy rows take the argmax."""
        greedy = [p.temperature == 0.0 for p in params]
        if all(greedy):
            return self._argmax(logits)
        full = logits
        logits = logits.float()
        probs = self._filtered_probs(logits, params)
        noise = self._exponential_noise(probs.shape, params, output_indices)
        sampled = (probs / noise).argmax(dim=-1)
        if any(greedy):
            greedy_rows = self._tensor(greedy, torch.bool)
            sampled = torch.where(greedy_rows, self._argmax(full), sampled)
        return sampled

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax; on CPU by our kernel where it is built (both threads, no float32 copy:
        torch's argmax over a batch of 64 rows of SmolLM2's 49,152 logits took 3-4 ms a step)."""
        if logits.device.type == "cpu" and cpu_ops.supports(logits.dtype) and cpu_ops.kernels() is not None:
            return cpu_ops.argmax(logits.contiguous())
        return logits.argmax(dim=-1)

    def _filtered_probs(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        # Greedy rows get temperature 1 here; their result is replaced by the argmax.
        temperatures = self._tensor([p.temperature or 1.0 for p in params], torch.float32)
        logits = logits / temperatures.unsqueeze(1)
        vocab_size = logits.shape[1]
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
        if any(top_ks):
            logits = _apply_top_k(logits, top_ks, self._tensor(top_ks, torch.int64))
        probs = logits.softmax(dim=-1)
        top_ps = [p.top_p for p in params]
        if any(p < 1.0 for p in top_ps):
            top_p = self._tensor(top_ps, probs.dtype).unsqueeze(1)
            probs = _apply_top_p_sorted(probs, top_p) if self._cuda else _apply_top_p(probs, top_p)
        return probs

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """Per-row values on the device; on CUDA through pinned memory, without a host sync."""
        tensor = torch.tensor(values, dtype=dtype)
        if self._cuda:
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def _exponential_noise(self, shape: torch.Size, params: Sequence[SamplingParams],
                           output_indices: Sequence[int]) -> torch.Tensor:
        # E = -log(U), U ~ Uniform[0, 1): torch.rand is several times faster than exponential_ on
        # CPU. E lies in (0, inf], so probs / E is never NaN.
        uniform = torch.rand(shape, device=self.device, generator=self.generator)
        for row, (p, output_index) in enumerate(zip(params, output_indices)):
            if p.seed is not None and p.temperature != 0.0:
                self._row_generator.manual_seed(row_seed(p.seed, output_index))
                uniform[row] = torch.rand(shape[1], device=self.device, generator=self._row_generator)
        return uniform.log_().neg_()


def _filters(params: SamplingParams, vocab_size: int) -> bool:
    """Whether a row narrows its distribution by top-k or top-p before drawing."""
    return 0 < params.top_k < vocab_size or params.top_p < 1.0


def _where(flags) -> list[int]:
    return [i for i, flag in enumerate(flags) if flag]


# Tokens sorted (by topk) per row for top-p: a full sort of the vocabulary is the slowest op of
# sampling on CPU, and a real model's nucleus is usually far smaller. Rows whose nucleus is wider
# (flat distributions) find their cut-off by bisection instead, which costs no sort at all.
TOP_P_CANDIDATES = 256
# Halvings of the probability interval: the cut-off lands within max_prob / 2**32 of the exact one.
TOP_P_BISECTION_STEPS = 32


def _apply_top_k(logits: torch.Tensor, top_ks: list[int], ks: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k largest logits (0 = keep all); ties with the k-th value are kept.
    ks: top_ks on the logits' device."""
    top_values = logits.topk(max(top_ks), dim=-1).values  # sorted, descending
    kth = top_values.gather(1, (ks.clamp(min=1) - 1).unsqueeze(1))
    kth = kth.masked_fill((ks == 0).unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (N, 1), renormalised.

    A token is dropped when the mass strictly before it already reaches top_p; the top token is
    always kept. Each row's cut-off depends on that row alone, never on the rest of the batch.
    """
    num_candidates = min(probs.shape[1], TOP_P_CANDIDATES)
    top_probs = probs.topk(num_candidates, dim=-1).values  # sorted, descending
    keep = (top_probs.cumsum(dim=-1) - top_probs) < top_p
    # The top token always stays, whatever top_p rounded to: with none kept the gather below would
    # index -1 (SamplingParams clamps top_p; this holds for any caller).
    keep[:, 0] = True
    threshold = top_probs.gather(1, keep.sum(dim=-1, keepdim=True) - 1)  # (N, 1)
    wide = keep[:, -1] if num_candidates < probs.shape[1] else torch.zeros_like(keep[:, -1])
    if wide.any():
        rows = wide.nonzero().squeeze(1)
        threshold[rows] = _bisect_top_p_threshold(probs[rows], top_p[rows])
    filtered = probs.masked_fill(probs < threshold, 0.0)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def _apply_top_p_sorted(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """_apply_top_p's cut-off from a full sort of every row: no branch on the data, so no host
    sync, and a sort of the vocabulary is cheap on a GPU (it is the slow way on CPU)."""
    sorted_probs = probs.sort(dim=-1, descending=True).values
    keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p
    keep[:, 0] = True
    threshold = sorted_probs.gather(1, keep.sum(dim=-1, keepdim=True) - 1)
    filtered = probs.masked_fill(probs < threshold, 0.0)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def _bisect_top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """(N, 1): the largest t with mass(probs >= t) >= top_p, found without sorting."""
    low = torch.zeros_like(top_p)  # mass(probs >= 0) = 1 >= top_p: low always qualifies
    high = probs.max(dim=-1, keepdim=True).values
    for _ in range(TOP_P_BISECTION_STEPS):
        mid = (low + high) / 2
        # sign(p - mid) + 1 is 2 above mid and 0 below, so this sums twice the mass above mid; on
        # CPU it is several times faster than a comparison and a masked sum.
        enough = (probs - mid).sign_().add_(1.0).mul_(probs).sum(dim=-1, keepdim=True) >= 2 * top_p
        low = torch.where(enough, mid, low)
        high = torch.where(enough, high, mid)
    # Snap to the smallest kept probability, so the cut-off is a real token's value.
    return torch.where(probs >= low, probs, float("inf")).min(dim=-1, keepdim=True).values
