"""Token embeddings."""

from d9d.modules.embedding.token_embedding import TokenEmbedding, check_vocab_splits

__all__ = ["TokenEmbedding", "check_vocab_splits"]
