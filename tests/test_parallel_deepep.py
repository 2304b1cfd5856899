"""`DeepEPMoECommunication`'s calls into `deep_ep`, against a stand-in module with DeepEP's signatures.

The stand-in `Buffer`, `Config` and `EventOverlap` have the Python signatures (parameter names, order and
defaults) of DeepEP's normal intranode API at commit dd758caf451848bd150e1046af3d0a73e5fff38d (V2, 2.1.0:
`deep_ep/buffers/legacy.py`, `csrc/legacy/config.hpp`, `csrc/legacy/buffer.hpp`), which match V1's
`deep_ep/buffer.py` at its last commit 567632d for every call used here. Its methods check what the C++ side
asserts (dtypes, shapes, contiguity, `Config` SM counts against the handle's channel count, buffer sizes)
and return DeepEP's tuples: `get_dispatch_layout` 5, `dispatch` 6 (the cached-layout form with the top-k
entries None), `combine` 3. `Config`'s pybind methods take positional arguments only (no `py::arg` names).

To give numbers to compare, the stand-in plays rank 0 of a 2-rank group whose other rank holds no tokens:
rank 0 receives its own tokens that route to at least one of its experts (ids of the other rank's experts
become -1, their weights 0) and combine sums rows back per source token. The output is then exactly the
contribution of rank 0's experts, which a plain single-process computation gives.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.modules.moe.communication import RoutedTokens
from d9d.parallel.expert import (
    AllToAllMoECommunication,
    AutoBackendConfig,
    DeepEPBackendConfig,
    DeepEPMoECommunication,
    build_moe_communication,
    deep_ep_available,
)
from d9d.parallel.expert import deepep as deepep_module

NUM_RANKS = 2
GROUP = object()  # stands for the process group; the stand-in checks it is passed through
SIZES = {id(GROUP): NUM_RANKS}  # what `dist.get_world_size` answers for the stand-in groups


class _Config:
    """`deep_ep.Config` (csrc/legacy/config.hpp): five ints, positional."""

    def __init__(
        self,
        num_sms: int,
        num_max_nvl_chunked_send_tokens: int,
        num_max_nvl_chunked_recv_tokens: int,
        num_max_rdma_chunked_send_tokens: int,
        num_max_rdma_chunked_recv_tokens: int,
        /,
    ) -> None:
        assert num_sms % 2 == 0
        self.num_sms = num_sms
        self.nvl_recv_tokens = num_max_nvl_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, /) -> int:
        assert isinstance(hidden_bytes, int) and isinstance(num_ranks, int)
        # The shape of DeepEP's formula: per channel (two SMs) and rank, the queued rows plus metadata.
        per_token = hidden_bytes + 4 + 128 * (8 + 4 + 4)
        num_bytes = (self.num_sms // 2) * num_ranks * (self.nvl_recv_tokens * per_token + 5 * 4)
        return (num_bytes + 127) // 128 * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, /) -> int:
        # As in the intranode-only build (deploy/device/build_deep_ep.sh, no NVSHMEM), where this is a host
        # assert; with NVSHMEM it is 0 for at most 8 ranks. d9d must not ask (it passes 0 RDMA bytes).
        raise RuntimeError(
            "Failed: Assertion error csrc/config.hpp:102 'NVSHMEM is disable during compilation'"
        )


class _EventOverlap:
    def __init__(self, event: Any = None, extra_tensors: Any = None) -> None:
        self.event = event


class _Buffer:
    """`deep_ep.Buffer`, normal intranode mode, as rank 0 of 2 with an empty peer (module docstring)."""

    num_sms: int = 20
    topk_idx_t = torch.int64  # the module's `topk_idx_t`, set per test
    created: list[_Buffer]  # reset per test
    calls: list[tuple[str, dict[str, Any]]]

    def __init__(
        self,
        group: Any,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Any = None,
    ) -> None:
        assert group is GROUP
        assert num_nvl_bytes > 0 and num_nvl_bytes % 128 == 0  # LEGACY_NUM_BUFFER_ALIGNMENT_BYTES
        assert num_rdma_bytes == 0  # a host assert for groups of at most 8 ranks outside low-latency mode
        assert not low_latency_mode
        self.group, self.group_size = group, NUM_RANKS
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.explicitly_destroy, self.destroyed = explicitly_destroy, False
        _Buffer.created.append(self)

    def destroy(self) -> None:
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        assert not self.destroyed
        self.destroyed = True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        _Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> _Config:
        return {2: _Config(_Buffer.num_sms, 24, 256, 6, 128), 4: _Config(_Buffer.num_sms, 6, 256, 6, 128)}[
            num_ranks
        ]

    @staticmethod
    def get_combine_config(num_ranks: int) -> _Config:
        return {2: _Config(_Buffer.num_sms, 10, 256, 6, 128), 4: _Config(_Buffer.num_sms, 9, 256, 6, 128)}[
            num_ranks
        ]

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, _EventOverlap]:
        assert topk_idx.dim() == 2 and topk_idx.is_contiguous() and topk_idx.dtype == self.topk_idx_t
        assert num_experts > 0 and num_experts % NUM_RANKS == 0
        rank_of = torch.where(topk_idx >= 0, topk_idx // (num_experts // NUM_RANKS), -1)
        in_rank = torch.stack([(rank_of == r).any(1) for r in range(NUM_RANKS)], 1)
        per_rank = in_rank.sum(0).int()
        per_expert = torch.stack([(topk_idx == e).sum() for e in range(num_experts)]).int()
        return per_rank, None, per_expert, in_rank.contiguous(), _EventOverlap()

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: tuple[torch.Tensor, ...] | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: _Config | None = None,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Any, ...]:
        assert isinstance(x, torch.Tensor)
        assert x.dim() == 2 and x.is_contiguous() and x.dtype == torch.bfloat16
        assert (x.shape[1] * x.element_size()) % 16 == 0
        config = self.get_dispatch_config(self.group_size) if config is None else config
        assert isinstance(config, _Config)
        channels = config.num_sms // 2
        _Buffer.calls.append(("dispatch", {"cached": handle is not None, "config": config}))
        if handle is not None:  # cached layout: the backward of combine
            assert topk_idx is None and topk_weights is None
            _, channel_prefix, _, recv_src_idx, in_rank, _ = handle
            assert channel_prefix.shape == (NUM_RANKS, channels), "SM count differs from the handle's"
            assert in_rank.shape[0] == x.shape[0]
            return x[recv_src_idx.long()], None, None, None, None, _EventOverlap()
        assert num_tokens_per_rank is not None and num_tokens_per_rank.dtype == torch.int32
        assert num_tokens_per_expert is not None and num_tokens_per_expert.dtype == torch.int32
        assert is_token_in_rank is not None and is_token_in_rank.dtype == torch.bool
        assert is_token_in_rank.shape == (x.shape[0], NUM_RANKS) and is_token_in_rank.is_contiguous()
        assert topk_idx is not None and topk_weights is not None
        assert topk_idx.dtype == self.topk_idx_t and topk_idx.is_contiguous()
        assert topk_weights.dtype == torch.float32 and topk_weights.is_contiguous()
        assert topk_idx.shape == topk_weights.shape == (x.shape[0], topk_idx.shape[1])
        local_n = num_tokens_per_expert.shape[0] // NUM_RANKS
        recv_src_idx = is_token_in_rank[:, 0].nonzero().squeeze(1).int()
        src = recv_src_idx.long()
        ids = topk_idx[src]
        local = (ids >= 0) & (ids < local_n)
        recv_ids = torch.where(local, ids, -1)
        recv_weights = torch.where(local, topk_weights[src], 0.0)
        per_expert_list = [int((recv_ids == e).sum()) for e in range(local_n)]
        handle = (
            torch.zeros(NUM_RANKS, NUM_RANKS, dtype=torch.int32),  # rank_prefix_matrix
            torch.zeros(NUM_RANKS, channels, dtype=torch.int32),  # channel_prefix_matrix
            torch.zeros(NUM_RANKS, channels, dtype=torch.int32),  # recv_channel_prefix_matrix
            recv_src_idx,
            is_token_in_rank,
            torch.zeros(x.shape[0], NUM_RANKS, dtype=torch.int32),  # send_head
        )
        return x[src], recv_ids, recv_weights, per_expert_list, handle, _EventOverlap()

    def combine(
        self,
        x: torch.Tensor,
        handle: tuple[torch.Tensor, ...],
        topk_weights: torch.Tensor | None = None,
        bias: Any = None,
        config: _Config | None = None,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, _EventOverlap]:
        assert x.dim() == 2 and x.is_contiguous() and x.dtype == torch.bfloat16
        config = self.get_combine_config(self.group_size) if config is None else config
        assert isinstance(config, _Config)
        _Buffer.calls.append(("combine", {"weights": topk_weights is not None, "config": config}))
        _, _, recv_channel_prefix, src_idx, _, send_head = handle
        assert recv_channel_prefix.shape == (NUM_RANKS, config.num_sms // 2), "SM count differs"
        assert src_idx.dtype == torch.int32 and x.shape[0] == src_idx.shape[0]
        tokens = send_head.shape[0]
        out = torch.zeros(tokens, x.shape[1], dtype=x.dtype).index_add(0, src_idx.long(), x)
        weights = None
        if topk_weights is not None:
            assert topk_weights.dtype == torch.float32 and topk_weights.is_contiguous()
            assert topk_weights.shape[0] == x.shape[0]
            weights = torch.zeros(tokens, topk_weights.shape[1]).index_add(0, src_idx.long(), topk_weights)
        return out, weights, _EventOverlap()


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("deep_ep")
    module.Buffer = _Buffer  # type: ignore[attr-defined]
    module.Config = _Config  # type: ignore[attr-defined]
    module.EventOverlap = _EventOverlap  # type: ignore[attr-defined]
    module.topk_idx_t = torch.int64  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deep_ep", module)
    monkeypatch.setattr(_Buffer, "num_sms", 20)
    monkeypatch.setattr(_Buffer, "topk_idx_t", torch.int64)
    monkeypatch.setattr(_Buffer, "created", [], raising=False)
    monkeypatch.setattr(_Buffer, "calls", [], raising=False)
    monkeypatch.setattr(deepep_module.dist, "get_world_size", lambda group=None: SIZES[id(group)])
    return module


def _routing(tokens: int, num_experts: int, k: int, hidden: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    experts = (torch.randn(num_experts, hidden, hidden, generator=g) / hidden**0.5).to(torch.bfloat16)
    return x, ids, weights, experts


def _rank0_reference(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, local_n: int
) -> tuple[torch.Tensor, ...]:
    """Output and input/weight gradients of rank 0's experts' share, in float64."""
    xr = x.double().requires_grad_()
    wr = weights.double().requires_grad_()
    out = torch.zeros_like(xr)
    for slot in range(ids.shape[1]):
        for e in range(local_n):
            mask = (ids[:, slot] == e).double()[:, None]
            out = out + mask * wr[:, slot : slot + 1] * (xr @ experts[e].double())
    out.pow(2).sum().backward()
    assert xr.grad is not None and wr.grad is not None
    return out.detach(), xr.grad, wr.grad


def _run(
    comm: DeepEPMoECommunication, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, experts: Any
) -> Any:
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    d = comm.dispatch(RoutedTokens(xi, ids, wi, experts.shape[0]))
    rows = torch.cat(
        [r @ experts[e] for e, r in enumerate(d.hidden_states.split(d.tokens_per_expert.tolist()))]
    )
    out = comm.combine(rows, d)
    out.float().pow(2).sum().backward()
    assert xi.grad is not None and wi.grad is not None
    return d, out, xi.grad, wi.grad


@pytest.mark.parametrize("topk_idx_t", [torch.int64, torch.int32])
def test_dispatch_combine_and_backward_match_the_reference(
    stand_in: types.ModuleType, topk_idx_t: torch.dtype
) -> None:
    """Forward and both backward directions through the stand-in equal rank 0's share computed directly; the
    ids reach DeepEP as the build's `topk_idx_t` (EP_NUM_TOPK_IDX_BITS=32 builds use int32)."""
    stand_in.topk_idx_t = topk_idx_t  # type: ignore[attr-defined]
    _Buffer.topk_idx_t = topk_idx_t
    num_experts, k, hidden, tokens = 4, 2, 32, 12
    x, ids, weights, experts = _routing(tokens, num_experts, k, hidden)
    assert ((ids >= 2).all(1)).any(), "some token must go to the other rank only"
    comm = DeepEPMoECommunication(GROUP)  # type: ignore[arg-type]
    d, out, gx, gw = _run(comm, x, ids, weights, experts)
    local_n = num_experts // NUM_RANKS
    assert d.tokens_per_expert.dtype == torch.int64
    assert d.tokens_per_expert.tolist() == [int((ids == e).sum()) for e in range(local_n)]
    ref_out, ref_gx, ref_gw = _rank0_reference(x, ids, weights, experts, local_n)
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gx.double(), ref_gx, rtol=3e-2, atol=5e-2)
    torch.testing.assert_close(gw.double(), ref_gw, rtol=3e-2, atol=5e-2)
    # Forward: one non-cached dispatch, one combine without weights; backward: the combine's backward is a
    # cached dispatch, the dispatch's backward a combine with the weight gradients.
    kinds = [(name, info.get("cached", info.get("weights"))) for name, info in _Buffer.calls]
    assert kinds == [("dispatch", False), ("combine", False), ("dispatch", True), ("combine", True)]


