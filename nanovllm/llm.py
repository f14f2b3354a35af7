"""The user-facing entry point."""
from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """``LLM(model, revision=None, download_dir=None, **config)``: ``model`` is a local directory or
    a Hugging Face Hub id; see :class:`nanovllm.config.Config` for the options. vLLM's offline
    API: ``generate``, ``chat``, ``get_tokenizer``, ``get_default_sampling_params``,
    ``reset_prefix_cache``, ``llm_engine.model_config``, returning :class:`nanovllm.RequestOutput`;
    vLLM's other ``LLM`` arguments are taken at values that are a no-op here and refused with a
    ValueError otherwise (``nanovllm.vllm_compat``).

    Example::

        llm = LLM("path/to/model", max_model_len=4096)
        out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
        text = out[0].outputs[0].text  # vLLM style; nano-vLLM's out[0]["text"] reads the same

    Use it as a context manager, or call :meth:`shutdown` (also run when the object is collected and at exit), to
    release GPU memory so another ``LLM`` can be built in the same process.
    """

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's ``llm.llm_engine``): this object itself, so that
        ``llm.llm_engine.model_config.max_model_len`` and ``llm.llm_engine.tokenizer`` read as
        in vLLM."""
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
