"""Choosing the expert-parallel communication backend."""

from __future__ import annotations

import functools
import logging
from typing import Annotated, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, model_validator

from d9d.modules.moe.communication import MoECommunication
from d9d.parallel.expert.all_to_all import AllToAllMoECommunication
from d9d.parallel.expert.capacity import ExchangeCapacity
from d9d.parallel.expert.deepep import INTRANODE_GROUP_SIZES, DeepEPMoECommunication, deep_ep_available

_log = logging.getLogger(__name__)


class AllToAllBackendConfig(BaseModel):
    """`all_to_all_single` over torch.distributed: any device, any dtype, gloo or NCCL.

    `dedup` (default False): one row per (token, expert) copy both ways. True: a token travels once to
    each rank hosting at least one of its experts, and each rank returns one weighted partial sum per
    (token, rank): ≈ 2.2× fewer bytes than one row per copy at 64 experts top-8 over 4 ranks, ≈ 4× over 2,
    but more index work. Measured slower at FSDP 4 × EP 4 (0.83× on 4 × H100, 0.92× on 4 × H200,
    docs/parallelism.md) when rows, weights and ids were three all-to-alls, and with them in one message
    at FSDP 2 × EP 2 (0.94× on 2 × H200: the step waits for the host's index work, not for NVLink). The
    copy exchange's combine rounds a token's sum once in the activation dtype, the deduplicated one once
    per rank's partial as well."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["all_to_all"] = "all_to_all"
    dedup: bool = False
    #: None: every dispatch reads its split sizes to the host (exact, one host sync per MoE layer). A
    #: number: after the first step rank s sends rank d of each layer a static `capacity_factor` × the
    #: copies that pair had that step, no host sync; an overflow is detected and the step rerun with a
    #: larger capacity by the engine (capacity.py). Only for the copy exchange, and only where the overflow
    #: flag is read (the engine's training step). Calibrated, the exchange is traced into the compiled
    #: block (one graph per layer; the blocks compile again at the second step, ~60 s on the benchmark's
    #: MoE). Measured 0.98x / 0.90x the reading exchange at FSDP 2 x EP 2 (docs/parallelism.md).
    capacity_factor: float | None = Field(None, ge=1.0)
    #: The capacity's rows per (source, destination) pair are a multiple of this.
    capacity_align: int = Field(64, ge=1)
    #: After an overflow a pair's capacity grows to at least this × its rows (and to `capacity_factor` ×
    #: the load that overflowed it); the pairs that did not overflow get `capacity_factor` × their load of
    #: that step where it exceeds their rows.
    capacity_growth: float = Field(1.5, ge=1.0)
    #: Every this many steps each pair's capacity is set to `capacity_factor` × its largest load of those
    #: steps (one host read and gather of the loads): it shrinks as the routing balances. None: it only
    #: grows.
    capacity_recalibrate_every: int | None = Field(100, ge=1)
    #: 1: dispatch, experts, combine, one after the other. C > 1: each MoE layer's tokens in C chunks whose
    #: transfers overlap the other chunks' expert compute, in forward and backward (one host read of the
    #: split sizes per layer still; only the first chunk's dispatch and the last one's combine are exposed).
    #: The experts then run eagerly inside a compiled block. Copy exchange that reads its split sizes only.
    #: Measured 0.84x the sequential exchange at FSDP 2 x EP 2 on 2 x H200, where the host's work on the
    #: exchange bounds the step and the chunks add to it (docs/parallelism.md).
    overlap_chunks: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _capacity_needs_copies(self) -> AllToAllBackendConfig:
        if self.capacity_factor is not None and self.dedup:
            raise ValueError("capacity_factor is implemented for the copy exchange only: set dedup: false")
        if self.overlap_chunks > 1 and (self.dedup or self.capacity_factor is not None):
            raise ValueError(
                f"overlap_chunks={self.overlap_chunks} is implemented for the copy exchange that reads its "
                "split sizes: set dedup: false and capacity_factor: null, or overlap_chunks: 1"
            )
        return self


class DeepEPBackendConfig(BaseModel):
    """DeepEP's intranode kernels: CUDA, bf16 activations, an expert-parallel group of 2, 4 or 8 ranks,
    `deep_ep` installed (built from source: deploy/device/build_deep_ep.sh, docs/parallelism.md; checked
    against the all-to-all exchange on 2 × H200 and timed on 4, docs/benchmarks.md).

    `num_sms`: SMs DeepEP's kernels use (even; None keeps DeepEP's default, 20)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["deep_ep"] = "deep_ep"
    num_sms: int | None = Field(None, gt=0, multiple_of=2)


class AutoBackendConfig(BaseModel):
    """The all-to-all exchange (its defaults), by measurement: DeepEP ran at 0.84x the copy all-to-all on
    4 x H200 (FSDP 4 x EP 4, docs/benchmarks.md; its wrapper has been rewritten since, not yet timed), so
    `auto` leaves it to an explicit `kind: deep_ep` and says so where it could have run."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["auto"] = "auto"


ExpertCommunicationConfig = Annotated[
    AllToAllBackendConfig | DeepEPBackendConfig | AutoBackendConfig, Field(discriminator="kind")
]


def build_moe_communication(
    config: ExpertCommunicationConfig,
    group: dist.ProcessGroup,
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> MoECommunication:
    """The handler for experts sharded over `group`. `device` / `dtype` are those the activations will have
    when the layer runs (the caller's device, not the parameters', which may still be on `meta`)."""
    match config:
        case AllToAllBackendConfig(dedup=dedup, capacity_factor=factor, overlap_chunks=chunks) as c:
            capacity = (
                None
                if factor is None
                else ExchangeCapacity(
                    factor,
                    rank=dist.get_rank(group),
                    peers=dist.get_world_size(group),
                    align=c.capacity_align,
                    growth=c.capacity_growth,
                    recalibrate_every=c.capacity_recalibrate_every,
                )
            )
            return AllToAllMoECommunication(group, dedup=dedup, capacity=capacity, overlap_chunks=chunks)
        case DeepEPBackendConfig(num_sms=num_sms):
            problem = _deep_ep_problem(group, device, dtype)
            if problem is not None:
                raise RuntimeError(
                    f"expert-parallel backend 'deep_ep' was requested but {problem}; choose "
                    "kind='all_to_all' or 'auto'"
                )
            return DeepEPMoECommunication(group, num_sms=num_sms)
        case AutoBackendConfig():
            if _deep_ep_problem(group, device, dtype) is None:
                _log_deep_ep_not_chosen()
            return AllToAllMoECommunication(group)


def _deep_ep_problem(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why DeepEP cannot run for this group and these activations, or None when it can."""
    if not deep_ep_available():
        return "the deep_ep package cannot be imported (build it from source, docs/deploy.md; needs CUDA)"
    if device.type != "cuda":
        return f"it needs CUDA activations, got device {device}"
    if dtype != torch.bfloat16:
        return f"it needs bfloat16 activations, got {dtype}"
    size = dist.get_world_size(group)
    if size not in INTRANODE_GROUP_SIZES:
        return f"its intranode kernels serve groups of {INTRANODE_GROUP_SIZES} ranks, got {size}"
    return None


@functools.cache
def _log_deep_ep_not_chosen() -> None:
    """Once per process, not once per MoE layer."""
    _log.info(
        "expert-parallel backend 'auto' chose all_to_all; deep_ep is installed and could run here, but it "
        "measured slower (docs/parallelism.md): set expert_backend.kind: deep_ep to use it"
    )
