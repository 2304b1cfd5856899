"""Data-parallel sharding with a resumable cursor that survives a change of DP size."""

from d9d.data.sharding.layout import ShardingMode, ShardLayout, UnevenPolicy
from d9d.data.sharding.ranges import IndexRanges
from d9d.data.sharding.sharded import ReshardPolicy, ShardedDataset

__all__ = ["IndexRanges", "ReshardPolicy", "ShardLayout", "ShardedDataset", "ShardingMode", "UnevenPolicy"]
