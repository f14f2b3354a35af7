"""Scripts written for vLLM run with only the import line changed: vLLM's LLM arguments at their
defaults (and no-op values) are accepted, values asking for what nanovllm lacks are refused by
name; vLLM's missing pieces (metrics, reset_prefix_cache, default sampling params, model_config,
detokenize, truncate_prompt_tokens, allowed_token_ids, bad_words, logit_bias, lora_request /
priority, OpenAI content parts, continue_final_message); and the six bad inputs a new user found,
each refused clearly with the engine serving a normal request afterwards (CPU, tiny checkpoints)."""
import dataclasses
import json
import os
import shutil

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.config import check_engine_args
from nanovllm.vllm_compat import VLLM_ARGS

from _util import build_llm, greedy, random_prompt

MAX_MODEL_LEN = 1024
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")

# vLLM's EngineArgs defaults of the arguments nanovllm has no Config field for (vllm/engine/arg_utils.py)
VLLM_DEFAULTS = dict(
    runner="auto", convert="auto", task=None, tokenizer_mode="auto", skip_tokenizer_init=False,
    allowed_local_media_path="", allowed_media_domains=None, served_model_name=None, hf_config_path=None,
    code_revision=None, config_format="auto", enable_prompt_embeds=False, load_format="auto",
    safetensors_load_strategy="lazy", model_loader_extra_config={}, ignore_patterns=None, use_tqdm_on_load=True,
    pt_load_map_location="cpu", quantization=None, hf_token=None, hf_overrides={}, rope_scaling={}, rope_theta=None,
    model_impl="auto", override_attention_dtype=None, logprobs_mode="raw_logprobs",
    generation_config="auto", override_generation_config={}, logits_processor_pattern=None, logits_processors=None,
    io_processor_plugin=None, pooler_config=None, override_pooler_config=None, disable_sliding_window=False,
    disable_cascade_attn=False, enable_sleep_mode=False, enable_return_routed_experts=False, reasoning_parser="",
    distributed_executor_backend=None, pipeline_parallel_size=1, decode_context_parallel_size=1,
    data_parallel_rank=None, data_parallel_start_rank=None, data_parallel_size_local=None,
    data_parallel_address=None, data_parallel_rpc_port=None, data_parallel_hybrid_lb=False,
    data_parallel_backend="mp", enable_expert_parallel=False, all2all_backend=None, enable_dbo=False,
    dbo_decode_token_threshold=32, dbo_prefill_token_threshold=512, disable_nccl_for_dp_synchronization=False,
    eplb_config=None, enable_eplb=False, expert_placement_strategy="linear", num_redundant_experts=0,
    eplb_window_size=1000, eplb_step_interval=3000, eplb_log_balancedness=False, max_parallel_loading_workers=None,
    disable_custom_all_reduce=False, ray_workers_use_nsight=False, worker_cls="auto", worker_extension_cls="",
    block_size=None, kv_cache_memory_bytes=None, num_gpu_blocks_override=None, swap_space=4,
    cpu_offload_gb=0, prefix_caching_hash_algo="sha256", calculate_kv_scales=False, mamba_cache_dtype="auto",
    mamba_ssm_cache_dtype="auto", mamba_block_size=None, kv_sharing_fast_prefill=False, kv_transfer_config=None,
    kv_events_config=None, enable_chunked_prefill=None, max_num_partial_prefills=1, max_long_partial_prefills=1,
    long_prefill_token_threshold=0, num_lookahead_slots=0, disable_chunked_mm_input=False,
    disable_hybrid_kv_cache_manager=False, scheduling_policy="fcfs", scheduler_cls=None, cuda_graph_sizes=None,
    cudagraph_capture_sizes=None, max_cudagraph_capture_size=None, max_seq_len_to_capture=8192,
    compilation_config=None, attention_config=None, structured_outputs_config=None, profiler_config=None,
    speculative_config=None, guided_decoding_backend=None, guided_decoding_disable_fallback=None,
    guided_decoding_disable_any_whitespace=None, guided_decoding_disable_additional_properties=None,
    additional_config={}, disable_async_output_proc=False, disable_log_stats=True, aggregate_engine_logging=False,
    show_hidden_metrics_for_version=None, otlp_traces_endpoint=None, collect_detailed_traces=None,
    limit_mm_per_prompt={}, enable_mm_embeds=False, interleave_mm_strings=False, media_io_kwargs={},
    mm_processor_kwargs=None, disable_mm_preprocessor_cache=False, mm_processor_cache_gb=4,
    mm_processor_cache_type="lru", mm_shm_cache_max_object_size_mb=128, mm_encoder_tp_mode="weights",
    mm_encoder_attn_backend=None, skip_mm_profiling=False, video_pruning_rate=None,
    enable_multimodal_encoder_data_parallel=False, enable_lora=False, max_loras=1, max_lora_rank=16,
    default_mm_loras=None, fully_sharded_loras=False, max_cpu_loras=None, lora_dtype="auto", lora_extra_vocab_size=256,
)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=16)
    yield engine
    engine.shutdown()


