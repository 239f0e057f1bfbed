"""The GPU kernel choices the tracer forces on its CPU-device fake tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from service.core.libs.bitsandbytes import uses_dequant_fallback  # noqa: E402
from service.core.spec import SdpaKernel  # noqa: E402
from service.trace import kernels  # noqa: E402
from service.trace.tracker import StorageTracker  # noqa: E402

pytestmark = pytest.mark.trace

AUTO = SdpaKernel.AUTO


@pytest.mark.parametrize(
    ("requested", "dtype", "head_dim", "mask", "chosen"),
    [
        (AUTO, torch.bfloat16, 128, False, SdpaKernel.FLASH),
        (AUTO, torch.float16, 256, False, SdpaKernel.FLASH),
        (AUTO, torch.float32, 128, False, SdpaKernel.EFFICIENT),  # kbit prep's fp32 stream
        (AUTO, torch.bfloat16, 128, True, SdpaKernel.EFFICIENT),  # a sliding-window mask
        (AUTO, torch.bfloat16, 512, False, SdpaKernel.EFFICIENT),
        (SdpaKernel.EFFICIENT, torch.bfloat16, 128, False, SdpaKernel.EFFICIENT),
        (SdpaKernel.MATH, torch.bfloat16, 128, False, SdpaKernel.MATH),
    ],
)
def test_sdpa_backend_choice_follows_cuda(
    requested: SdpaKernel, dtype: torch.dtype, head_dim: int, mask: bool, chosen: SdpaKernel
) -> None:
    got = kernels.choose_sdpa_kernel(requested, dtype=dtype, head_dim=head_dim, has_mask=mask)
    assert got is chosen


# torch._fused_sdp_choice's codes (torch.nn.attention.SDPBackend): math, flash, efficient, cuDNN.
_MATH, _FLASH, _EFFICIENT, _CUDNN = 0, 1, 2, 3
_H200 = Path(__file__).resolve().parents[1] / "data" / "gpu" / "h200_environment.json"


def _h200_choices() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = json.loads(_H200.read_text())["sdpa_choices"]
    return rows


@pytest.mark.parametrize(
    "row",
    _h200_choices(),
    ids=lambda r: f"{r['dtype']}-d{r['head_dim']}-{r['mask']}-gqa{int(bool(r['enable_gqa']))}",
)
def test_the_tracer_picks_what_the_pinned_torch_picked_on_an_h200(row: dict[str, object]) -> None:
    """Every case torch._fused_sdp_choice answered on an H200 (fp32/bf16/fp16 x no mask,
    boolean or additive mask x grouped key/value heads or not x head dims 64-256): the tracer
    picks the same kernel, or for cuDNN's the one that keeps the same tensors (flash's
    without a mask, the mem-efficient kernel's with one: the mask as a saved bias)."""
    dtype = getattr(torch, str(row["dtype"]).removeprefix("torch."))
    has_mask = row["mask"] != "none"
    expected = {
        _MATH: SdpaKernel.MATH,
        _FLASH: SdpaKernel.FLASH,
        _EFFICIENT: SdpaKernel.EFFICIENT,
        _CUDNN: SdpaKernel.EFFICIENT if has_mask else SdpaKernel.FLASH,
    }[int(row["choice"])]  # type: ignore[call-overload]
    got = kernels.choose_sdpa_kernel(
        AUTO,
        dtype=dtype,
        head_dim=int(row["head_dim"]),  # type: ignore[call-overload]
        has_mask=has_mask,
        gqa=bool(row["enable_gqa"]) and row["kv_heads"] != row["heads"],
    )
    assert got is expected


def test_flash_cannot_be_forced_where_cuda_has_no_flash_kernel() -> None:
    with pytest.raises(ValueError, match="flash"):
        kernels.choose_sdpa_kernel(
            SdpaKernel.FLASH, dtype=torch.float32, head_dim=64, has_mask=False
        )


