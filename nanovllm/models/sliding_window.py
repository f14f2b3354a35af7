"""Which attention layers of an HF config attend through a sliding window, and how wide it is.

Mistral sets ``sliding_window`` for every layer. Qwen2-style configs (Qwen2, Qwen3, ...) list
``layer_types`` per layer ("sliding_attention" or "full_attention"; transformers derives them from
``use_sliding_window`` and ``max_window_layers``), and their ``sliding_window`` is None when
``use_sliding_window`` is off. A query at position ``p`` of a windowed layer attends to the keys at
positions ``p - W + 1 .. p`` (transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - W``).
"""


def layer_sliding_windows(hf_config, max_model_len: int) -> list[int | None]:
    """The sliding window (tokens) of each decoder layer, None for full causal attention.

    A window of at least ``max_model_len`` tokens hides nothing any query can see, so it is None
    (the layer then runs the full-attention path).

    Raises:
        ValueError: ``sliding_window`` not an int >= 1, or ``layer_types`` not one entry per layer.
    """
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    if window is None:
        return [None] * num_layers
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be an int >= 1 or None, got {window!r}")
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        types = ["sliding_attention"] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={num_layers}")
    windowed = window if window < max_model_len else None
    return [windowed if kind == "sliding_attention" else None for kind in types]
