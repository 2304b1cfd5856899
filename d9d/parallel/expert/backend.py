"""Choosing the expert-parallel communication backend."""

from __future__ import annotations

from typing import Annotated, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from d9d.modules.moe.communication import MoECommunication
from d9d.parallel.expert.all_to_all import AllToAllMoECommunication
from d9d.parallel.expert.deepep import DeepEPMoECommunication, deep_ep_available


class AllToAllBackendConfig(BaseModel):
    """`all_to_all_single` over torch.distributed: any device, any dtype, gloo or NCCL."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["all_to_all"] = "all_to_all"


class DeepEPBackendConfig(BaseModel):
    """DeepEP kernels: CUDA, bf16 activations, `deep_ep` installed (`pip install d9d[moe]`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["deep_ep"] = "deep_ep"
    num_sms: int | None = Field(None, gt=0, multiple_of=2)


class AutoBackendConfig(BaseModel):
    """DeepEP where it can run (CUDA, bf16, installed), all-to-all otherwise."""

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
    """The handler for experts sharded over `group`; `device`/`dtype` are those of the activations."""
    if isinstance(config, AllToAllBackendConfig):
        return AllToAllMoECommunication(group)
    if isinstance(config, DeepEPBackendConfig):
        if not deep_ep_available():
            raise RuntimeError(
                "expert-parallel backend 'deep_ep' was requested but the deep_ep package cannot be imported; "
                "install it (pip install 'd9d[moe]', needs CUDA) or choose kind='all_to_all' / 'auto'"
            )
        if device.type != "cuda":
            raise RuntimeError(
                f"expert-parallel backend 'deep_ep' needs CUDA activations, got device {device}"
            )
        if dtype != torch.bfloat16:
            raise RuntimeError(f"expert-parallel backend 'deep_ep' needs bfloat16 activations, got {dtype}")
        return DeepEPMoECommunication(group, num_sms=config.num_sms)
    if device.type == "cuda" and dtype == torch.bfloat16 and deep_ep_available():
        return DeepEPMoECommunication(group)
    return AllToAllMoECommunication(group)