def _serves(llm):
    out = llm.generate([random_prompt(12, seed=7)], greedy(3), use_tqdm=False)[0]
    assert out.finished and len(out.outputs[0].token_ids) == 3


# ---- vLLM's arguments ----------------------------------------------------------------------

def test_every_vllm_default_is_accepted():
    assert set(VLLM_DEFAULTS) == set(VLLM_ARGS)
    assert check_engine_args(dict(VLLM_DEFAULTS)) == {}


def test_vllm_defaults_of_config_fields_mean_the_engines(qwen3_dir):
    with build_llm(qwen3_dir, max_model_len=None, max_num_seqs=None, max_num_batched_tokens=None, seed=None,
                   enable_prefix_caching=None, kv_cache_dtype="auto", max_logprobs=20, **VLLM_DEFAULTS) as llm:
        config = llm.config
        assert (config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens, config.seed,
                config.enable_prefix_caching) == (4096, 512, 16384, 0, True)  # None max_model_len: the model's
        assert config.kv_storage_dtype == config.dtype, "vLLM's kv_cache_dtype='auto': the model's dtype"
        assert llm.llm_engine.model_config.max_model_len == 4096
        assert llm.llm_engine.model_config.max_logprobs == 20
        _serves(llm)


def test_max_logprobs_limits_requests_as_vllm_does(llm, qwen3_dir):
    """vLLM's max_logprobs (default 20) refuses a request for more top-k logprobs; -1 lifts it."""
    prompt = random_prompt(12, seed=7)
    for field, k, asked in (("logprobs", 21, 21), ("prompt_logprobs", 50, 50), ("logprobs", -1, None)):
        with pytest.raises(ValueError, match=rf"sampling_params: {field}={k} asks for {asked or ''}.*max_logprobs=20"):
            llm.generate([prompt], SamplingParams(max_tokens=2, **{field: k}), use_tqdm=False)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, logprobs=20), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) >= 20
    with pytest.raises(ValueError, match=r"max_logprobs must be >= -1, got -2"):
        build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=16, max_logprobs=-2)
    with build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=16, max_logprobs=-1) as unlimited:
        out = unlimited.generate([prompt], SamplingParams(temperature=0, max_tokens=2, logprobs=50), use_tqdm=False)[0]
        assert len(out.outputs[0].logprobs[0]) >= 50


@pytest.mark.parametrize("name, value, shown", [
    ("quantization", "awq", "quantized weights are not supported"),
    ("enable_lora", True, "no LoRA adapters"),
    ("pipeline_parallel_size", 2, "tensor_parallel_size and data_parallel_size"),
    ("enable_chunked_prefill", False, "chunked prefill is always on"),
    ("cpu_offload_gb", 4, "enable_cpu_offload=True"),
    ("distributed_executor_backend", "ray", "Ray is not supported"),
    ("logprobs_mode", "processed_logprobs", "raw distribution"),
    ("speculative_config", {"method": "ngram"}, "no speculative decoding"),
])
def test_vllm_values_asking_for_missing_behaviour_are_refused(name, value, shown):
    with pytest.raises(ValueError, match=rf"^{name}={value!r:.20}.*{shown}.*\(accepted values: "):
        check_engine_args({name: value})


# ---- scripts with the import line changed ---------------------------------------------------

