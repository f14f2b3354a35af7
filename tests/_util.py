"""Helpers shared by the CPU tests (imported by conftest.py and the test modules)."""
import random

import torch

VOCAB_SIZE = 2048
EOS_ID = 2
GLM_EOS = [EOS_ID, 5, 6]  # GLM's chat models end on any of three ids
PHI3_ORIGINAL = 64  # phi3_dir's original_max_position_embeddings: its long factors apply past 64 tokens
SLIDING_WINDOW = 300  # the window of the sliding-window checkpoints: its edge falls inside a 256-token block
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3; "</s>" is EOS_ID

ENGINE_DEFAULTS = dict(max_model_len=1024, num_kvcache_blocks=32, kvcache_block_size=256,
                       device="cpu", dtype="float32", enforce_eager=True)


def build_llm(model_dir, **kwargs):
    """An engine with CPU-friendly defaults (``ENGINE_DEFAULTS`` overridden by ``kwargs``)."""
    from nanovllm import LLM

    return LLM(model_dir, **{**ENGINE_DEFAULTS, **kwargs})


def random_prompt(n: int, seed: int, low: int = len(SPECIAL_TOKENS), high: int = VOCAB_SIZE) -> list[int]:
    """``n`` random token ids (no special tokens) from a fixed seed."""
    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(n)]


def greedy(max_tokens: int, **kwargs):
    from nanovllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def token_ids(outputs) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


def run_requests(llm, prompts, params) -> dict[int, dict]:
    """Queue ``prompts`` with add_request and step until the engine is idle.

    Returns ``{seq_id: {"token_ids", "finish_reason", "seq"}}`` in queueing order."""
    if not isinstance(params, list):
        params = [params] * len(prompts)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while not llm.is_finished():
        finished, _ = llm.step()
        for seq in finished:
            done[seq.seq_id] = {"token_ids": seq.completion_token_ids,
                                "finish_reason": seq.finish_reason, "seq": seq}
    return {i: done[i] for i in ids}


class LogitRecorder:
    """Records, per sequence, the float32 logits row of every sampled step."""

    def __init__(self, llm):
        self.rows: dict = {}
        runner = llm.model_runner
        sampler_forward, run = runner.sampler.forward, runner.run

        def recording_run(seqs, is_prefill, *args, **kwargs):
            self.sampled = [s.seq_id for s in seqs if s.samples_token]
            return run(seqs, is_prefill, *args, **kwargs)

        def recording_forward(logits, *args, **kwargs):
            for seq_id, row in zip(self.sampled, logits.float()):
                self.rows.setdefault(seq_id, []).append(row.clone())
            return sampler_forward(logits, *args, **kwargs)

        runner.run, runner.sampler.forward = recording_run, recording_forward

    def per_request(self, seq_ids: list[int]) -> list:
        import torch

        return [torch.stack(self.rows[i]) for i in seq_ids]


def generate_with_logits(llm, prompts, max_tokens):
    """Greedy ``max_tokens`` per prompt: (completion token ids, float32 logits ``[steps, vocab]``)
    per prompt, in prompt order."""
    recorder = LogitRecorder(llm)
    ids = [llm.add_request(p, greedy(max_tokens)) for p in prompts]
    done = {}
    while not llm.is_finished():
        for seq in llm.step()[0]:
            done[seq.seq_id] = seq.completion_token_ids
    return [done[i] for i in ids], recorder.per_request(ids)


ARCHS = ("qwen3", "llama3", "llama_tied", "qwen2", "glm", "glm4", "phi3_4k")  # conftest fixtures f"{arch}_dir"


class StepRecorder:
    """Wraps ``llm.model_runner.run`` to record, per step, whether it was a prefill and the
    tokens each sequence computed: ``steps = [(is_prefill, [(seq_id, num_tokens), ...]), ...]``."""

    def __init__(self, llm):
        self.llm, self.steps = llm, []
        self._run = llm.model_runner.run

        def run(seqs, is_prefill, *args, **kwargs):
            self.steps.append((is_prefill, [(s.seq_id, s.num_scheduled_tokens) for s in seqs]))
            return self._run(seqs, is_prefill, *args, **kwargs)

        llm.model_runner.run = run

    def close(self):
        del self.llm.model_runner.run  # back to the class method

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def prefill_tokens(self, seq_id: int) -> list[int]:
        """Chunk sizes computed for ``seq_id`` in prefill steps."""
        return [n for is_prefill, rows in self.steps if is_prefill for sid, n in rows if sid == seq_id]


