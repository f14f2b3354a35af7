"""One RULER evaluation of a running engine: its settings (:class:`RulerSettings`, the engine
options of :class:`tools.eval_engine.EngineSettings` and the tasks, samples and lengths), the
samples (:func:`build_samples`), the run (:func:`run_ruler`: one greedy ``generate`` per task,
scored with RULER's metric) and its report. ``tests/test_ruler.py`` is its command line;
``benchmarks/ruler_sweep.py`` runs it over settings and lengths.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from tools import ruler
from tools.eval_engine import EngineSettings, engine_offload, sparse_options, sparse_stats_text


# ---- settings and validation -----------------------------------------------------------
@dataclass
class RulerSettings(EngineSettings):
    """One evaluation: which tasks, how many samples of what length, and the engine options
    (:class:`EngineSettings`).

    ``max_new_tokens=None`` uses each task's RULER budget (:data:`ruler.MAX_NEW_TOKENS`).
    ``num_cpu_blocks=None`` gives the offloaded host cache exactly what ``max_num_seqs``
    sequences of ``max_model_len`` tokens need.
    """

    tasks: list[str] = field(default_factory=lambda: list(ruler.TASKS))
    num_samples: int = 5
    input_len: int = 4096
    max_new_tokens: int | None = None
    seed: int = 0
    max_num_seqs: int = 1

    def task_max_new_tokens(self, task: str) -> int:
        return self.max_new_tokens if self.max_new_tokens is not None else ruler.MAX_NEW_TOKENS[task]

    @property
    def max_model_len(self) -> int:
        return self.input_len + max(self.task_max_new_tokens(t) for t in self.tasks)

    def validate(self) -> None:
        """Raise ValueError naming the option, the value and the limit."""
        if not self.tasks:
            raise ValueError("tasks must name at least one task")
        self.tasks = [ruler.resolve_task(t) for t in self.tasks]
        for name, value, low in (("num-samples", self.num_samples, 1), ("input-len", self.input_len, 1),
                                 ("max-num-seqs", self.max_num_seqs, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.max_new_tokens is not None and (not isinstance(self.max_new_tokens, int)
                                                or self.max_new_tokens < 1):
            raise ValueError(f"max-new-tokens must be >= 1, got {self.max_new_tokens!r}")
        super().validate()

    def engine_kwargs(self, max_model_len: int | None = None, max_num_seqs: int | None = None) -> dict:
        """Keyword arguments of :class:`nanovllm.LLM` for this evaluation."""
        return super().engine_kwargs(max_model_len, self.max_num_seqs if max_num_seqs is None else max_num_seqs)


def build_samples(tokenizer, settings: RulerSettings) -> dict[str, list[dict]]:
    """Every task's samples (ValueError when ``input_len`` is too small for one of them)."""
    return {t: ruler.generate_samples(tokenizer, t, settings.num_samples, settings.input_len,
                                      seed=settings.seed) for t in settings.tasks}


# ---- the run -----------------------------------------------------------------------------
@dataclass
class TaskResult:
    task: str
    scores: list[float]
    outputs: list[str]
    answers: list[list[str]]
    finish_reasons: list[str]
    generated_tokens: list[int]
    seconds: float

    @property
    def mean(self) -> float:
        return sum(self.scores) / len(self.scores) if self.scores else 0.0


