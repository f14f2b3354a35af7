"""Evaluation and benchmark tools beside the engine (not installed with it): RULER, pass-key
retrieval, random-weight checkpoints of real architectures, logit divergence."""
