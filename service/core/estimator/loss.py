"""The logits and the loss: what they keep and their peaks."""

from __future__ import annotations

from typing import NamedTuple

from service.core.arch import ModelArch
from service.core.estimator.ledger import _blk
from service.core.libs.bitsandbytes import NF4_BLOCK
from service.core.liger import liger_chunk_rows
from service.core.spec import Framework, LossImpl, Method, ResolvedSpec
from service.core.units import (
    AUTOCAST_BYTES,
    BOOL_BYTES,
    DTYPE_BYTES,
    FP32_BYTES,
    INT64_BYTES,
    DType,
)

# torchtune CEWithChunkedOutputLoss splits the sequence in 8 chunks
# (torchtune/modules/loss/ce_chunked_output_loss.py num_output_chunks=8).
TORCHTUNE_CE_CHUNKS = 8
# LitGPT's chunked lm_head + cross-entropy over 128 tokens (litgpt/finetune/lora.py,
# lm_head_chunk_size=128; litgpt/utils.py chunked_cross_entropy chunk_size=128).
LITGPT_CE_CHUNK_TOKENS = 128
# What LitGPT's LoRA fine-tuning keeps beyond an HF + PEFT step, read from the sources behind its
# published resource tables (lit-gpt commit 8641822 with lightning 71aed751 and bitsandbytes
# 0.41.1) and checked tensor by tensor against a storage trace of those sources:
# * Fabric's _FabricModule.forward ends with precision.convert_output(), which casts every
#   floating output to torch.get_default_dtype(), fp32 (lightning/fabric/plugins/precision/
#   half.py and bitsandbytes.py convert_output): the bf16 lm_head chunks become an fp32 list that
#   finetune/lora.py keeps as `logits` through backward, and chunked_cross_entropy's log_softmax
#   saves fp32 chunks.
LITGPT_LOGITS_BYTES = FP32_BYTES
# * bitsandbytes 0.41.1 MatMul4Bit (autograd/_functions.py) computes
#   F.linear(A, dequantize_4bit(B, state).to(A.dtype).t()) in forward and again in backward:
#   the weight in the quant_state dtype and its cast to the compute dtype exist together. The
#   quant_state dtype is fp16 because lightning's _Linear4bit._quantize_weight casts the weight
#   to half before quantize_4bit.
LITGPT_QUANT_STATE_BYTES = DTYPE_BYTES[DType.FP16]


class _LossBytes(NamedTuple):
    forward_peak: int  # extra live bytes at the loss's forward peak
    saved: int  # kept from the end of forward into backward
    backward_peak: int  # live bytes at the loss gradient


