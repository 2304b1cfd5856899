"""Length bucketing: similar-length neighbours without giving up the shuffle."""

from d9d.data.bucketing.buffer_sorted import BufferSortedDataset, token_count

__all__ = ["BufferSortedDataset", "token_count"]