def test_a_value_head_dim_unlike_the_query_s_leaves_flash() -> None:
    """Multi-head latent attention (DeepSeek-V2/V3: q and k 192, v 128): check_head_dim_size_flash
    wants one head dim for all three, the mem-efficient kernel does not."""
    got = kernels.choose_sdpa_kernel(
        AUTO, dtype=torch.bfloat16, head_dim=192, has_mask=False, value_head_dim=128
    )
    assert got is SdpaKernel.EFFICIENT
    with pytest.raises(ValueError, match="flash"):
        kernels.choose_sdpa_kernel(
            SdpaKernel.FLASH, dtype=torch.bfloat16, head_dim=192, has_mask=False, value_head_dim=128
        )


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "dequantizes"),
    [
        (8192, 3584, 3584, True),  # b4 s2048: above every threshold
        (2048, 512, 896, True),  # small weight, but above 1536 rows
        (1024, 3584, 18944, True),  # large weight above 512 rows
        (512, 3584, 18944, False),  # b1 s512: the fused kernel
        (1024, 128, 896, False),  # small weight under 1536 rows
        (4, 3584, 3584, False),
    ],
)
def test_4bit_matmul_takes_the_dequantize_path_for_training_sized_inputs(
    rows: int, out_features: int, in_features: int, dequantizes: bool
) -> None:
    assert uses_dequant_fallback(rows, out_features, in_features) is dequantizes


