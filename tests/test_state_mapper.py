"""Unit tests of the state mapper graph: each leaf against hand-written torch ops, compositions, errors."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from d9d.state import (
    Cast,
    Concat,
    Drop,
    Duplicate,
    Function,
    Graph,
    Identity,
    Parallel,
    Prefixed,
    Rename,
    Sequential,
    Shard,
    Split,
    Stack,
    StateGroup,
    StateMapper,
    StateMappingError,
    TableMapper,
    Transpose,
    add_prefix,
    apply_group,
    identity_mapper,
    select_prefix,
    strip_prefix,
)


def run_all(mapper: StateMapper, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Apply every group, each on exactly its inputs, and check groups never overlap."""
    out: dict[str, torch.Tensor] = {}
    for group in mapper.groups():
        result = apply_group(mapper, group, {k: state[k] for k in group.inputs})
        assert not out.keys() & result.keys()
        out.update(result)
    return out


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_group_declares_keys_without_data():
    m = Rename({"a": "x", "b": "y"})
    assert list(m.groups()) == [StateGroup.of(["a"], ["x"]), StateGroup.of(["b"], ["y"])]
    assert m.inputs() == {"a", "b"} and m.outputs() == {"x", "y"}


def test_rename_identity_and_prefix_helpers():
    state = {"model.a": rand(2), "model.b": rand(3), "lm_head": rand(4)}
    out = run_all(strip_prefix("model.", ["model.a", "model.b"]), state)
    assert out.keys() == {"a", "b"} and out["a"] is state["model.a"]
    assert run_all(add_prefix("p.", ["lm_head"]), state)["p.lm_head"] is state["lm_head"]
    assert select_prefix("model.", state).inputs() == {"model.a", "model.b"}
    assert select_prefix("model.", state, strip=True).outputs() == {"a", "b"}
    assert run_all(Identity(state), state) == state
    with pytest.raises(StateMappingError, match="'lm_head'"):
        strip_prefix("model.", state)


def test_stack_unstack_match_torch_and_invert():
    experts = {f"e.{i}.w": rand(3, 4, seed=i) for i in range(5)}
    stack = Stack(list(experts), "w", dim=0)
    stacked = run_all(stack, experts)["w"]
    assert torch.equal(stacked, torch.stack(list(experts.values())))
    back = run_all(stack.inverse(), {"w": stacked})
    assert back.keys() == experts.keys()
    assert all(torch.equal(back[k], experts[k]) for k in experts)
    with pytest.raises(StateMappingError, match=r"'e.3.w' has shape \(3, 5\)"):
        run_all(stack, {**experts, "e.3.w": rand(3, 5)})
    with pytest.raises(StateMappingError, match=r"'e.1.w' is torch.float64"):
        run_all(stack, {**experts, "e.1.w": rand(3, 4).double()})
    with pytest.raises(StateMappingError, match="no dim 0 of size 5"):
        run_all(stack.inverse(), {"w": rand(4, 3, 4)})


def test_concat_split_gqa_qkv_roundtrip():
    q, k, v = rand(8, 6, seed=1), rand(2, 6, seed=2), rand(2, 6, seed=3)
    fuse = Concat(["q", "k", "v"], "qkv", dim=0, sizes=[8, 2, 2])
    qkv = run_all(fuse, {"q": q, "k": k, "v": v})["qkv"]
    assert torch.equal(qkv, torch.cat([q, k, v]))
    parts = run_all(fuse.inverse(), {"qkv": qkv})
    assert torch.equal(parts["q"], q) and torch.equal(parts["k"], k) and torch.equal(parts["v"], v)
    with pytest.raises(StateMappingError, match="'k' has 3 on dim 0, expected 2"):
        run_all(fuse, {"q": q, "k": rand(3, 6), "v": v})
    with pytest.raises(StateMappingError, match="needs sizes="):
        Concat(["q", "k"], "qk").inverse()
    chunks = run_all(Split("x", ["a", "b"], dim=1), {"x": rand(2, 6)})
    assert chunks["a"].shape == (2, 3) and chunks["b"].is_contiguous()
    with pytest.raises(StateMappingError, match="does not split into 4 equal parts"):
        run_all(Split("x", list("abcd"), dim=1), {"x": rand(2, 6)})


def test_transpose_cast_duplicate_drop_function():
    w = rand(3, 5)
    t = run_all(Transpose(["w"]), {"w": w})["w"]
    assert torch.equal(t, w.T) and t.is_contiguous()
    assert run_all(Cast(["w"], torch.bfloat16), {"w": w})["w"].dtype == torch.bfloat16
    tied = run_all(Duplicate("emb", ["emb", "head"]), {"emb": w})
    assert tied["emb"] is w and tied["head"] is w
    assert run_all(Drop(["inv_freq"]), {"inv_freq": w}) == {}
    scale = Function(["w"], ["w2"], lambda s: {"w2": s["w"] * 2}, lambda s: {"w": s["w2"] / 2})
    assert torch.equal(run_all(scale.inverse(), run_all(scale, {"w": w}))["w"], w)
    with pytest.raises(StateMappingError, match="no inverse"):
        Cast(["w"], torch.float16).inverse()


def test_apply_group_checks_contract():
    bad = Function(["a"], ["b"], lambda s: {"c": s["a"]}, name="Bad")
    with pytest.raises(
        StateMappingError, match=r"Bad\(\['a'\] -> \['b'\]\).*missing \['b'\], unexpected \['c'\]"
    ):
        run_all(bad, {"a": rand(1)})
    with pytest.raises(StateMappingError, match=r"wrong inputs \(missing \['a'\]"):
        apply_group(bad, bad.groups()[0], {})