def test_configs_are_captured_once_and_passed_to_every_call(stand_in: types.ModuleType) -> None:
    """`num_sms` reaches DeepEP through `Buffer.set_num_sms`; the configs taken at the first dispatch size
    the buffer and go to every call, so a later class-wide `set_num_sms` (another handler) changes neither
    this handler's backward (whose handle has one column per channel of the forward) nor its next step."""
    x, ids, weights, experts = _routing(8, 4, 2, 32)
    comm = DeepEPMoECommunication(GROUP, num_sms=24)  # type: ignore[arg-type]
    assert _Buffer.num_sms == 24
    d = comm.dispatch(RoutedTokens(x.clone().requires_grad_(), ids, weights, 4))
    _Buffer.set_num_sms(8)  # another handler, configured differently
    rows = torch.cat(
        [r @ experts[e] for e, r in enumerate(d.hidden_states.split(d.tokens_per_expert.tolist()))]
    )
    comm.combine(rows, d).float().sum().backward()
    _run(comm, x, ids, weights, experts)
    assert {info["config"].num_sms for _, info in _Buffer.calls} == {24}
    assert len({id(info["config"]) for name, info in _Buffer.calls if name == "dispatch"}) == 1
    assert len(_Buffer.created) == 1


def test_buffer_grows_with_the_hidden_size_and_combine_uses_the_dispatch_buffer(
    stand_in: types.ModuleType,
) -> None:
    comm = DeepEPMoECommunication(GROUP)  # type: ignore[arg-type]
    small = _routing(6, 4, 2, 32)
    large = _routing(6, 4, 2, 64)
    d_small = comm.dispatch(RoutedTokens(small[0], small[1], small[2], 4))
    d_small_again = comm.dispatch(RoutedTokens(small[0], small[1], small[2], 4))
    assert len(_Buffer.created) == 1
    d_large = comm.dispatch(RoutedTokens(large[0], large[1], large[2], 4))
    assert len(_Buffer.created) == 2
    assert _Buffer.created[1].num_nvl_bytes > _Buffer.created[0].num_nvl_bytes
    # The smaller exchange still combines on the buffer its dispatch used (its handle belongs to it).
    assert d_small.state.buffer is d_small_again.state.buffer is _Buffer.created[0]
    assert d_large.state.buffer is _Buffer.created[1]
    out = comm.combine(d_small.hidden_states, d_small)
    assert out.shape == small[0].shape


