"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, mixed in one batch."""
import torch
from torch import nn


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus with -inf (vLLM's semantics)."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.size(-1)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    drop = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


class Sampler(nn.Module):
    """logits float ``[batch, vocab]`` -> token ids int64 ``[batch]``.

    Sampled rows use the exponential race (Gumbel-max equivalent): argmax(p / E), E ~ Exp(1),
    drawn from the row's own generator when its request has a seed. Rows with temperature 0 take
    the exact argmax of the logits. ``generators`` maps a batch row to its seeded generator.
    """

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, generators: dict[int, torch.Generator],
                sampled_rows: list[int], needs_filter: bool,
                generator: torch.Generator | None = None) -> torch.Tensor:
        """``sampled_rows``: rows with temperature > 0 (host list, so no device sync);
        ``needs_filter``: some sampled row has top-k or top-p (else the vocab sort is skipped);
        ``generator``: the engine's generator for rows without a seed of their own."""
        logits = logits.float()
        greedy_tokens = logits.argmax(-1)
        if not sampled_rows:
            return greedy_tokens
        rows = torch.tensor(sampled_rows, device=logits.device)
        scaled = logits[rows] / temperatures[rows].unsqueeze(1)
        if needs_filter:
            scaled = _apply_top_k_top_p(scaled, top_k[rows], top_p[rows])
        probs = scaled.softmax(-1)
        noise = torch.empty_like(probs).exponential_(generator=generator)
        for i, row in enumerate(sampled_rows):
            if row in generators:
                gen = generators[row]
                noise[i] = torch.empty(probs.size(1), device=gen.device).exponential_(generator=gen)
        tokens = greedy_tokens.clone()
        tokens[rows] = (probs / noise).argmax(-1)
        return tokens