def test_vllm_offline_quickstart(qwen3_dir):
    """The shape of vLLM's offline quickstart: a list of prompts, SamplingParams(temperature, top_p),
    LLM(model=...) with every other argument at its default, then print each output."""
    prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
               "The future of AI is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    llm = LLM(model=qwen3_dir)
    try:
        outputs = llm.generate(prompts, sampling_params)
        for output in outputs:
            prompt, generated_text = output.prompt, output.outputs[0].text
            assert isinstance(generated_text, str) and prompt in prompts
        assert [o.prompt for o in outputs] == prompts
    finally:
        llm.shutdown()


def test_lm_eval_vllm_backend_arguments(qwen3_dir):
    """lm-eval 0.4.13's VLLM backend: LLM(**model_args) with its dictionary of defaults, then
    model_config.max_model_len, prompt logprobs with detokenize=False and lora_request=None."""
    model_args = {"model": qwen3_dir, "revision": None, "dtype": "auto", "tokenizer": None, "tokenizer_mode": "auto",
                  "tokenizer_revision": None, "trust_remote_code": False, "tensor_parallel_size": 1,
                  "max_model_len": None, "max_num_seqs": None, "quantization": None, "seed": 1234,
                  "enable_lora": False, "max_lora_rank": 16}
    llm = LLM(**model_args)
    try:
        assert llm.llm_engine.model_config.max_model_len == 4096
        requests = [random_prompt(9, seed=1), random_prompt(5, seed=2)]
        outs = llm.generate([{"prompt_token_ids": r} for r in requests],
                            sampling_params=SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1,
                                                           detokenize=False),
                            use_tqdm=False, lora_request=None)
        for request, out in zip(requests, outs):
            assert out.prompt_logprobs[0] is None and out.outputs[0].text == ""
            total = sum(d[t].logprob for t, d in zip(request[1:], out.prompt_logprobs[1:]))
            assert total < 0 and all(getattr(lp, "decoded_token") is None
                                     for d in out.prompt_logprobs[1:] for lp in d.values())
        gen = llm.generate([{"prompt_token_ids": requests[0]}],
                           [SamplingParams(max_tokens=4, stop=["\n\n"], skip_special_tokens=False,
                                           spaces_between_special_tokens=False, temperature=0.0)],
                           use_tqdm=False, lora_request=None)
        assert len(gen[0].outputs[0].token_ids) <= 4
    finally:
        llm.shutdown()


def test_trl_style_rollout(llm):
    """TRL's vLLM rollout: n completions per prompt with logprobs of the sampled tokens and a seed,
    token ids and logprobs read per completion; the same seed samples the same tokens."""
    prompts = [random_prompt(10, seed=3), random_prompt(14, seed=4)]
    sp = SamplingParams(n=4, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, max_tokens=6,
                        logprobs=0, seed=17)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params=sp, use_tqdm=False,
                        lora_request=None)
    completion_ids = [list(c.token_ids) for o in outs for c in o.outputs]
    logprobs = [[next(iter(lp.values())).logprob for lp in c.logprobs] for o in outs for c in o.outputs]
    assert len(completion_ids) == 8 and all(len(ids) == 6 for ids in completion_ids)
    assert all(len(lp) == 6 and all(x <= 0 for x in lp) for lp in logprobs)
    assert [o.prompt_token_ids for o in outs] == prompts
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params=sp, use_tqdm=False)
    assert [list(c.token_ids) for o in again for c in o.outputs] == completion_ids
    assert llm.reset_prefix_cache() is True


# ---- the missing pieces ---------------------------------------------------------------------

def test_request_metrics(llm):
    out = llm.generate([random_prompt(20, seed=5)], greedy(4, n=2), use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)


def test_reset_prefix_cache(llm):
    prompt = random_prompt(600, seed=6)
    llm.generate([prompt], greedy(1), use_tqdm=False)
    assert llm.generate([prompt], greedy(1), use_tqdm=False)[0].num_cached_tokens == 512
    assert llm.reset_prefix_cache() is True
    assert llm.generate([prompt], greedy(1), use_tqdm=False)[0].num_cached_tokens == 0