def test_sequential_composes_groups_and_passes_untouched_keys():
    experts = {f"layers.0.e.{i}": rand(2, 3, seed=i) for i in range(3)}
    state = {**experts, "layers.0.norm": rand(3, seed=9), "embed": rand(4, 3, seed=7)}
    stage1 = Parallel([strip_prefix("layers.0.", [*experts, "layers.0.norm"]), Identity(["embed"])])
    stage2 = Stack([k.removeprefix("layers.0.") for k in experts], "experts")
    stage3 = Transpose(["experts"], 1, 2)
    seq = Sequential([stage1, stage2, stage3])
    # One composed group joins the three renames, the stack and the transpose; norm and embed stay apart.
    groups = {g.outputs: g.inputs for g in seq.groups()}
    assert groups == {
        frozenset({"experts"}): frozenset(experts),
        frozenset({"norm"}): frozenset({"layers.0.norm"}),
        frozenset({"embed"}): frozenset({"embed"}),
    }
    out = run_all(seq, state)
    assert torch.equal(out["experts"], torch.stack(list(experts.values())).transpose(1, 2))
    assert out["norm"] is state["layers.0.norm"]
    # Stage 2 consuming a source key that stage 1 left alone.
    seq2 = Sequential([Rename({"a": "b"}), Stack(["b", "c"], "bc")])
    assert seq2.groups() == (StateGroup.of(["a", "c"], ["bc"]),)
    inv = run_all(seq.inverse(), out)
    assert inv.keys() == state.keys() and all(torch.equal(inv[k], state[k]) for k in state)


def test_sequential_errors_name_key_and_stage():
    with pytest.raises(StateMappingError, match=r"stage 1 .* needs 'a', but stage 0 .* consumed it"):
        Sequential([Rename({"a": "b"}), Rename({"a": "c"})])
    with pytest.raises(StateMappingError, match=r"collision: stage 1 .* produces 'x', but 'x' from stage 0"):
        Sequential([Rename({"a": "x"}), Rename({"b": "x"})])


def test_parallel_collisions_and_duplicate_consumers():
    with pytest.raises(
        StateMappingError, match=r"collision: Parallel children 0 .* and 1 .* both produce 'x'"
    ):
        Parallel([Rename({"a": "x"}), Rename({"b": "x"})])
    with pytest.raises(
        StateMappingError, match=r"collision: Parallel children 0 .* and 1 .* both consume 'a'"
    ):
        Parallel([Rename({"a": "x"}), Rename({"a": "y"})])
    with pytest.raises(StateMappingError, match=r"'a' is consumed by two groups.*Duplicate"):
        TableMapper([(StateGroup.of(["a"], ["x"]), dict), (StateGroup.of(["a"], ["y"]), dict)])


def test_graph_orders_by_keys_and_rejects_cycles():
    # Declared out of order: transpose consumes the stack's output.
    transpose = Function(["stacked"], ["w"], lambda s: {"w": s["stacked"].transpose(-2, -1)})
    g = Graph([transpose, Stack(["w0", "w1"], "stacked"), Rename({"b": "bias"})])
    w0, w1 = rand(2, 3, seed=1), rand(2, 3, seed=2)
    out = run_all(g, {"w0": w0, "w1": w1, "b": rand(1)})
    assert torch.equal(out["w"], torch.stack([w0, w1]).transpose(-2, -1))
    assert g.inputs() == {"w0", "w1", "b"}
    with pytest.raises(
        StateMappingError, match=r"cycle in Graph: 0 \(Rename.*--'b'--> 1 \(Rename.*--'a'--> 0"
    ):
        Graph([Rename({"a": "b"}), Rename({"b": "a"})])
    with pytest.raises(StateMappingError, match=r"collision: Graph nodes 0 .* and 1 .* both produce 'w'"):
        Graph([Rename({"x": "w"}), Rename({"y": "w"})])
    with pytest.raises(StateMappingError, match=r"cycle in Graph: 0 \(Transpose.*--'w'--> 0"):
        Graph([Transpose(["w"])])  # an in-place op has no place in a DAG of key names


def test_prefixed_reuses_a_layer_mapper():
    layer = Parallel([Concat(["q", "k"], "qk", sizes=[2, 2]), Rename({"n": "norm"})])
    model = Parallel([Prefixed(f"layers.{i}.", layer) for i in range(2)])
    state = {f"layers.{i}.{k}": rand(2, 3, seed=i * 10 + j) for i in range(2) for j, k in enumerate("qkn")}
    out = run_all(model, state)
    assert out.keys() == {"layers.0.qk", "layers.0.norm", "layers.1.qk", "layers.1.norm"}
    assert torch.equal(out["layers.1.qk"], torch.cat([state["layers.1.q"], state["layers.1.k"]]))
    moved = Prefixed("model.", Identity(["a"]), on="input")
    assert moved.groups() == (StateGroup.of(["model.a"], ["a"]),)
    assert moved.inverse().groups() == (StateGroup.of(["a"], ["model.a"]),)


def test_shard_splits_groups_without_overlap():
    m = Rename({f"k{i}": f"t{i}" for i in range(7)})
    parts = [Shard(m, 3, i) for i in range(3)]
    seen = [g for p in parts for g in p.groups()]
    assert sorted(seen, key=StateGroup.sort_key) == list(m.groups())
    assert [len(p.groups()) for p in parts] == [3, 2, 2]
    with pytest.raises(StateMappingError, match="index=3"):
        Shard(m, 3, 3)
    with pytest.raises(StateMappingError, match="does not own"):
        parts[0].apply(parts[1].groups()[0], {"k1": rand(1)})


def test_identity_mapper_covers_params_and_persistent_buffers():
    module = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    assert identity_mapper(module).inputs() == set(module.state_dict())