def test_flash_attention_saves_q_k_v_output_and_fp32_logsumexp_and_nothing_on_the_host() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    b, heads, kv_heads, s, d = 2, 8, 2, 256, 64
    with FakeTensorMode():
        q = torch.empty(b, heads, s, d, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(b, kv_heads, s, d, dtype=torch.bfloat16, requires_grad=True)
        v = torch.empty(b, kv_heads, s, d, dtype=torch.bfloat16, requires_grad=True)
        tracker = StorageTracker()
        tracker.mark_host_outputs(kernels.FLASH_OP, kernels.FLASH_HOST_OUTPUTS)
        with tracker:
            sdpa = kernels.make_sdpa(SdpaKernel.AUTO)
            out = sdpa(q, k, v, is_causal=True, enable_gqa=True)
            # The output and the log-sum-exp: key/value heads are not expanded.
            assert tracker.total == b * heads * s * d * 2 + b * heads * s * 4
            out.sum().backward()
            assert q.grad is not None and k.grad is not None
            assert k.grad.shape == k.shape
        tracker.close()


def test_dropout_saves_a_one_byte_mask_as_on_cuda() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    dropout = kernels.make_dropout(torch.nn.functional.dropout)
    with FakeTensorMode():
        x = torch.empty(1024, 64, requires_grad=True)  # 256 KiB of fp32
        tracker = StorageTracker()
        with tracker:
            y = dropout(x, 0.1, True)
            assert tracker.total == 1024 * 64 * 4 + 1024 * 64  # the output and a bool mask
            assert dropout(x, 0.0, True) is x
            assert dropout(x, 0.1, False) is x
        tracker.close()
        del y


def test_a_grouped_matmul_runs_in_fp32_as_on_cuda_and_allocates_its_output_only() -> None:
    """MoE experts that kbit preparation cast to fp32 run the grouped GEMM in fp32 on CUDA
    (its fallback, one mm per expert); torch's own meta kernel would refuse them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with kernels.gpu_kernels(AUTO), FakeTensorMode():
        tokens, d_in, d_out, experts = 96, 64, 32, 4
        x = torch.empty(tokens, d_in, requires_grad=True)
        weight = torch.empty(experts, d_in, d_out)  # frozen, like the experts under QLoRA
        offs = torch.tensor([24, 48, 72, 96], dtype=torch.int32)
        tracker = StorageTracker()
        with tracker:
            out = torch.nn.functional.grouped_mm(x, weight, offs=offs)
            assert out.dtype == torch.float32
            assert tracker.total == tokens * d_out * 4
            out.sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape and x.grad.dtype == torch.float32
        with pytest.raises(RuntimeError, match="one dtype"):
            torch.nn.functional.grouped_mm(x.to(torch.bfloat16), weight, offs=offs)
        tracker.close()


def test_one_key_value_head_without_enable_gqa_runs_on_the_math_kernel_only() -> None:
    """Falcon-7B hands SDPA one key/value head and no enable_gqa: CUDA's flash and
    mem-efficient kernels need equal head counts then, so math runs it, broadcasting."""
    for requested in (AUTO, SdpaKernel.MATH):
        chosen = kernels.choose_sdpa_kernel(
            requested, dtype=torch.bfloat16, head_dim=64, has_mask=True, broadcast_heads=True
        )
        assert chosen is SdpaKernel.MATH
    with pytest.raises(ValueError, match="math"):
        kernels.choose_sdpa_kernel(
            SdpaKernel.EFFICIENT,
            dtype=torch.bfloat16,
            head_dim=64,
            has_mask=True,
            broadcast_heads=True,
        )
    q = torch.randn(1, 4, 8, 16)
    k, v = torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16)
    got = kernels.make_sdpa(AUTO)(q, k, v, is_causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.expand(1, 4, 8, 16), v.expand(1, 4, 8, 16), is_causal=True
    )
    assert torch.allclose(got, expected, atol=1e-5)


def test_an_int8_linear_runs_matmul8bitlt_with_cuda_s_temporaries_and_keeps_its_input() -> None:
    """LLM.int8 on a fake CPU tensor: MatMul8bitLt (not the CPU path), the fp16 input copy,
    the threshold mask and the int32 product as CUDA allocates them, and the input held by
    the autograd node until backward, which dequantizes the weight to the input's dtype."""
    import bitsandbytes as bnb
    from torch._subclasses.fake_tensor import FakeTensorMode

    tokens, d_in, d_out = 512, 256, 1024
    with FakeTensorMode():
        x = torch.empty(tokens, d_in, dtype=torch.bfloat16, requires_grad=True)
        state = bnb.MatmulLtState()
        state.threshold = 6.0  # BitsAndBytesConfig's llm_int8_threshold
        state.has_fp16_weights = False  # as Linear8bitLt sets it for a frozen int8 base
        state.CB = torch.empty(d_out, d_in, dtype=torch.int8)
        state.SCB = torch.empty(d_out, dtype=torch.float32)
        weight = torch.nn.Parameter(state.CB, requires_grad=False)
        tracker = StorageTracker()
        tracker.rewrite(
            "bitsandbytes.int8_vectorwise_quant.default", kernels.int8_vectorwise_quant_cuda
        )
        tracker.rewrite(
            "bitsandbytes.int8_mixed_scaled_mm.default", kernels.int8_mixed_scaled_mm_cuda
        )
        tracker.rewrite("bitsandbytes.int8_scaled_mm.default", kernels.int8_scaled_mm_cuda)
        with tracker, kernels.quiet_logger("bitsandbytes.autograd._functions"):
            out = kernels.matmul_8bit_cuda(x, weight, state=state)
            assert out.dtype == torch.bfloat16 and out.shape == (tokens, d_out)
            # what is left is the output alone: the input was made outside the tracker
            assert tracker.total == tokens * d_out * 2
            # the highest moment: the int32 product, its fp16 dequantization and the bf16 cast,
            # beside the int8 rows of the input and their fp32 scales
            peak = tokens * d_out * (4 + 2 + 2) + tokens * d_in + tokens * 4
            assert tracker.peak().allocated_bytes == peak
            # the node holds the input as an attribute, out of checkpointing's reach
            assert out.grad_fn.tensors[2] is x
            out.sum().backward()
        assert x.grad is not None and x.grad.dtype == torch.bfloat16
        tracker.close()


def test_a_packed_row_s_sequences_are_found_as_transformers_finds_them() -> None:
    """The tracer's stand-in for the packed-sequence detection gives each token the sequence
    index transformers' own function gives it on real position ids; on fake tensors it is the
    same computation, without the check that reads their values."""
    from transformers import masking_utils

    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [5, 6, 7, 0, 1, 2, 3, 0, 1]])
    real = masking_utils.find_packed_sequence_indices(position_ids)
    assert real is not None
    assert torch.equal(kernels.packed_batch(position_ids), real)
    assert kernels.packed_batch(position_ids)[0].tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