def test_model_config_is_read_only(llm):
    assert llm.llm_engine is llm and llm.llm_engine.model_config.max_model_len == MAX_MODEL_LEN
    assert llm.llm_engine.tokenizer is llm.get_tokenizer()
    with pytest.raises(dataclasses.FrozenInstanceError):
        llm.llm_engine.model_config.max_model_len = 5


def test_default_sampling_params_from_generation_config(qwen3_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(qwen3_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.6, "top_k": 20,
                                                              "max_new_tokens": 7}))
    with build_llm(str(model), max_model_len=MAX_MODEL_LEN) as llm:
        sp = llm.get_default_sampling_params()
        assert (sp.temperature, sp.top_k, sp.max_tokens, sp.top_p) == (0.6, 20, 7, 1.0)
        assert len(llm.generate([random_prompt(5, seed=8)], use_tqdm=False)[0].outputs[0].token_ids) <= 7
    with build_llm(str(model), max_model_len=MAX_MODEL_LEN, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_detokenize_false_keeps_ids_and_logprobs(llm):
    prompt = random_prompt(16, seed=9)
    on = llm.generate([prompt], greedy(5, logprobs=2), use_tqdm=False)[0].outputs[0]
    off = llm.generate([prompt], greedy(5, logprobs=2, detokenize=False), use_tqdm=False)[0].outputs[0]
    assert off.text == "" and on.text != "" and off.token_ids == on.token_ids
    assert [{t: lp.logprob for t, lp in d.items()} for d in off.logprobs] == \
           [{t: lp.logprob for t, lp in d.items()} for d in on.logprobs]
    with pytest.raises(ValueError, match="need detokenize=True"):
        SamplingParams(detokenize=False, stop=["x"])


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    prompt = random_prompt(40, seed=10)
    cut = llm.generate([prompt], greedy(4, truncate_prompt_tokens=8), use_tqdm=False)[0]
    ref = llm.generate([prompt[-8:]], greedy(4), use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-8:] and cut.outputs[0].token_ids == ref.outputs[0].token_ids
    with pytest.raises(ValueError, match=rf"truncate_prompt_tokens=2000 is more than max_model_len={MAX_MODEL_LEN}"):
        llm.generate([prompt], greedy(1, truncate_prompt_tokens=2000), use_tqdm=False)
    _serves(llm)


def test_allowed_token_ids_logit_bias_and_bad_words(llm):
    prompt = random_prompt(16, seed=11)
    plain = llm.generate([prompt], greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    allowed = [50, 60, 70]
    outs = llm.generate([prompt, prompt, prompt, prompt], [
        greedy(6, allowed_token_ids=allowed), greedy(6, logit_bias={99: 1e4}),
        greedy(6, bad_words_token_ids=[[plain[1], plain[2]]]), greedy(6)], use_tqdm=False)
    masked, biased, bad, untouched = (o.outputs[0].token_ids for o in outs)
    assert set(masked) <= set(allowed)
    assert biased == [99] * 6
    assert bad[:2] == plain[:2] and bad[2] != plain[2]  # the two-token word is cut at its last token
    assert untouched == plain  # rows without masks in the same batch are unchanged
    word = llm.get_tokenizer().decode([plain[0]])
    ids = llm._checks.bad_words_token_ids([word])
    if [plain[0]] in ids:
        first = llm.generate([prompt], greedy(3, bad_words=[word]), use_tqdm=False)[0].outputs[0].token_ids
        assert plain[0] not in first
    with pytest.raises(ValueError, match="allowed_token_ids has token id 99999, outside the vocabulary"):
        llm.generate([prompt], greedy(1, allowed_token_ids=[99999]), use_tqdm=False)
    with pytest.raises(ValueError, match="bad_words_token_ids has token id 99999, outside the vocabulary"):
        llm.generate([prompt], greedy(1, bad_words_token_ids=[[3, 99999]]), use_tqdm=False)
    # given ids and bad_words together: both are banned (the words' sequences are added)
    queued = llm._checks.params(greedy(1, bad_words_token_ids=[[plain[0]]], bad_words=["xyz"]), "p")
    assert queued.bad_words_token_ids[0] == [plain[0]] and queued.bad_words_token_ids[1:] == [
        ids for ids in llm._checks.bad_words_token_ids(["xyz"]) if ids != [plain[0]]]
    _serves(llm)


def test_masks_that_leave_no_token_raise(llm):
    """A request whose masks ban every token it may sample is refused when queued if its first
    token has none, and raises when a longer bad word's ban leaves none later; the engine serves on."""
    prompt = random_prompt(16, seed=12)
    with pytest.raises(ValueError, match=r"sampling_params: every token of allowed_token_ids \[50\] is banned"):
        llm.generate([prompt], greedy(3, allowed_token_ids=[50], bad_words_token_ids=[[50]]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"allowed_token_ids \[50\] is banned .*min_tokens=2"):
        llm.generate([prompt], greedy(3, allowed_token_ids=[50], stop_token_ids=[50], min_tokens=2), use_tqdm=False)
    # the same masks with a token left are served
    out = llm.generate([prompt], greedy(3, allowed_token_ids=[50, 60], bad_words_token_ids=[[60]]), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [50, 50, 50]
    # 60 is always banned; after one 50 the word [50, 50] bans 50 too
    with pytest.raises(RuntimeError, match=r"after 1 generated tokens \[50\]: every token of allowed_token_ids "
                                           r"\[50, 60\] is banned"):
        llm.generate([prompt, random_prompt(8, seed=13)],
                     [greedy(3, allowed_token_ids=[50, 60], bad_words_token_ids=[[60], [50, 50]]), greedy(3)],
                     use_tqdm=False)
    _serves(llm)


def test_logits_beyond_float32_are_sampled_not_nan(llm):
    """Biases, penalties and small temperatures that overflow float32 sample the dominant tokens
    (a NaN row would give token 0)."""
    prompt = random_prompt(16, seed=14)
    for params in (SamplingParams(temperature=1.0, seed=0, max_tokens=3, logit_bias={99: 1e39}),
                   SamplingParams(temperature=1e-4, seed=0, max_tokens=3, logit_bias={99: 1e35}),
                   SamplingParams(temperature=1e-4, seed=0, max_tokens=3, logit_bias={99: 3e38},
                                  repetition_penalty=1e-38)):
        out = llm.generate([prompt + [99]], params, use_tqdm=False)[0].outputs[0].token_ids
        assert out == [99, 99, 99], (params, out)
    seen = llm.generate([prompt], SamplingParams(temperature=0.5, seed=0, max_tokens=4, repetition_penalty=1e-38),
                        use_tqdm=False)[0].outputs[0].token_ids
    # seen tokens with a positive logit are divided up to float32's largest value; the others are left far below
    assert all(t in set(prompt) | set(seen[:i]) for i, t in enumerate(seen)), seen


def test_unused_masks_cost_nothing(llm):
    from nanovllm.engine.sampling_batch import sampling_tensors
    from nanovllm.sequence import Sequence

    seqs = [Sequence([5, 6, 7], SamplingParams(temperature=0.0), 256) for _ in range(3)]
    tensors = sampling_tensors(seqs, torch.device("cpu"), [2], None, 2048)
    assert tensors.allowed is None and tensors.bias is None and tensors.banned is None


def test_lora_request_and_priority(llm):
    prompts = [random_prompt(6, seed=12), random_prompt(7, seed=13)]
    outs = llm.generate(prompts, greedy(2), use_tqdm=False, lora_request=[None, None], priority=[0, 1])
    assert all(o.finished for o in outs)
    with pytest.raises(ValueError, match="lora_request=.* is not supported: nanovllm runs no LoRA adapters"):
        llm.generate(prompts, greedy(2), use_tqdm=False, lora_request=object())
    with pytest.raises(ValueError, match="priority must be None or a list of 2 int"):
        llm.generate(prompts, greedy(2), use_tqdm=False, priority=[1])
    _serves(llm)


def test_chat_openai_parts_and_continue_final_message(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "abc"}, {"type": "text", "text": "def"}]}]
    plain = [{"role": "user", "content": "abc\ndef"}]
    a = llm.chat(parts, greedy(3), chat_template=TEMPLATE, use_tqdm=False)[0]
    b = llm.chat(plain, greedy(3), chat_template=TEMPLATE, use_tqdm=False)[0]
    assert a.prompt == b.prompt and a.outputs[0].token_ids == b.outputs[0].token_ids
    cont = llm.chat(plain + [{"role": "assistant", "content": "ghi"}], greedy(3), chat_template=TEMPLATE,
                    add_generation_prompt=False, continue_final_message=True, use_tqdm=False)[0]
    assert cont.prompt.endswith("assistant: ghi")
    with pytest.raises(ValueError, match="continue_final_message=True .* needs add_generation_prompt=False"):
        llm.chat(plain, greedy(3), chat_template=TEMPLATE, continue_final_message=True)
    with pytest.raises(ValueError, match=r"message 0, part 0: only text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], greedy(2),
                 chat_template=TEMPLATE)
    _serves(llm)


# ---- the six bad inputs ---------------------------------------------------------------------

def test_lone_surrogate_in_a_prompt_or_a_chat_message(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\] is not valid Unicode: '\\ud800' \(a lone surrogate\) at "
                                         r"character 3"):
        llm.generate(["fine", "abc\ud800"], greedy(2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"conversation 0, message 1 is not valid Unicode"):
        llm.chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b\udc80"}], greedy(2),
                 chat_template=TEMPLATE)
    assert llm.is_finished()
    _serves(llm)


