"""Where two greedy runs of one prompt part, and how close the tie was there.

Two correct engines that sum in different orders (offload vs GPU-only, TP=2 vs TP=1) can pick
different tokens where the top candidates are within rounding of each other; from there the
sequences differ. These helpers locate the parting and measure the tie with a teacher-forced
forward pass (``ModelRunner.forward_logits``, no KV cache, TP=1 only), and measure how far two
correct computations of the same positions disagree (:func:`decode_noise`).
"""
import torch


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ; None if they agree over their
    common length."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def parting(llm, prompt: list[int], ours: list[int], theirs: list[int]) -> dict | None:
    """The first step where ``theirs`` differs from ``ours``, with ``llm``'s float32 logits there
    (forward of ``prompt + ours[:step]``): ``{"step", "ours", "theirs", "logit_ours",
    "logit_theirs", "logit_gap" (ours - theirs), "theirs_rank" (candidates above theirs),
    "top2"}``; None when the runs agree."""
    step = first_difference(ours, theirs)
    if step is None:
        return None
    logits = llm.model_runner.forward_logits(prompt + ours[:step], last=1)[0]
    a, b = ours[step], theirs[step]
    return {"step": step, "ours": a, "theirs": b, "logit_ours": logits[a].item(),
            "logit_theirs": logits[b].item(), "logit_gap": (logits[a] - logits[b]).item(),
            "theirs_rank": int((logits > logits[b]).sum().item()), "top2": logits.topk(2).values.tolist()}


def decode_noise(llm, prompt: list[int], tokens: list[int], logprobs: list[dict]) -> float:
    """How far two correct computations of the same positions disagree: a greedy run's decode
    logprobs (``logprobs``: per step of ``tokens``, its ``{token_id: Logprob}`` of the top
    candidates) against ``llm``'s teacher-forced forward of ``prompt + tokens``. Returns the
    largest change, over the steps and the pairs of a step's candidates, of the gap between two
    candidates (a difference of logits: the normaliser cancels). A parting of two engines whose
    candidates' gap is within this is a tie at the precision the model runs in."""
    if len(logprobs) != len(tokens) or not tokens:
        raise ValueError(f"need one logprobs entry per token: {len(logprobs)} entries for {len(tokens)} tokens")
    forced = llm.model_runner.forward_logits(prompt + tokens[:-1], last=len(tokens)).cpu()
    worst = 0.0
    for row, step in zip(forced, logprobs):
        ids = list(step)
        decoded = torch.tensor([step[t].logprob for t in ids], dtype=torch.float64)
        teacher = row[ids].double()
        change = (decoded[:, None] - decoded[None, :]) - (teacher[:, None] - teacher[None, :])
        worst = max(worst, change.abs().max().item())
    return worst
