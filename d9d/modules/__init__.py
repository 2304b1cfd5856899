"""White-box building blocks for LLMs: norms, rotary embeddings, attention, MLPs, MoE, heads."""
