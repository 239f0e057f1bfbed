"""CUDA's autocast policy, emulated on CPU tensors (service/trace/autocast.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from service.trace.autocast import (  # noqa: E402
    cuda_autocast_policy,
    cuda_ops,
    registered,
)

pytestmark = pytest.mark.trace

BF16 = torch.bfloat16


def test_the_policy_covers_exactly_the_ops_cuda_registers_autocast_kernels_for() -> None:
    assert cuda_ops() == registered("AutocastCUDA")


def test_each_policy_casts_as_cuda_does() -> None:
    weight = torch.randn(8, 3, requires_grad=True)
    x16 = torch.randn(4, 8, dtype=BF16)
    x32 = torch.randn(4, 3)
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=BF16):
        assert (x16 @ weight).dtype == BF16  # lower_precision_fp: matmul
        assert torch.nn.functional.linear(x32, weight).dtype == BF16
        assert torch.exp(x16).dtype == torch.float32  # fp32
        assert x16.pow(2).dtype == torch.float32
        assert torch.rsqrt(x16.abs() + 1).dtype == torch.float32
        assert torch.softmax(x16, -1).dtype == torch.float32  # fp32_set_opt_dtype
        assert torch.softmax(x16, -1, dtype=BF16).dtype == BF16  # an explicit dtype stays
        assert x16.sum().dtype == torch.float32
        assert torch.addcmul(torch.randn(4, 8), x16, x16).dtype == torch.float32  # promote
        # ops CPU autocast casts and CUDA's does not run as they are
        assert torch.cat([x16, x16]).dtype == BF16
        assert x16.mean().dtype == BF16
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            torch.nn.functional.binary_cross_entropy(torch.rand(3), torch.rand(3))


def test_weights_are_cast_once_per_region_and_the_copy_is_dropped_at_its_end() -> None:
    weight = torch.randn(8, 3, requires_grad=True)
    x = torch.randn(4, 8)
    with cuda_autocast_policy():
        with torch.autocast("cpu", dtype=BF16):
            first, second = x @ weight, x @ weight
            copies = {id(fn.next_functions[1][0]) for fn in (first.grad_fn, second.grad_fn)}
            assert len(copies) == 1  # the same cached cast feeds both products
        with torch.autocast("cpu", dtype=BF16):
            third = x @ weight
        assert id(third.grad_fn.next_functions[1][0]) not in copies


def test_libraries_see_cuda_autocast_inside_and_cpu_autocast_after() -> None:
    with cuda_autocast_policy():
        assert not torch.is_autocast_enabled()
        with torch.autocast("cpu", dtype=BF16):
            assert torch.is_autocast_enabled()  # PEFT's question, about CUDA
            assert torch.is_autocast_enabled("cuda")
            assert torch.get_autocast_dtype("cuda") == BF16
            assert torch.get_autocast_gpu_dtype() == BF16
    with torch.autocast("cpu", dtype=BF16):
        assert not torch.is_autocast_enabled("cuda")
        assert torch.exp(torch.randn(2, dtype=BF16)).dtype == BF16  # CPU's own policy again