@dataclass
class RulerReport:
    results: list[TaskResult]
    input_len: int
    settings: dict = field(default_factory=dict)
    offload: dict | None = None
    model: str = ""
    device: str = ""
    dtype: str = ""
    sparse_stats: dict | None = None  # LLM.get_sparse_stats() over the whole evaluation
    sparse_options: dict | None = None  # the options the engine's policy reads, as it runs them

    @property
    def overall(self) -> float:
        """The mean of the per-task means (RULER's average over tasks)."""
        return sum(r.mean for r in self.results) / len(self.results) if self.results else 0.0

    def table(self) -> str:
        width = max([len("overall (task mean)")] + [len(r.task) for r in self.results])
        lines = [f"{'task':<{width}}  {'samples':>7}  {'mean score':>10}  {'seconds':>8}",
                 "-" * (width + 31)]
        for r in self.results:
            lines.append(f"{r.task:<{width}}  {len(r.scores):>7}  {r.mean:>10.3f}  {r.seconds:>8.1f}")
        lines.append("-" * (width + 31))
        lines.append(f"{'overall (task mean)':<{width}}  {sum(len(r.scores) for r in self.results):>7}  "
                     f"{self.overall:>10.3f}  {sum(r.seconds for r in self.results):>8.1f}")
        return "\n".join(lines)

    def summary(self) -> str:
        o = self.offload
        offload = ("off" if o is None else
                   f"on: {o['block_size']}-token blocks, {o['num_ring_slots']} ring slots, "
                   f"{o['gpu_blocks']} GPU + {o['host_blocks']} host blocks, policy {o['sparse_policy']}")
        head = [f"model:       {self.model} ({self.device}, {self.dtype})",
                f"input len:   {self.input_len} tokens per prompt",
                f"offload:     {offload}",
                f"sparse:      {sparse_stats_text(self.sparse_stats, self.sparse_options)}", ""]
        return "\n".join(head) + self.table()

    def to_json(self) -> dict:
        return {"model": self.model, "device": self.device, "dtype": self.dtype,
                "input_len": self.input_len, "settings": self.settings, "offload": self.offload,
                "sparse_stats": self.sparse_stats, "sparse_options": self.sparse_options,
                "overall_mean_score": self.overall,
                "tasks": [{**asdict(r), "mean_score": r.mean, "num_samples": len(r.scores)}
                          for r in self.results]}


def run_ruler(llm, settings: RulerSettings, samples: dict[str, list[dict]] | None = None,
              log=None) -> RulerReport:
    """Generate every task's samples greedily with ``llm`` (one ``generate`` call per task) and
    score them. ``samples`` (from :func:`build_samples`) are built when not given; ``log`` (a
    callable taking a line) reports each task as it finishes.

    Raises:
        ValueError: bad settings, or ``input_len + max_new_tokens`` beyond the engine's
            ``max_model_len``.
    """
    from nanovllm import SamplingParams

    settings.validate()
    cfg = llm.config
    if settings.max_model_len > cfg.max_model_len:
        raise ValueError(f"input-len + max-new-tokens = {settings.max_model_len} exceeds the "
                         f"engine's max_model_len={cfg.max_model_len}")
    if samples is None:
        samples = build_samples(llm.tokenizer, settings)
    llm.reset_sparse_stats()
    results = []
    for task in settings.tasks:
        batch = samples[task]
        params = [SamplingParams(temperature=0.0, max_tokens=settings.max_new_tokens or s["max_new_tokens"])
                  for s in batch]
        t0 = time.perf_counter()
        outs = llm.generate([s["input_ids"] for s in batch], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        result = TaskResult(
            task=task, scores=[ruler.score(task, o["text"], s["answers"]) for o, s in zip(outs, batch)],
            outputs=[o["text"] for o in outs], answers=[s["answers"] for s in batch],
            finish_reasons=[o["finish_reason"] for o in outs],
            generated_tokens=[len(o["token_ids"]) for o in outs], seconds=seconds)
        results.append(result)
        if log is not None:
            log(f"{task}: mean score {result.mean:.3f} over {len(batch)} samples ({seconds:.1f} s)")
    return RulerReport(results=results, input_len=settings.input_len, settings=asdict(settings),
                       offload=engine_offload(llm), model=str(cfg.model), device=cfg.device,
                       dtype=str(cfg.dtype).removeprefix("torch."), sparse_stats=llm.get_sparse_stats(),
                       sparse_options=sparse_options(llm))