@pytest.mark.parametrize("name", ["add_generation_prompt", "continue_final_message"])
def test_chat_switch_must_be_a_bool(llm, name):
    with pytest.raises(ValueError, match=rf"{name} must be True or False, got 'no'"):
        llm.chat([{"role": "user", "content": "a"}], greedy(2), chat_template=TEMPLATE, **{name: "no"})
    _serves(llm)


def test_tokenizer_directory_missing(qwen3_dir, tmp_path, llm):
    missing = str(tmp_path / "no-such-tokenizer")
    with pytest.raises(ValueError, match=rf"tokenizer directory '{missing}' does not exist"):
        build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, tokenizer=missing)
    _serves(llm)


@pytest.mark.parametrize("edit, shown", [
    (lambda cfg: {k: v for k, v in cfg.items() if k != "hidden_size"}, r"config\.json has no 'hidden_size'"),
    ("{bad json", r"config\.json is not valid JSON: .* at line 1, column 2"),
    ("[1, 2]", r"config\.json must hold a JSON object, got list"),
])
def test_broken_config_json(qwen3_dir, tmp_path, llm, edit, shown):
    model = tmp_path / "model"
    shutil.copytree(qwen3_dir, model)
    path = model / "config.json"
    path.write_text(edit if isinstance(edit, str) else json.dumps(edit(json.loads(path.read_text()))))
    with pytest.raises(ValueError, match=shown):
        build_llm(str(model), max_model_len=MAX_MODEL_LEN)
    _serves(llm)


