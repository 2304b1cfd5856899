"""Single-process metric values against NumPy (float64) and scikit-learn on random data."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from sklearn import metrics as skm

from d9d.metrics import (
    AsyncMetricCollector,
    BinaryAUROC,
    BinaryConfusionMetric,
    ComposeMetric,
    MaxMetric,
    MeanMetric,
    Metric,
    MinMetric,
    MulticlassConfusionMetric,
    MultilabelConfusionMetric,
    SumMetric,
    WeightedMeanMetric,
    to_scalars,
)
from tests.test_metrics_support import assert_trees_close, catalogue, catalogue_inputs


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(actual: torch.Tensor | float, expected: object, atol: float = 1e-12) -> None:
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float64), np.asarray(expected), rtol=0, atol=atol)


def _chunks(n: int, pieces: int) -> list[slice]:
    edges = np.linspace(0, n, pieces + 1).astype(int)
    return [slice(int(a), int(b)) for a, b in itertools.pairwise(edges)]


# -- aggregations -----------------------------------------------------------------------------------


def test_aggregations_match_numpy() -> None:
    g = _gen(0)
    batches = [torch.randn(n, generator=g, dtype=torch.float32) * 10 for n in (5, 0, 17, 1)]
    weights = [torch.rand(b.shape, generator=g) for b in batches]
    metrics = {
        "sum": SumMetric(),
        "mean": MeanMetric(),
        "wmean": WeightedMeanMetric(),
        "max": MaxMetric(),
        "min": MinMetric(),
    }
    for b, w in zip(batches, weights, strict=True):
        for name, m in metrics.items():
            if name == "wmean":
                m.update(b, w)
            else:
                m.update(b)
    metrics["sum"].update(2.5)  # plain numbers are accepted too
    values = np.concatenate([b.double().numpy() for b in batches])
    w = np.concatenate([x.double().numpy() for x in weights])
    _close(metrics["sum"].compute(), values.sum() + 2.5, atol=1e-9)
    _close(metrics["mean"].compute(), values.mean(), atol=1e-12)
    _close(metrics["wmean"].compute(), (values * w).sum() / w.sum(), atol=1e-12)
    _close(metrics["max"].compute(), values.max())
    _close(metrics["min"].compute(), values.min())


def test_weighted_mean_broadcasts_a_scalar_weight_and_refuses_bad_shapes() -> None:
    m = WeightedMeanMetric()
    m.update(torch.tensor([1.0, 3.0]), 2.0)  # weight 2 on each element
    m.update(torch.tensor([10.0]), torch.tensor([0.5]))
    _close(m.compute(), (2 * 1 + 2 * 3 + 0.5 * 10) / 4.5)
    with pytest.raises(ValueError, match=r"weight shape \(3,\) does not broadcast to value shape \(2,\)"):
        m.update(torch.ones(2), torch.ones(3))


def test_empty_aggregations_are_documented_identities() -> None:
    assert torch.isnan(MeanMetric().compute())
    assert MaxMetric().compute() == -torch.inf
    assert MinMetric().compute() == torch.inf


# -- AUROC ------------------------------------------------------------------------------------------


def test_auroc_is_within_its_error_bound_of_sklearn() -> None:
    g = _gen(1)
    n = 30_000
    targets = (torch.rand(n, generator=g) < 0.3).long()
    scores = torch.sigmoid(torch.randn(n, generator=g) + 1.2 * targets)
    m = BinaryAUROC()  # 4096 bins
    for part in _chunks(n, 7):
        m.update(scores[part], targets[part])
    exact = skm.roc_auc_score(targets.numpy(), scores.numpy())
    bound = float(m.error_bound())
    # The documented tolerance for smooth score distributions with the default 4096 bins.
    assert bound < 5e-4
    assert abs(float(m.compute()) - exact) <= bound


def test_auroc_coarse_bins_still_respect_the_bound() -> None:
    g = _gen(2)
    targets = torch.randint(0, 2, (5000,), generator=g)
    scores = (torch.rand(5000, generator=g) + 0.3 * targets).clamp(0, 1)
    m = BinaryAUROC(num_bins=16)
    m.update(scores, targets)
    exact = skm.roc_auc_score(targets.numpy(), scores.numpy())
    assert abs(float(m.compute()) - exact) <= float(m.error_bound())
    assert float(m.error_bound()) > 1e-3  # coarse bins: the bound is real, not vacuous


def test_auroc_is_exact_for_scores_on_bin_centres() -> None:
    g = _gen(3)
    bins = 64
    targets = torch.randint(0, 2, (4000,), generator=g)
    index = (torch.randint(0, bins, (4000,), generator=g) + 6 * targets).clamp(max=bins - 1)
    scores = (index + 0.5) / bins
    m = BinaryAUROC(num_bins=bins)
    m.update(scores, targets.bool())
    _close(m.compute(), skm.roc_auc_score(targets.numpy(), scores.numpy()), atol=1e-12)


def test_auroc_rejects_invalid_inputs_at_compute_and_shapes_at_update() -> None:
    m = BinaryAUROC(num_bins=8)
    m.update(torch.tensor([0.2, 1.5, float("nan")]), torch.tensor([0, 1, 1]))
    m.update(torch.tensor([0.2]), torch.tensor([2]))
    with pytest.raises(ValueError, match="3 invalid inputs"):
        m.compute()
    with pytest.raises(ValueError, match=r"scores shape \(2,\) != targets shape \(3,\)"):
        m.update(torch.rand(2), torch.zeros(3))
    one_class = BinaryAUROC(num_bins=8)
    one_class.update(torch.rand(5), torch.ones(5))
    assert torch.isnan(one_class.compute())


# -- confusion family -------------------------------------------------------------------------------


def test_binary_matches_sklearn() -> None:
    g = _gen(4)
    targets = torch.randint(0, 2, (3, 400), generator=g)
    probs = (torch.rand(3, 400, generator=g) * 0.8 + 0.25 * targets).clamp(0, 1)
    m = BinaryConfusionMetric(threshold=0.5, betas=(0.5, 2.0))
    for i in range(3):
        m.update(probs[i], targets[i])
    y, p = targets.reshape(-1).numpy(), (probs.reshape(-1) >= 0.5).long().numpy()
    out = m.compute()
    _close(out["accuracy"], skm.accuracy_score(y, p))
    _close(out["precision"], skm.precision_score(y, p))
    _close(out["recall"], skm.recall_score(y, p))
    _close(out["f1"], skm.f1_score(y, p))
    _close(out["f0.5"], skm.fbeta_score(y, p, beta=0.5))
    _close(out["f2"], skm.fbeta_score(y, p, beta=2.0))
    assert torch.equal(m.confusion_matrix()[0], torch.from_numpy(skm.confusion_matrix(y, p)))
    # Integer label predictions give the same counts as thresholded scores.
    labels = BinaryConfusionMetric()
    labels.update(torch.from_numpy(p), targets.reshape(-1).bool())
    assert torch.equal(labels.confusion_matrix(), m.confusion_matrix())


_AVERAGES = [("micro", "micro"), ("macro", "macro"), ("none", None)]


def _check_prf(m: Metric[object], y: np.ndarray, p: np.ndarray, labels: list[int] | None) -> None:
    assert isinstance(m, MulticlassConfusionMetric | MultilabelConfusionMetric)
    for ours, theirs in _AVERAGES:
        kw = {"average": theirs, "zero_division": 0, "labels": labels}
        _close(m.precision(ours), skm.precision_score(y, p, **kw))
        _close(m.recall(ours), skm.recall_score(y, p, **kw))
        _close(m.fbeta(1.0, ours), skm.f1_score(y, p, **kw))
        _close(m.fbeta(0.5, ours), skm.fbeta_score(y, p, beta=0.5, **kw))


@pytest.mark.filterwarnings("ignore:y_pred contains classes not in y_true")
def test_multiclass_top1_matches_sklearn() -> None:
    g = _gen(5)
    c, n = 6, 900
    targets = torch.randint(0, c - 1, (n,), generator=g)  # class 5 never occurs: zero-division path
    scores = torch.randn(n, c, generator=g) + 1.5 * torch.nn.functional.one_hot(targets, c)
    m = MulticlassConfusionMetric(num_classes=c, average="macro", betas=(0.5,))
    for part in _chunks(n, 4):
        m.update(scores[part], targets[part])
    y, p = targets.numpy(), scores.argmax(-1).numpy()
    labels = list(range(c))
    _check_prf(m, y, p, labels)
    _close(m.accuracy("micro"), skm.accuracy_score(y, p))
    _close(m.accuracy("macro"), skm.balanced_accuracy_score(y, p))
    out = m.compute()
    _close(out["f1"], skm.f1_score(y, p, average="macro", labels=labels, zero_division=0))
    _close(out["f0.5"], skm.fbeta_score(y, p, beta=0.5, average="macro", labels=labels, zero_division=0))
    expected_cm = skm.multilabel_confusion_matrix(y, p, labels=labels)
    assert torch.equal(m.confusion_matrix(), torch.from_numpy(expected_cm))


def test_multiclass_label_preds_and_ignore_index() -> None:
    g = _gen(6)
    c, n = 4, 500
    targets = torch.randint(0, c, (n,), generator=g)
    preds = torch.randint(0, c, (n,), generator=g)
    targets[::7] = -100
    m = MulticlassConfusionMetric(num_classes=c, ignore_index=-100)
    m.update(preds.view(10, 50), targets.view(10, 50))  # extra batch dims flatten
    keep = targets != -100
    _check_prf(m, targets[keep].numpy(), preds[keep].numpy(), list(range(c)))
    _close(m.accuracy("micro"), skm.accuracy_score(targets[keep].numpy(), preds[keep].numpy()))


def _topk_reference(scores: np.ndarray, y: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """Per-class one-vs-rest counts by brute force: sample i predicts class j iff j is in its top k."""
    c = scores.shape[1]
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    predicted = np.zeros_like(scores, dtype=bool)
    np.put_along_axis(predicted, top, True, axis=1)
    actual = np.eye(c, dtype=bool)[y]
    tp = (predicted & actual).sum(0).astype(float)
    fp = (predicted & ~actual).sum(0).astype(float)
    fn = (~predicted & actual).sum(0).astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        prec = np.nan_to_num(tp / (tp + fp))
        rec = np.nan_to_num(tp / (tp + fn))
        f1 = np.nan_to_num(2 * tp / (2 * tp + fp + fn))
    return {"tp": tp, "fp": fp, "fn": fn, "precision": prec, "recall": rec, "f1": f1}


def test_multiclass_topk_matches_sklearn_and_brute_force() -> None:
    g = _gen(7)
    c, n, k = 7, 600, 3
    targets = torch.randint(0, c, (n,), generator=g)
    scores = torch.randn(n, c, generator=g, dtype=torch.float64) + 0.7 * torch.nn.functional.one_hot(
        targets, c
    )
    m = MulticlassConfusionMetric(num_classes=c, top_k=k, average="macro")
    for part in _chunks(n, 3):
        m.update(scores[part], targets[part])
    y, s = targets.numpy(), scores.numpy()
    _close(m.accuracy("micro"), skm.top_k_accuracy_score(y, s, k=k, labels=list(range(c))))
    ref = _topk_reference(s, y, k)
    _close(m.precision("none"), ref["precision"])
    _close(m.recall("none"), ref["recall"])
    _close(m.fbeta(1.0, "macro"), ref["f1"].mean())
    _close(m.precision("micro"), ref["tp"].sum() / (ref["tp"].sum() + ref["fp"].sum()))
    _close(m.accuracy("macro"), ref["recall"].mean())
    with pytest.raises(ValueError, match="label preds need top_k=1"):
        m.update(targets, targets)


def test_multilabel_matches_sklearn() -> None:
    g = _gen(8)
    n, labels = 300, 5
    targets = (torch.rand(n, labels, generator=g) < 0.35).long()
    probs = (torch.rand(n, labels, generator=g) * 0.7 + 0.35 * targets).clamp(0, 1)
    probs[:, 4] = 0.1  # label 4 is never predicted
    m = MultilabelConfusionMetric(num_labels=labels, threshold=0.5)
    for part in _chunks(n, 5):
        m.update(probs[part], targets[part])
    y, p = targets.numpy(), (probs >= 0.5).long().numpy()
    _check_prf(m, y, p, None)
    _close(m.accuracy("micro"), 1 - skm.hamming_loss(y, p))
    _close(m.accuracy("none"), (y == p).mean(0))
    _close(m.subset_accuracy(), skm.accuracy_score(y, p))
    assert torch.equal(m.confusion_matrix(), torch.from_numpy(skm.multilabel_confusion_matrix(y, p)))
    assert set(m.compute()) == {"accuracy", "precision", "recall", "f1", "subset_accuracy"}


def test_confusion_metrics_refuse_bad_input() -> None:
    m = MulticlassConfusionMetric(num_classes=3)
    m.update(torch.tensor([0, 1, 7]), torch.tensor([0, 1, 2]))  # label 7 out of range
    m.update(torch.tensor([0]), torch.tensor([-1]))
    with pytest.raises(ValueError, match="saw 2 invalid inputs"):
        m.compute()
    with pytest.raises(ValueError, match=r"score preds shape \(4, 2\) must be targets shape \(4,\)"):
        m.update(torch.rand(4, 2), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="top_k must be in"):
        MulticlassConfusionMetric(num_classes=3, top_k=4)
    with pytest.raises(ValueError, match="average must be one of"):
        MultilabelConfusionMetric(num_labels=2, average="weighted")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must end in num_labels=3"):
        MultilabelConfusionMetric(num_labels=3).update(torch.rand(4, 2), torch.zeros(4, 2))
    binary = BinaryConfusionMetric()
    binary.update(torch.tensor([0.9, float("nan")]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="saw 1 invalid inputs"):
        binary.compute()


# -- compose, state dicts, scalars --------------------------------------------------------------------


def test_compose_routes_inputs_and_matches_separate_metrics() -> None:
    compose = catalogue()
    inputs = catalogue_inputs(9)
    compose.update(inputs)
    alone = MulticlassConfusionMetric(num_classes=5, top_k=2)
    alone.update(*inputs["eval"]["cls"])  # type: ignore[index]
    assert_trees_close(compose.compute()["eval"]["cls"], alone.compute())
    assert compose["eval"]["tags"].compute().keys() >= {"subset_accuracy"}  # type: ignore[index]
    assert "eval.cls.matrix" in compose.state_dict()
    with pytest.raises(KeyError, match=r"no metric 'nope'; it has \['auroc', 'binary', 'cls', 'tags'\]"):
        compose.update({"eval": {"nope": torch.ones(1)}})
    with pytest.raises(ValueError, match=r"without '\.'"):
        ComposeMetric({"a.b": SumMetric()})
    with pytest.raises(TypeError, match="'x' is a int, not a Metric or dict"):
        ComposeMetric({"x": 3})  # type: ignore[dict-item]


def test_state_dict_round_trip_mid_stream() -> None:
    full, first_half = catalogue(), catalogue()
    batches = [catalogue_inputs(seed) for seed in range(10, 16)]
    for b in batches:
        full.update(b)
    for b in batches[:3]:
        first_half.update(b)
    saved = first_half.state_dict()
    first_half.update(batches[3])  # later updates must not leak into the saved copy
    resumed = catalogue()
    resumed.load_state_dict(saved)
    for b in batches[3:]:
        resumed.update(b)
    assert_trees_close(resumed.compute(), full.compute())

    with pytest.raises(KeyError, match=r"missing \['eval.auroc.counts'\], unexpected \['zzz'\]"):
        resumed.load_state_dict(
            {**{k: v for k, v in saved.items() if k != "eval.auroc.counts"}, "zzz": saved["loss.weight"]}
        )
    bad = dict(saved)
    bad["eval.cls.matrix"] = torch.zeros(4, 2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"'eval.cls.matrix' has shape \(4, 2, 2\), expected \(5, 2, 2\)"):
        resumed.load_state_dict(bad)


def test_reset_restores_defaults() -> None:
    compose = catalogue()
    fresh = catalogue().state_dict()
    compose.update(catalogue_inputs(17))
    compose.reset()
    for key, value in compose.state_dict().items():
        assert torch.equal(value, fresh[key]), key


def test_to_scalars_flattens_nested_values() -> None:
    values = {"a": {"b": torch.tensor(1.5), "c": torch.tensor([1.0, 2.0])}, "d": 3}
    assert to_scalars(values) == {"a/b": 1.5, "a/c/0": 1.0, "a/c/1": 2.0, "d": 3.0}
    with pytest.raises(TypeError, match="'a/x' is a str"):
        to_scalars({"a": {"x": "text"}})


def test_collector_without_distributed_computes_windows_in_order() -> None:
    metric = ComposeMetric({"mean": MeanMetric(), "sum": SumMetric()})
    with AsyncMetricCollector(metric) as collector:
        metric.update({"mean": torch.tensor([1.0, 3.0]), "sum": torch.tensor(5.0)})
        collector.schedule(1, reset=True)
        metric.update({"mean": torch.tensor([10.0]), "sum": torch.tensor(1.0)})
        collector.schedule(2)  # no reset: the live metric keeps accumulating
        metric.update({"sum": torch.tensor(1.0)})
        collector.schedule(3)
        got = collector.results(wait=True)
    assert [step for step, _ in got] == [1, 2, 3]
    assert [to_scalars(v) for _, v in got] == [
        {"mean": 2.0, "sum": 5.0},
        {"mean": 10.0, "sum": 1.0},
        {"mean": 10.0, "sum": 2.0},
    ]
    assert collector.results() == []


class Perplexity(Metric[torch.Tensor]):
    """The custom-metric example of docs/metrics.md, verbatim."""

    def __init__(self) -> None:
        super().__init__()
        self.nll = self.add_state("nll", torch.zeros((), dtype=torch.float64), "sum")
        self.tokens = self.add_state("tokens", torch.zeros((), dtype=torch.int64), "sum")

    def update(self, nll_sum: torch.Tensor, num_tokens: torch.Tensor | int) -> None:
        self.nll.value += nll_sum.detach().to(self.device, torch.float64)
        self.tokens.value += torch.as_tensor(num_tokens, device=self.device)

    def compute(self) -> torch.Tensor:
        return torch.exp(self.nll.value / self.tokens.value)


def test_custom_metric_from_the_guide() -> None:
    g = _gen(19)
    nll = [torch.rand(n, generator=g) * 5 for n in (7, 3, 12)]
    metric = Perplexity()
    for chunk in nll:
        metric.update(chunk.sum(), chunk.numel())
    sums = [float(chunk.sum()) for chunk in nll]  # the float32 sums the metric is fed, added in float64
    _close(metric.compute(), np.exp(sum(sums) / sum(c.numel() for c in nll)), atol=1e-12)
    assert set(metric.state_dict()) == {"nll", "tokens"}
    metric.reset()
    assert metric.tokens.value == 0
    with pytest.raises(ValueError, match="already has a state named 'nll'"):
        metric.add_state("nll", torch.zeros(()), "sum")
    with pytest.raises(ValueError, match=r"dtype torch\.bool cannot be reduced"):
        metric.add_state("flag", torch.zeros((), dtype=torch.bool), "max")
    with pytest.raises(ValueError, match="reduction must be one of"):
        metric.add_state("x", torch.zeros(()), "mean")  # type: ignore[arg-type]


class _Failing(SumMetric):
    def compute(self) -> torch.Tensor:
        raise RuntimeError("compute exploded")


def test_collector_raises_worker_failures_in_results() -> None:
    collector = AsyncMetricCollector(_Failing())
    collector.schedule(0)
    with pytest.raises(RuntimeError, match="compute exploded"):
        collector.close()


@pytest.mark.gpu
def test_collector_on_cuda_matches_cpu() -> None:
    g = _gen(18)
    inputs = [catalogue_inputs(int(s)) for s in torch.randint(0, 1000, (3,), generator=g)]
    cpu, gpu = catalogue(), catalogue().to("cuda")
    with AsyncMetricCollector(gpu) as collector:
        for i, b in enumerate(inputs):
            cpu.update(b)
            gpu.update(b)
            collector.schedule(i)
        got = collector.results(wait=True)
    assert gpu.device.type == "cuda"
    assert_trees_close(got[-1][1], cpu.compute())