def _loss_bytes(arch: ModelArch, rs: ResolvedSpec, b: int, s: int) -> _LossBytes:
    v = arch.vocab_size
    head = (
        FP32_BYTES
        if (rs.spec.method is Method.QLORA and rs.quantization and rs.quantization.prepare_kbit)
        else DTYPE_BYTES[rs.spec.dtype]
    )
    tokens = b * s
    softcap = arch.final_logit_softcapping is not None
    if rs.spec.liger_kernel:
        return _liger_loss_bytes(arch, rs, b, s, head)
    if rs.loss is LossImpl.FUSED:
        # Fused linear cross-entropy never materialises b*s*V (Liger, Cut Cross-Entropy).
        return _LossBytes(forward_peak=0, saved=0, backward_peak=0)
    if rs.loss is LossImpl.CHUNKED:
        if rs.spec.framework.value == "torchtune":
            chunk = -(-tokens // TORCHTUNE_CE_CHUNKS)
            # torchtune keeps every chunk's logits (model dtype) for backward and upcasts one
            # chunk at a time to fp32.
            saved = _blk(tokens * v * head)
            return _LossBytes(
                forward_peak=saved + 2 * _blk(chunk * v * FP32_BYTES),
                saved=saved + TORCHTUNE_CE_CHUNKS * _blk(chunk * v * FP32_BYTES),
                backward_peak=saved
                + TORCHTUNE_CE_CHUNKS * _blk(chunk * v * FP32_BYTES)
                + 2 * _blk(chunk * v * FP32_BYTES),
            )
        if rs.spec.framework is Framework.LITGPT:
            return _litgpt_loss_bytes(arch, rs, b, s, head)
        chunk = min(tokens, b * LITGPT_CE_CHUNK_TOKENS)
        per_chunk = _blk(chunk * v * head)
        n_chunks = -(-tokens // chunk)
        saved = n_chunks * 2 * per_chunk
        return _LossBytes(
            forward_peak=saved + per_chunk, saved=saved, backward_peak=saved + 2 * per_chunk
        )
    weight_copy = 0
    if rs.spec.autocast:
        # Autocast runs the LM head in half precision: half logits, and a half copy of a weight
        # that is not (fp32 after kbit preparation, or an fp32 model), saved by the matmul
        # until the head's backward (not cached: a frozen weight needs no grad).
        if head != AUTOCAST_BYTES:
            weight_copy = _blk(v * arch.hidden_size * AUTOCAST_BYTES)
        head = AUTOCAST_BYTES
    logits = _blk(tokens * v * head)
    cap = _blk(tokens * v * head) if softcap else 0  # tanh output saved (Gemma-2 softcap)
    if rs.loss is LossImpl.PLAIN:
        logp = _blk(tokens * v * head)
        return _LossBytes(
            forward_peak=weight_copy + logits + cap + logp,
            saved=weight_copy + logp + cap,
            backward_peak=weight_copy + logp + cap + 2 * logp,
        )
    # Cross-entropy in transformers' ForCausalLMLoss (loss/loss_utils.py): logits.float() then
    # F.cross_entropy. Live per logit element at the end of forward: the logits, their fp32
    # copy and the fp32 log-probs; at the start of backward: the saved log-probs, NLL's
    # gradient and LogSoftmax's gradient (fp32).
    # logits.float() is a no-op (no copy) when the head already runs in fp32 (kbit prep).
    upcast = _blk(tokens * v * FP32_BYTES) if head != FP32_BYTES else 0
    logp = _blk(tokens * v * FP32_BYTES)
    return _LossBytes(
        forward_peak=weight_copy + logits + cap + upcast + logp,
        saved=weight_copy + logp + cap,
        backward_peak=weight_copy + logp + cap + 2 * logp,
    )


def _liger_loss_bytes(arch: ModelArch, rs: ResolvedSpec, b: int, s: int, head: int) -> _LossBytes:
    """LigerForCausalLMLoss and LigerFusedLinearCrossEntropyFunction (liger-kernel 0.8.2,
    transformers/model/loss_utils.py, ops/fused_linear_cross_entropy.py): the labels padded by
    one position and their shifted contiguous copy (int64); the forward computes the gradients
    chunk by chunk and saves them for backward: the input's (zeros_like of the hidden states)
    and, when the LM head trains, the weight's (zeros_like of the weight, accum_dtype None);
    beside them an fp32 loss per token and the label mask. Each chunk's logits (chunk rows x V,
    the hidden states' dtype) are overwritten with their gradient in place; the input's slice
    of gradient is a GEMM's output copied in; the weight's is `grad_weight += mm(...).float()`
    (the fp32-out addmm path needs an fp32 accumulator): the product in the weight's dtype and
    its fp32 copy exist together. Backward scales the saved gradients in place."""
    v, h = arch.vocab_size, arch.hidden_size
    tokens = b * s
    head_trains = rs.spec.method is Method.FULL
    grad_input = _blk(tokens * h * head)
    grad_weight = _blk(v * h * head) if head_trains else 0
    saved = grad_input + grad_weight
    labels = _blk(b * (s + 1) * INT64_BYTES) + _blk(tokens * INT64_BYTES)
    per_token = _blk(tokens * FP32_BYTES) + _blk(tokens * BOOL_BYTES)
    rows = liger_chunk_rows(tokens, v, h)
    chunk = _blk(rows * v * head)
    slice_grad = _blk(rows * h * head)
    weight_grad_step = _blk(v * h * head) + _blk(v * h * FP32_BYTES) if head_trains else 0
    return _LossBytes(
        forward_peak=saved + labels + per_token + chunk + max(slice_grad, weight_grad_step),
        saved=saved,
        backward_peak=saved,
    )


def _litgpt_dequant_bytes(in_features: int, out_features: int, rs: ResolvedSpec) -> int:
    """Transient bytes of one bitsandbytes 0.41.1 4-bit matmul in LitGPT: the weight dequantized
    in the quant_state dtype (fp16) and its cast to the compute dtype, alive together; double
    quant first rebuilds the fp32 absmax (functional.dequantize_4bit: dequantize_blockwise)."""
    n = in_features * out_features
    quant = rs.quantization
    nested = _blk(-(-n // NF4_BLOCK) * FP32_BYTES) if quant and quant.double_quant else 0
    return _blk(n * LITGPT_QUANT_STATE_BYTES) + _blk(n * DTYPE_BYTES[rs.compute_dtype]) + nested


def _litgpt_loss_bytes(arch: ModelArch, rs: ResolvedSpec, b: int, s: int, head: int) -> _LossBytes:
    """LitGPT finetune/lora.py: model(x, lm_head_chunk_size=128) returns (b, 128, V) chunks that
    Fabric casts to fp32 (kept by `logits` through backward); logits[-1] drops its last position;
    chunked_cross_entropy saves each chunk's fp32 log-probabilities. Backward first runs every
    chunk's cross-entropy (NLL's and log_softmax's gradients of one chunk at a time, each result
    then waiting for its cast node), then the casts back to bf16, then lm_head."""
    v, h = arch.vocab_size, arch.hidden_size
    full, rem = divmod(s, LITGPT_CE_CHUNK_TOKENS)
    sizes = [LITGPT_CE_CHUNK_TOKENS] * full + ([rem] if rem else [])
    shifted = [*sizes[:-1], sizes[-1] - 1]
    logits_half = sum(_blk(b * n * v * head) for n in sizes)
    logits = sum(_blk(b * n * v * LITGPT_LOGITS_BYTES) for n in sizes)
    logp = sum(_blk(b * n * v * LITGPT_LOGITS_BYTES) for n in shifted)
    chunk = _blk(b * sizes[0] * v * LITGPT_LOGITS_BYTES)
    # convert_output: the bf16 list and its fp32 copy; then the fp32 list and the log-probs.
    # LLaMA-Adapter v2's lm_head is an AdapterV2Linear: each chunk's adapter_scale * (linear +
    # adapter_bias) keeps the bf16 sum until the head's backward (lit_gpt/adapter_v2.py).
    v2_sums = logits_half if rs.spec.method is Method.LLAMA_ADAPTER_V2 else 0
    forward_peak = max(logits_half + logits, logits + logp) + v2_sums
    backward_peak = logits + logp + 2 * chunk + v2_sums
    if rs.spec.kbit_base and not arch.tie_word_embeddings:
        # The 4-bit lm_head dequantizes its weight for each chunk, forward and backward; its
        # backward comes after every chunk's gradient has been cast back to bf16.
        weight = _litgpt_dequant_bytes(h, v, rs)
        forward_peak = max(forward_peak, logits_half + weight)
        backward_peak = max(
            backward_peak,
            logits + logits_half + weight + _blk(b * sizes[0] * h * head) + v2_sums,
        )
    return _LossBytes(
        forward_peak=forward_peak, saved=logits + logp + v2_sums, backward_peak=backward_peak
    )
