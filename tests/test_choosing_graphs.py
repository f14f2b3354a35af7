"""Decode with a choosing policy replayed from CUDA graphs (``nanovllm/engine/cuda_graphs.py``,
``DecodeSelection.for_graphs``). The CPU has no CUDA graphs: here a graph's replay is stood in for
by running the captured forward eagerly over the graph's own tensors, so that everything but the
capture itself is tested (the batch padded to a captured size, the step's selection copied into the
fixed-shape one with its candidates padded to ``max_model_len`` and the rows past the batch reading
nothing, the reads counted by the cache instead of the layers). The capture runs on the GPU in
tests/gpu/test_quest_gpu.py."""
import pytest

from _util import build_llm, generate_with_logits, random_prompt
from nanovllm.engine import cuda_graphs, model_runner
from nanovllm.kvcache.cache import KVCache
from nanovllm.kvcache.context import get_context, set_context


class EagerReplay:
    """A captured graph's stand-in: its replay runs the model over the graphs' tensors, the
    selection's per-layer plans computed anew as a graph's replay computes them."""

    def __init__(self, graphs, bs: int, selection):
        self.graphs, self.bs, self.selection = graphs, bs, selection

    def replay(self):
        g = self.graphs
        if self.selection is not None:
            self.selection.reset_plans()
        set_context(g._context(self.bs, self.selection))
        g.outputs[:self.bs] = g.model(g.input_ids[:self.bs], g.positions[:self.bs])
        g.replayed.append((self.bs, self.selection is not None))


def stand_in_record(self, bs):
    """``DecodeGraphs._record`` on the CPU: ``_capture`` ran the warm-up and reset the plans."""
    selection = get_context().selection
    assert selection is None or not selection._plans, "a capture must compute the plans inside the graph"
    if not hasattr(self, "replayed"):
        self.replayed = []
    return EagerReplay(self, bs, selection)


@pytest.fixture
def cpu_graphs(monkeypatch):
    """Engines built inside the test get the decode graphs (stood in for) as on CUDA, unless
    built with ``enforce_eager``."""
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "_record", stand_in_record)
    monkeypatch.setattr(model_runner, "KVCache", lambda config, layers, device, sizes, graphs: KVCache(
        config, layers, device, cuda_graphs.captured_batch_sizes(config.max_num_seqs), not config.enforce_eager))
    setup = model_runner.ModelRunner.setup

    def setup_with_graphs(self):
        setup(self)
        if not self.config.enforce_eager:
            self.graphs = cuda_graphs.DecodeGraphs(self)

    monkeypatch.setattr(model_runner.ModelRunner, "setup", setup_with_graphs)


@pytest.mark.parametrize("policy", [dict(sparse_policy="QUEST", sparse_token_budget=64),
                                    dict(sparse_policy="STREAMING")], ids=["quest", "streaming"])
def test_choosing_decode_from_graphs_equals_eager(qwen3_dir, cpu_graphs, policy):
    """Three sequences (padded to the captured size 4): the replayed steps give the eager engine's
    tokens, logits (1e-5) and counted reads."""
    prompts = [random_prompt(n, seed=40 + n) for n in (600, 900, 1300)]
    opts = dict(max_model_len=2048, max_num_seqs=4, sparse_sink_tokens=16, sparse_recent_tokens=32, **policy)
    with build_llm(qwen3_dir, enforce_eager=True, **opts) as llm:
        assert llm.model_runner.graphs is None and not llm.model_runner.cache.choosing_graph_sizes
        ref_tokens, ref_logits = generate_with_logits(llm, prompts, 8)
        ref_reads = llm.get_sparse_stats()["decode"]
    with build_llm(qwen3_dir, enforce_eager=False, **opts) as llm:
        graphs = llm.model_runner.graphs
        assert llm.model_runner.cache.choosing_graph_sizes == [1, 2, 4] and sorted(graphs.selections) == [1, 2, 4]
        tokens, logits = generate_with_logits(llm, prompts, 8)
        reads = llm.get_sparse_stats()["decode"]
    assert (4, True) in graphs.replayed and not any(not choosing for _, choosing in graphs.replayed)
    assert tokens == ref_tokens
    assert all((a - b).abs().max() <= 1e-5 for a, b in zip(logits, ref_logits))
    assert reads["read_tokens"] == ref_reads["read_tokens"] and reads["context_tokens"] == ref_reads["context_tokens"]
    assert reads["density"] < 0.5


