"""nanovllm: a compact offline LLM inference engine with CPU-offloaded KV and sparse attention."""
from nanovllm.inputs import PromptType, TextPrompt, TokensPrompt
from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics",
           "PromptType", "TextPrompt", "TokensPrompt"]
