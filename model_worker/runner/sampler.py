"""Batched sampling: one token per row of logits, each row with its own SamplingParams.

Greedy rows take the argmax. Other rows apply temperature, then top-k, then top-p, and draw with
the exponential race: argmax(probs / E) with E ~ Exp(1) i.i.d. picks token i with probability
probs[i], and needs no cumulative sum or search. A seeded row draws its noise from a generator
seeded by (seed, output_index) alone, so its tokens never depend on what else is in the batch,
and a request preempted and recomputed draws the same noise again.

Before any of that, rows whose parameters ask for it (SamplingParams.processes_logits) have their
logits processed, as batched tensor ops over those rows only: min_tokens masks EOS and the stop
ids, logit_bias adds its values, then the penalties on tokens already seen (repetition on prompt
and output, frequency and presence on the output, as vLLM applies them). A step whose rows ask
for none of it runs none of it. Rows that ask for `logprobs` get the log-softmax of the logits
they were drawn from: processed, divided by the temperature when not greedy, before top-k and
top-p (vLLM's `processed_logprobs`; with no processing and temperature 0 or 1 it is the model's
own distribution).

On CPU, rows with a temperature and neither top-k nor top-p (the OpenAI API's defaults) draw in
one pass of our kernel instead (cpu_kernels ops.sample: the same race in log space, the Gumbel-max
trick, its noise a hash of the row's seed and the token index): torch's softmax, noise and
division over a batch of 64 rows of SmolLM2's 49,152 logits took about 28 ms a step, the kernel
about 3 (docs/benchmarks.md, 'sixth pass'). A seeded row's seed is still (seed, output_index)
alone; an unseeded row's comes from the sampler's generator.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
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

    def __init__(self, device: torch.device, seed: int, eos_token_ids: Sequence[int] = ()) -> None:
        self.device = device
        # What min_tokens keeps from being sampled early, with each request's stop ids.
        self.eos_token_ids = list(eos_token_ids)
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
        return self.sample_with_logprobs(logits, params, output_indices)[0]

    def sample_with_logprobs(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                             output_indices: Sequence[int],
                             histories: Sequence[tuple[Sequence[int], Sequence[int]] | None] | None = None,
                             mask: Callable[[torch.Tensor], None] | None = None,
                             ) -> tuple[list[int], dict[int, tuple[float, list[int], list[float]]]]:
        """sample(), with each row's logits processed first and, for the rows that ask, the
        logprobs of what was drawn: {row: (the token's log probability, the top ids, theirs)}.
        histories: per row, the (prompt, output) token ids a penalty reads (None where the row has
        none); required for rows with SamplingParams.penalises_history. `mask`, when given, is
        applied last to the float32 logits, in place (a grammar's allowed tokens)."""
        if not params:
            return [], {}
        if any(p.processes_logits for p in params):
            logits = self._process(logits, params, output_indices, histories)
        if mask is not None:
            logits = logits.float()
            mask(logits)
        tokens = self._draw(logits, params, output_indices)
        if all(p.logprobs is None for p in params):
            return tokens, {}
        return tokens, self._logprobs(logits, params, tokens)

    def _draw(self, logits: torch.Tensor, params: Sequence[SamplingParams], output_indices: Sequence[int]) -> list[int]:
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

    def _process(self, logits: torch.Tensor, params: Sequence[SamplingParams], output_indices: Sequence[int],
                 histories: Sequence[tuple[Sequence[int], Sequence[int]] | None] | None) -> torch.Tensor:
        """The logits in float32 with min_tokens, logit_bias and the penalties applied to the rows
        that ask (a new tensor where the logits came in another dtype; rows in place otherwise)."""
        logits = logits.float()
        vocab_size = logits.shape[1]
        early = _where(p.min_tokens > index for p, index in zip(params, output_indices))
        if early:
            rows, ids = [], []
            for row in early:
                p = params[row]
                # A stop id outside the vocabulary can never be sampled: nothing to mask.
                banned = [t for t in (*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids))
                          if t < vocab_size]
                rows += [row] * len(banned)
                ids += banned
            if ids:
                logits[self._tensor(rows, torch.int64), self._tensor(ids, torch.int64)] = float("-inf")
        biased = _where(p.logit_bias for p in params)
        if biased:
            rows = list(itertools.chain.from_iterable([row] * len(params[row].logit_bias) for row in biased))
            ids = list(itertools.chain.from_iterable(params[row].logit_bias for row in biased))
            values = list(itertools.chain.from_iterable(params[row].logit_bias.values() for row in biased))
            self._check_ids(ids, vocab_size, "a logit_bias token id")
            logits.index_put_((self._tensor(rows, torch.int64), self._tensor(ids, torch.int64)),
                              self._tensor(values, torch.float32), accumulate=True)
        penalised = _where(p.penalises_history for p in params)
        if penalised:
            if histories is None or any(histories[row] is None for row in penalised):
                raise ValueError("a row with a penalty needs its token history")
            self._penalise(logits, penalised, [params[row] for row in penalised],
                           [histories[row] for row in penalised])
        return logits

    def _penalise(self, logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                  histories: list[tuple[Sequence[int], Sequence[int]]]) -> None:
        """Apply the rows' penalties in place, at the (row, token) pairs their histories hold only:
        a history is hundreds of ids where a row is tens of thousands of logits, and four dense
        passes over 32 rows of SmolLM2's vocabulary cost 9 ms a step where these cost well under one."""
        vocab_size = logits.shape[1]
        row_ids = np.asarray(rows, dtype=np.int64)
        output_keys, counts = np.unique(self._history_keys(row_ids, [o for _, o in histories], vocab_size),
                                        return_counts=True)
        if any(p.repetition_penalty != 1.0 for p in params):
            prompt_keys = self._history_keys(row_ids, [prompt for prompt, _ in histories], vocab_size)
            seen = np.union1d(output_keys, prompt_keys)
            repetition = np.ones(logits.shape[0], dtype=np.float32)
            repetition[row_ids] = [p.repetition_penalty for p in params]
            at = (self._upload(seen // vocab_size), self._upload(seen % vocab_size))
            values = logits[at]
            factor = self._upload(repetition[seen // vocab_size])
            logits[at] = torch.where(values > 0, values / factor, values * factor)
        if any(p.frequency_penalty or p.presence_penalty for p in params) and len(output_keys):
            frequency = np.zeros(logits.shape[0], dtype=np.float32)
            presence = np.zeros(logits.shape[0], dtype=np.float32)
            frequency[row_ids] = [p.frequency_penalty for p in params]
            presence[row_ids] = [p.presence_penalty for p in params]
            key_rows = output_keys // vocab_size
            penalty = frequency[key_rows] * counts.astype(np.float32) + presence[key_rows]
            logits.index_put_((self._upload(key_rows), self._upload(output_keys % vocab_size)),
                              self._upload(-penalty), accumulate=True)

    def _history_keys(self, row_ids: np.ndarray, token_lists: list[Sequence[int]], vocab_size: int) -> np.ndarray:
        """row * vocab_size + token for every token of every row's list (rows: logits' rows)."""
        lengths = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
        ids = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=int(lengths.sum()))
        if len(ids):
            self._check_ids(ids, vocab_size, "a token id in the history")
        return np.repeat(row_ids, lengths) * vocab_size + ids

    def _logprobs(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                  tokens: list[int]) -> dict[int, tuple[float, list[int], list[float]]]:
        """For each row with logprobs set: the log-softmax of the logits it was drawn from (over the
        temperature when not greedy), at the drawn token and at the top `logprobs` ids."""
        rows = _where(p.logprobs is not None for p in params)
        asked = [params[row] for row in rows]
        scaled = logits[self._tensor(rows, torch.int64)].float()
        if any(p.temperature not in (0.0, 1.0) for p in asked):
            scaled /= self._tensor([p.temperature or 1.0 for p in asked], torch.float32).unsqueeze(1)
        drawn_values, top_ids, top_values = token_logprobs(
            scaled, self._tensor([tokens[row] for row in rows], torch.int64), max(p.logprobs for p in asked))
        return {row: (drawn_values[i], top_ids[i][:p.logprobs], top_values[i][:p.logprobs])
                for i, (row, p) in enumerate(zip(rows, asked))}

    @staticmethod
    def _check_ids(ids: Sequence[int] | np.ndarray, vocab_size: int, what: str) -> None:
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"{what} is out of the vocabulary [0, {vocab_size})")

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor.to(self.device, non_blocking=True) if self._cuda else tensor

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


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, num_top: int
                   ) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """log_softmax of each row of float32 `logits` (R, vocab) at its `chosen` id (R,), and its
    `num_top` largest values with their ids. As x - logsumexp(x): two passes over the rows, none
    writing a copy of them (log_softmax and then a top-k over its output cost 2.7 ms a step at 32
    rows of SmolLM2's vocabulary). The sampled tokens' logprobs and the prompt's both come here."""
    normaliser = torch.logsumexp(logits, dim=-1, keepdim=True)
    drawn = (logits.gather(1, chosen.unsqueeze(1)) - normaliser).squeeze(1).tolist()
    top_values, top_ids = logits.topk(num_top, dim=-1) if num_top else (logits[:, :0], logits[:, :0].long())
    return drawn, top_ids.tolist(), (top_values - normaliser).tolist()


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
