"""Trainable-only checkpoints: keep what training changed (trainable parameters, buffers, optimizer
state), re-load the frozen base weights from the source checkpoint, and resume exactly.

`_TrainableOnlyState` is the engine's DCP state (`d9d.engine.checkpoint._ModelAndOptimizerState`) with the
`checkpointing.trainable_only` change proposed for it: the model state goes through
`d9d.peft.trainable_state_dict` and is loaded non-strictly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful

import d9d.models as dm
from d9d.modules.moe import TopKRouter
from d9d.peft import (
    FullTuneConfig,
    LoRAConfig,
    StackConfig,
    build_peft_method,
    frozen_parameter_names,
    inject_and_freeze,
    reset_adapters,
    trainable_state_dict,
)

OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
CONFIG = dm.Qwen3MoEConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    expert_bias=True,  # a buffer that training changes: it must be in the checkpoint although not trained
    expert_bias_update_rate=0.05,
    grouped_mm="eager",
    attention_backend="eager",
)
METHOD = StackConfig(
    methods=[
        LoRAConfig(target_modules=r".*\.experts\.(up_proj|down_proj)|.*\.q_proj", rank=2, dropout=0.1),
        FullTuneConfig(target_modules=r"model\.norm"),
    ]
)


class _TrainableOnlyState(Stateful):
    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module = module
        self.optimizer = optimizer

    def _model_state(self) -> dict[str, Any]:
        return trainable_state_dict(self.module, get_model_state_dict(self.module))

    def state_dict(self) -> dict[str, Any]:
        optim = get_optimizer_state_dict(self.module, self.optimizer, options=OPTIM)
        return {"model": self._model_state(), "optim": optim}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        own = {k: state_dict["model"][k] for k in self._model_state()}
        set_model_state_dict(self.module, own, options=StateDictOptions(strict=False))
        set_optimizer_state_dict(self.module, self.optimizer, state_dict["optim"], options=OPTIM)


def _build(source: Path, adapter_seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = dm.from_pretrained(
        source, config_overrides={"expert_bias": True, "expert_bias_update_rate": 0.05}
    )
    inject_and_freeze(model, build_peft_method(METHOD))
    torch.manual_seed(adapter_seed)
    reset_adapters(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    return model.train(), optimizer


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    torch.manual_seed(100 + step)  # LoRA dropout draws from the global generator
    ids = torch.randint(0, CONFIG.vocab_size, (4, 10), generator=torch.Generator().manual_seed(step))
    loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:])["loss"].mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    for router in (m for m in model.modules() if isinstance(m, TopKRouter)):
        router.update_expert_bias()
    return float(loss.detach())


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_trainable_only_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    dm.save_pretrained(
        dm.Qwen3MoEForCausalLM(CONFIG.model_copy(update={"expert_bias": False})), tmp_path / "base"
    )

    model, optimizer = _build(tmp_path / "base", adapter_seed=1)
    for step in range(3):
        _step(model, optimizer, step)
    saved = _snapshot(model)
    dcp_save({"app": _TrainableOnlyState(model, optimizer)}, checkpoint_id=str(tmp_path / "ckpt"))
    loss = _step(model, optimizer, 3)
    after = _snapshot(model)

    frozen = frozen_parameter_names(model)
    kept = trainable_state_dict(model)
    assert "model.layers.0.self_attn.k_proj.weight" in frozen and not frozen & kept.keys()
    assert {"model.norm.weight", "model.layers.1.mlp.experts.up_proj_lora_B"} <= kept.keys()
    assert "model.layers.0.mlp.gate.expert_bias" in kept  # a buffer: kept although nothing trains it
    assert saved["model.layers.0.mlp.gate.expert_bias"].abs().max() > 0  # ...and training moved it
    assert sum(v.numel() for v in kept.values()) < 0.2 * sum(v.numel() for v in saved.values())
    on_disk = FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    assert {k.removeprefix("app.model.") for k in on_disk if k.startswith("app.model.")} == kept.keys()

    # A fresh process: base weights from the source checkpoint, adapters from another seed, new optimizer.
    resumed, resumed_optimizer = _build(tmp_path / "base", adapter_seed=2)
    assert not torch.equal(resumed.state_dict()["model.norm.weight"], saved["model.norm.weight"])
    dcp_load({"app": _TrainableOnlyState(resumed, resumed_optimizer)}, checkpoint_id=str(tmp_path / "ckpt"))
    restored = _snapshot(resumed)
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[k], saved[k]) for k in saved)
    assert _step(resumed, resumed_optimizer, 3) == loss
    assert all(torch.equal(resumed.state_dict()[k], after[k]) for k in after)