@pytest.mark.parametrize("what", ["model", "tokenizer"])
def test_model_or_tokenizer_path_that_is_a_file(qwen3_dir, llm, what):
    path = os.path.join(qwen3_dir, "config.json")
    kwargs = {"tokenizer": path} if what == "tokenizer" else {}
    with pytest.raises(ValueError, match=rf"{what} '{path}' is a file; give the {what}'s directory"):
        build_llm(qwen3_dir if what == "tokenizer" else path, max_model_len=MAX_MODEL_LEN, **kwargs)
    _serves(llm)


@pytest.mark.parametrize("policy, option, value, reader", [
    ("FULL", "sparse_token_budget", 512, "'QUEST' or 'MOMENTS' or 'ORACLE'"),
    ("ORACLE", "sparse_radius_weight", 0.25, "'QUEST'"),
    ("FULL", "sparse_threshold", 0.5, "'XATTN_BSA'"),
    ("QUEST", "sparse_stride", 16, "'XATTN_BSA'"),
    ("XATTN_BSA", "sparse_page_size", 32, "'QUEST' or 'STREAMING' or 'MOMENTS' or 'ORACLE'"),
])
def test_sparse_option_of_another_policy(qwen3_dir, llm, policy, option, value, reader):
    with pytest.raises(ValueError, match=rf"{option}={value!r} is read by sparse_policy={reader} only, but "
                                         rf"sparse_policy='{policy}' does not use it"):
        build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, sparse_policy=policy, **{option: value})
    _serves(llm)
