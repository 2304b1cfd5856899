from __future__ import annotations

import textwrap

import pytest
import torch

from d9d.kernels.stochastic_rounding import (
    AdamWScalars,
    RoundingStream,
    Target,
    adamw_step_torch,
    philox4x32,
    philox_bits16,
    resolve_backend,
    stochastic_round_bf16,
)
from tests.triton_interpreter import run_in_interpreter


def _words(counter: tuple[int, int, int, int], key: tuple[int, int]) -> list[int]:
    c = tuple(torch.tensor([v], dtype=torch.int64) for v in counter)
    return [int(w) for w in philox4x32(c, key)]  # type: ignore[arg-type]


def test_philox_matches_random123_known_answers() -> None:
    # Known-answer vectors published with Random123 (kat_vectors, philox4x32 with 10 rounds).
    assert _words((0, 0, 0, 0), (0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    full = 0xFFFFFFFF
    assert _words((full,) * 4, (full, full)) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert _words((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == [
        0xD16CFE09,
        0x94FDCCEB,
        0x5001E420,
        0x24126EA1,
    ]


def test_bits_depend_only_on_the_global_element_index() -> None:
    whole = philox_bits16(1000, 0, (3, 1, 0), seed=42, device=torch.device("cpu"))
    assert whole.dtype == torch.int32
    assert int(whole.min()) >= 0
    assert int(whole.max()) < 2**16
    for first, numel in [(5, 20), (8, 100), (997, 3), (13, 0)]:
        part = philox_bits16(numel, first, (3, 1, 0), seed=42, device=torch.device("cpu"))
        assert torch.equal(part, whole[first : first + numel])
    other_step = philox_bits16(1000, 0, (4, 1, 0), seed=42, device=torch.device("cpu"))
    other_seed = philox_bits16(1000, 0, (3, 1, 0), seed=43, device=torch.device("cpu"))
    # Independent streams agree on about 1/65536 of the elements.
    assert int((whole == other_step).sum()) < 5
    assert int((whole == other_seed).sum()) < 5


def test_bits_are_uniform() -> None:
    bits = philox_bits16(2**16, 0, (1, 0, 0), seed=7, device=torch.device("cpu"))
    counts = torch.bincount(bits >> 12, minlength=16).double()  # 16 bins of the top nibble
    expected = bits.numel() / 16
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 40.0  # chi-square, 15 dof: P(> 40) ~ 5e-4
    low_bit = (bits & 1).double().mean().item()
    assert abs(low_bit - 0.5) < 5 * 0.5 / 2**8


def test_mean_of_rounded_copies_equals_the_fp32_value() -> None:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(64, generator=generator, dtype=torch.float64).float() * 3
    values[0] = 1.0 + 2**-9  # exactly half an ulp above 1.0
    values[1] = -(1.0 + 3 * 2**-10)  # negative, three quarters of an ulp
    copies = 20_000
    x = values.repeat_interleave(copies)
    bits = RoundingStream(seed=123, step=1, tensor_index=0).bits16(x.numel(), Target.PARAM, x.device)
    rounded = stochastic_round_bf16(x, bits).double().view(64, copies)

    nearest = values.bfloat16().double()
    truncated = (values.view(torch.int32) & -65536).view(torch.float32).double()  # toward zero
    _, exponent = torch.frexp(truncated)  # |t| = mantissa * 2**exponent, mantissa in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(truncated), exponent - 8)  # bf16 keeps 8 significant bits
    above = truncated + torch.sign(values.double()) * ulp
    assert bool(((rounded == truncated[:, None]) | (rounded == above[:, None])).all())

    fraction = ((values.double() - truncated) / (above - truncated)).abs()
    std_of_mean = (fraction * (1 - fraction)).sqrt() * ulp / copies**0.5
    error = (rounded.mean(dim=1) - values.double()).abs()
    assert bool((error <= 5 * std_of_mean + 1e-12).all()), (error / std_of_mean).max()
    # Round-to-nearest is biased by up to half an ulp: the bound above would reject it.
    assert bool(((nearest - values.double()).abs() > 5 * std_of_mean + 1e-12).any())


def test_special_values_survive_rounding() -> None:
    x = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -2.5, 3.0e38, 1e-40])
    for bits in (torch.zeros(9, dtype=torch.int32), torch.full((9,), 2**16 - 1, dtype=torch.int32)):
        out = stochastic_round_bf16(x, bits)
        assert out.dtype == torch.bfloat16
        assert torch.isnan(out[4])
        exact = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1.0, -2.5])
        assert torch.equal(out[[0, 1, 2, 3, 5, 6]].float(), exact)
        assert torch.equal(torch.signbit(out[:2]), torch.tensor([False, True]))
    with pytest.raises(TypeError, match="float32"):
        stochastic_round_bf16(x.double(), torch.zeros(9, dtype=torch.int32))


def test_backend_choice() -> None:
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("torch", torch.device("cuda")) == "torch"
    assert resolve_backend("triton", torch.device("cpu")) == "triton"
    with pytest.raises(ValueError, match="backend='cuda'"):
        resolve_backend("cuda", torch.device("cpu"))  # type: ignore[arg-type]