def random_qk(seq_q, seq_k, heads_q, heads_kv, dim, dtype=torch.float32, seed=0):
    """Seeded q ``[seq_q, heads_q, dim]`` and k ``[seq_k, heads_kv, dim]`` for attention-kernel
    tests, with a few keys scaled by 3 so block scores are far from uniform (ties unlikely)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seq_q, heads_q, dim, generator=gen)
    k = torch.randn(seq_k, heads_kv, dim, generator=gen)
    k[torch.randint(0, seq_k, (max(1, seq_k // 40),), generator=gen)] *= 3.0
    return q.to(dtype), k.to(dtype)


def run_torchrun(spec: dict, out_dir, nproc: int = 2, timeout: int = 900) -> list[list[list[int]]]:
    """Run ``tests/_torchrun_generate.py`` under torchrun (``--standalone``: env:// rendezvous
    on this host) with ``spec`` (see that script); returns, in rank order, each rank's list of
    its engines' token ids."""
    import json
    import os
    import subprocess
    import sys

    spec_path = os.path.join(out_dir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    script = os.path.join(os.path.dirname(__file__), "_torchrun_generate.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={nproc}", script, spec_path, str(out_dir)],
                   check=True, env=env, timeout=timeout)
    ranks = []
    for rank in range(nproc):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            ranks.append(json.load(f))
    return ranks


LOGPROB_TOL = 1e-4  # float32 logprobs against transformers'


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax over the vocabulary at every position of ``ids`` (float32)."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_logprobs(entry: dict, token: int, ref: torch.Tensor, k: int, tokenizer):
    """One ``{token_id: Logprob}`` dict against transformers' log_softmax row ``ref``: the token
    first, then the top-k by rank; values within LOGPROB_TOL; ranks and decoded tokens right."""
    from nanovllm.outputs import Logprob

    assert list(entry)[0] == token
    assert len(entry) == (k if entry[token].rank <= k else k + 1)  # the token is one of the top-k, or added
    ordered = ref.sort(descending=True).values
    for t, lp in entry.items():
        assert isinstance(lp, Logprob)
        assert abs(lp.logprob - float(ref[t])) <= LOGPROB_TOL, (t, lp.logprob, float(ref[t]))
        assert lp.decoded_token == tokenizer.decode([t])
    value = float(ref[token])
    lowest, highest = (int((ref > value + d).sum()) + 1 for d in (LOGPROB_TOL, -LOGPROB_TOL))
    assert lowest <= entry[token].rank <= highest
    for t, lp in list(entry.items())[1:]:
        assert 1 <= lp.rank <= k and abs(float(ref[t]) - float(ordered[lp.rank - 1])) <= LOGPROB_TOL


def assert_same(actual, expected, float_tol: float, where: str = "outputs"):
    """Equal nested structures (dicts in the same key order, lists, tuples): floats within
    ``float_tol``, everything else exactly; the failure names the path to the first difference."""
    if isinstance(expected, float):
        assert abs(actual - expected) <= float_tol, (where, actual, expected)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), where
        for key in expected:
            assert_same(actual[key], expected[key], float_tol, f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, float_tol, f"{where}[{i}]")
    else:
        assert actual == expected, (where, actual, expected)


def prefill(bm, seq):
    """Admit ``seq`` to block manager ``bm`` and write its whole prompt, as the scheduler's chunks
    would."""
    bm.allocate(seq)
    while seq.num_computed_tokens < len(seq):
        n = bm.ensure_writable(seq, len(seq) - seq.num_computed_tokens)
        assert n > 0
        seq.num_computed_tokens += n
        bm.commit(seq)
