"""Optional adapters to other tools, imported only when used: ``nanovllm.integrations.lm_eval``
(an lm-evaluation-harness backend, needs the ``lm-eval`` extra). Importing this package imports
none of them."""