def test_buffers_are_destroyed_explicitly_by_close(stand_in: types.ModuleType) -> None:
    """Every buffer is made with `explicitly_destroy` (DeepEP's implicit destruction is a GPU barrier run
    by the garbage collector: a rank whose peers already exited hangs in it) and `close` destroys each
    once, the outgrown ones included; the handler then works again on a new buffer."""
    comm = DeepEPMoECommunication(GROUP)  # type: ignore[arg-type]
    x, ids, weights, experts = _routing(6, 4, 2, 32)
    _run(comm, x, ids, weights, experts)
    large = _routing(6, 4, 2, 64)
    comm.dispatch(RoutedTokens(large[0], large[1], large[2], 4))
    assert len(_Buffer.created) == 2 and all(b.explicitly_destroy for b in _Buffer.created)
    assert not any(b.destroyed for b in _Buffer.created)
    comm.close()
    assert all(b.destroyed for b in _Buffer.created)
    comm.close()  # nothing left to destroy: no second destroy of a buffer
    _run(comm, x, ids, weights, experts)
    assert len(_Buffer.created) == 3 and not _Buffer.created[2].destroyed


def test_unsupported_shapes_and_groups_fail_on_the_host(
    stand_in: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    comm = DeepEPMoECommunication(GROUP)  # type: ignore[arg-type]
    for hidden in (24, 8192):  # 48 bytes: not a multiple of 32; 16384 bytes: past the TMA staging
        x = torch.zeros(4, hidden, dtype=torch.bfloat16)
        ids = torch.tensor([[0, 1]] * 4)
        with pytest.raises(ValueError, match="token row"):
            comm.dispatch(RoutedTokens(x, ids, torch.ones(4, 2), 4))
    assert not _Buffer.created  # nothing was allocated for them
    # 8176 (16352 bytes) is the largest bf16 hidden size the intranode dispatch takes.
    assert deepep_module._MAX_ROW_BYTES == 16352
    three = object()
    monkeypatch.setitem(SIZES, id(three), 3)
    with pytest.raises(ValueError, match="groups of"):
        DeepEPMoECommunication(three)  # type: ignore[arg-type]
    cuda = torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="intranode kernels serve groups"):
        build_moe_communication(DeepEPBackendConfig(), three, device=cuda, dtype=torch.bfloat16)  # type: ignore[arg-type]
    chosen = build_moe_communication(AutoBackendConfig(), three, device=cuda, dtype=torch.bfloat16)  # type: ignore[arg-type]
    assert isinstance(chosen, AllToAllMoECommunication)
    # Where DeepEP could run, `auto` still takes the all-to-all (measured faster, docs/parallelism.md).
    chosen = build_moe_communication(AutoBackendConfig(), GROUP, device=cuda, dtype=torch.bfloat16)  # type: ignore[arg-type]
    assert isinstance(chosen, AllToAllMoECommunication)
    chosen = build_moe_communication(DeepEPBackendConfig(), GROUP, device=cuda, dtype=torch.bfloat16)  # type: ignore[arg-type]
    assert isinstance(chosen, DeepEPMoECommunication)


def test_a_deep_ep_whose_import_fails_is_not_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """V2's `deep_ep/__init__.py` asserts at import that the NCCL torch loaded is the one it linked: such a
    package is unusable, not an error for `auto`."""
    package = tmp_path / "deep_ep"
    package.mkdir()
    (package / "__init__.py").write_text("raise AssertionError('Invalid NCCL versions')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    assert not deep_ep_available()
    assert "deep_ep" not in sys.modules


BUILD_SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "device" / "build_deep_ep.sh"


def test_build_script_parses_and_fails_clearly_without_a_source(tmp_path: Path) -> None:
    """The build itself needs a GPU machine (docs/parallelism.md, "DeepEP"); here: valid bash, and a
    missing source is a non-zero exit that says where to get it."""
    subprocess.run(["bash", "-n", str(BUILD_SCRIPT)], check=True)
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT), str(tmp_path / "site")],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "DEEP_EP_SRC": str(tmp_path / "missing")},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "FAILED: no DeepEP source" in result.stderr and "docs/parallelism.md" in result.stderr