def test_reference_rejects_bad_operands() -> None:
    scalars = AdamWScalars(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1)
    stream = RoundingStream(seed=0, step=1, tensor_index=0)
    p = torch.zeros(4, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"param dtype torch\.float16"):
        adamw_step_torch(p, p, p.float(), p.float(), scalars, stream)
    p = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"exp_avg_sq shape \(5,\) differs"):
        adamw_step_torch(p, p, torch.zeros(4), torch.zeros(5), scalars, stream)
    with pytest.raises(ValueError, match="step=0"):
        AdamWScalars(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=0)
    with pytest.raises(ValueError, match="seed=-1"):
        RoundingStream(seed=-1, step=1, tensor_index=0)


# Runs in a fresh interpreter: Triton decides between compiling and interpreting when `@triton.jit`
# decorates, reading TRITON_INTERPRET at that moment, so it must be set before the kernel module imports.
_INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch
    from d9d.kernels.stochastic_rounding import AdamWScalars, RoundingStream, adamw_step_torch
    from d9d.kernels.stochastic_rounding.adamw_triton import adamw_step_triton

    def bits(t):
        return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)

    generator = torch.Generator().manual_seed(0)
    cases = [
        (torch.bfloat16, torch.float32, 1000, 0, 0, 1),
        (torch.bfloat16, torch.bfloat16, 2500, 13, 0, 7),
        (torch.float32, torch.bfloat16, 77, 5, 3, 2),
        (torch.bfloat16, torch.float32, 1, 1_000_003, 1, 1),
    ]
    for param_dtype, state_dtype, numel, first_index, shard, step in cases:
        p = (torch.randn(numel, generator=generator) * 2).to(param_dtype)
        g = torch.randn(numel, generator=generator).to(param_dtype)
        m = (torch.randn(numel, generator=generator) * 0.1).to(state_dtype)
        v = (torch.rand(numel, generator=generator) * 0.01).to(state_dtype)
        scalars = AdamWScalars(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step)
        stream = RoundingStream(2**63 + 12345, step, 9, first_index, shard)
        ref = [t.clone() for t in (p, g, m, v)]
        out = [t.clone() for t in (p, g, m, v)]
        adamw_step_torch(*ref, scalars, stream)
        adamw_step_triton(*out, scalars, stream)
        for name, a, b in zip(("param", "grad", "exp_avg", "exp_avg_sq"), ref, out):
            assert torch.equal(bits(a), bits(b)), (name, param_dtype, state_dtype, numel)
        assert not torch.equal(bits(ref[0]), bits(p)), "the update must change the parameter"
        if param_dtype == torch.bfloat16 and numel > 1:
            other = [t.clone() for t in (p, g, m, v)]
            adamw_step_triton(*other, scalars, RoundingStream(12345, step, 9, first_index, shard))
            assert not torch.equal(bits(other[0]), bits(ref[0])), "another seed must round differently"
    print("interpreter ok")
    """
)


def test_triton_kernel_matches_reference_bitwise_in_the_interpreter() -> None:
    run_in_interpreter(_INTERPRETER_CHECK)


@pytest.mark.gpu
def test_triton_kernel_on_cuda_matches_reference() -> None:
    from d9d.kernels.stochastic_rounding.adamw_triton import adamw_step_triton

    generator = torch.Generator().manual_seed(0)
    for param_dtype, state_dtype in [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]:
        numel = 1_000_003
        tensors = [
            (torch.randn(numel, generator=generator) * 2).to(param_dtype),
            torch.randn(numel, generator=generator).to(param_dtype),
            (torch.randn(numel, generator=generator) * 0.1).to(state_dtype),
            (torch.rand(numel, generator=generator) * 0.01).to(state_dtype),
        ]
        scalars = AdamWScalars(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=4)
        stream = RoundingStream(2024, 4, 3, first_index=21)
        ref = [t.cuda() for t in tensors]
        out = [t.cuda() for t in tensors]
        adamw_step_torch(*ref, scalars, stream)
        adamw_step_triton(*out, scalars, stream)
        torch.cuda.synchronize()
        for name, a, b in zip(
            ("param", "exp_avg", "exp_avg_sq"),
            (ref[0], ref[2], ref[3]),
            (out[0], out[2], out[3]),
            strict=True,
        ):
            if a.dtype == torch.float32:
                # The GPU contracts a*x + b*y into an FMA; where the result cancels towards zero the two
                # differ by about one ulp of the *operands* (|terms| <= ~0.5 here), not of the result.
                torch.testing.assert_close(b, a, rtol=2e-6, atol=1e-7)
                continue
            # Same random bits; the fp32 values may differ by an operand ulp (FMA), which flips a rounding
            # rarely: to the neighbouring bf16 value, or across zero where the result cancels. Compare values.
            a64, b64 = a.double(), b.double()
            diff = (a64 - b64).abs()
            ulp = torch.maximum(a64.abs(), b64.abs()) * 2.0**-7
            assert bool((diff <= torch.maximum(ulp, torch.full_like(ulp, 1e-7))).all()), name
            assert float((diff > 0).double().mean()) < 1e-3, name