def test_a_batch_with_a_sequence_that_reads_everything_runs_eagerly(qwen3_dir, cpu_graphs):
    """A short sequence reads all its pages (it does not choose): that batch's steps are not
    replayed, and the tokens are the eager engine's."""
    prompts = [random_prompt(n, seed=70 + n) for n in (100, 1300)]
    opts = dict(max_model_len=2048, max_num_seqs=4, sparse_policy="QUEST", sparse_token_budget=64,
                sparse_sink_tokens=16, sparse_recent_tokens=32)
    with build_llm(qwen3_dir, enforce_eager=True, **opts) as llm:
        ref_tokens, _ = generate_with_logits(llm, prompts, 6)
    with build_llm(qwen3_dir, enforce_eager=False, **opts) as llm:
        graphs = llm.model_runner.graphs
        tokens, _ = generate_with_logits(llm, prompts, 6)
    assert not graphs.replayed and tokens == ref_tokens


def test_no_choosing_graphs_where_no_sequence_could_choose_or_the_policy_declines(qwen3_dir, cpu_graphs):
    """A context too short to have more candidates than the budget, and ORACLE (it reads every
    candidate's keys to choose), get no choosing graphs."""
    with build_llm(qwen3_dir, enforce_eager=False, max_model_len=512, sparse_policy="QUEST",
                   sparse_token_budget=512) as llm:
        assert llm.model_runner.cache.choosing_graph_sizes == [] and not llm.model_runner.graphs.selections
    with build_llm(qwen3_dir, enforce_eager=False, max_model_len=2048, sparse_policy="ORACLE",
                   sparse_token_budget=64) as llm:
        assert llm.model_runner.cache.choosing_graph_sizes == []


def test_a_narrower_step_after_a_wider_one_reads_only_its_own_pages(qwen3_dir, cpu_graphs):
    """Four long sequences, then three shorter ones on the same engine (the same graph of 4 rows):
    what the wider steps left in the graph's tensors is not read (tokens and logits as eager)."""
    long = [random_prompt(n, seed=20 + n) for n in (1700, 1800, 1900, 1950)]
    short = [random_prompt(n, seed=30 + n) for n in (500, 600, 700)]
    opts = dict(max_model_len=2048, max_num_seqs=4, sparse_policy="QUEST", sparse_token_budget=64,
                sparse_sink_tokens=16, sparse_recent_tokens=32)
    with build_llm(qwen3_dir, enforce_eager=True, **opts) as llm:
        ref = [generate_with_logits(llm, prompts, 6) for prompts in (long, short)]
    with build_llm(qwen3_dir, enforce_eager=False, **opts) as llm:
        got = [generate_with_logits(llm, prompts, 6) for prompts in (long, short)]
        assert llm.model_runner.graphs.replayed.count((4, True)) >= 10
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got, ref):
        assert tokens == ref_tokens
        assert all((a - b).abs().max() <= 1e-5 for a, b in zip(logits, ref_logits))


def test_choosing_decode_over_the_host_tier_from_graphs_equals_eager(qwen3_dir, cpu_graphs):
    """With a host tier holding most of the KV, the replayed steps gather host pages (through the
    reuse cache and staging pages) and give the eager engine's tokens, logits (1e-5), counted reads,
    host bytes loaded and reuse; pages are counted on the device, replay by replay."""
    prompts = [random_prompt(n, seed=80 + n) for n in (900, 1300, 1700)]
    opts = dict(max_model_len=2048, max_num_seqs=4, enable_cpu_offload=True, num_kvcache_blocks=8,
                num_cpu_kvcache_blocks=24, num_ring_slots=2, sparse_policy="QUEST", sparse_token_budget=64,
                sparse_sink_tokens=16, sparse_recent_tokens=32)
    stats = {}
    for eager in (True, False):
        with build_llm(qwen3_dir, enforce_eager=eager, **opts) as llm:
            tokens, logits = generate_with_logits(llm, prompts, 8)
            stats[eager] = (tokens, logits, llm.get_sparse_stats()["decode"], llm.get_kv_cache_stats())
            graphs = llm.model_runner.graphs
    (ref_tokens, ref_logits, ref_decode, ref_kv), (got_tokens, got_logits, decode, kv) = stats[True], stats[False]
    assert (4, True) in graphs.replayed, "the three sequences' steps replayed, padded to 4 rows"
    assert ref_kv["spilled_blocks"] > 0 and ref_decode["loaded_host_bytes"] > 0 and ref_decode["reuse_rate"] > 0
    assert got_tokens == ref_tokens
    assert all((a - b).abs().max() <= 1e-5 for a, b in zip(got_logits, ref_logits))
    for key in ("read_tokens", "context_tokens", "loaded_host_bytes", "available_host_bytes", "read_host_pages",
                "reused_host_pages"):
        assert decode[key] == ref_decode[key], key
    assert kv["loaded_blocks"] == ref_kv["loaded_blocks"]
