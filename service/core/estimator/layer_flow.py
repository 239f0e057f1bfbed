"""How a layer's tensors flow for a job: the dtypes, sizes and choices its saves are made from."""

from __future__ import annotations

from dataclasses import dataclass

from service.core.arch import (
    Linear,
    LinearKind,
    ModelArch,
)
from service.core.estimator.adapter import (
    ADAPTER_PROMPT_LENGTH,
    is_adapter,
    is_v2,
)
from service.core.estimator.lora_targets import deepseek_lora_targets
from service.core.estimator.tuners import attention_trains, ln_tuning_targets, scaled_kinds
from service.core.estimator.weights import (
    expert_adapters,
)
from service.core.quant_formats import saves_dequantized_weight, saves_input
from service.core.spec import (
    DELTA_OPTIONS,
    LORA_METHODS,
    Framework,
    LoraSpec,
    Method,
    QuantType,
    ResolvedSpec,
)
from service.core.spec.delta import BoftSpec, LokrSpec, OftSpec
from service.core.units import (
    DTYPE_BYTES,
    FP32_BYTES,
    DType,
)


@dataclass(frozen=True, slots=True)
class LayerFlow:
    """Element sizes of the tensors flowing through a layer."""

    residual: int  # the residual stream
    norm_out: int  # what the norms hand to the linears
    attn: int  # q/k/v after RoPE, attention output
    adapter: int
    lora_targets: frozenset[str]
    full: bool
    r: int
    dropout: bool
    autocast: bool
    # q, k, v come from one fused projection, so the saved v view keeps its whole output alive.
    fused_qkv: bool
    quantized: bool
    # bitsandbytes <= 0.41 (MatMul4Bit.forward: ctx.tensors = (A, B)) kept the 4-bit
    # linear's input for backward; LitGPT's published QLoRA tables were measured with 0.41.1.
    # LLM.int8's MatMul8bitLt keeps it in every release (ctx.tensors = (CAt, subA, A)).
    quant_saves_input: bool
    # A GPTQ, AWQ, HQQ or torchao base (quant_formats.py): its type ('' for none), and the
    # bytes per element of the dequantized weight its matmul saves (GPTQ, torchao float8).
    packed: str = ""
    dequant_saved: int = 0
    # LitGPT's LoRAQKVLinear.zero_pad (lit_gpt/lora.py) index_copies the adapters' q/k/v output,
    # `zero_pad_width` features per token, into the fused qkv width when q, k and v are not all
    # adapted; index_copy's backward keeps that source (autograd's index_copy formula,
    # grad.index_select(dim, index).expand_as(source)). 0: no such copy.
    zero_pad_width: int = 0
    # LitGPT's CausalSelfAttention reshapes SDPA's (B, nh, T, hs) output to (B, T, C) through
    # y.transpose(1, 2).reshape(...), a copy: the output projection's input is its own storage.
    proj_input_copy: bool = False
    # The LM head is a 4-bit linear that keeps its input (LitGPT QLoRA with bitsandbytes 0.41.1).
    head_quantized: bool = False
    # PEFT adapts the experts' and the router's weights (`weights.expert_adapters`).
    expert_lora: bool = False
    # transformers' own modules run: a composite GELU (COMPOSITE_TANH_GELU) and Phi's residual
    # dropout (LitGPT and torchtune build their layers from fused ops, without that dropout).
    hf_modules: bool = True
    # PEFT's DoRA variant on every adapted linear (`_dora_saves`).
    dora: bool = False
    # (IA)^3: the linears whose output, and those whose input, a trainable vector scales
    # (`_ia3_saves`); LN tuning: the norms trained ("norm1", "norm2", "final").
    ia3_out: frozenset[str] = frozenset()
    ia3_in: frozenset[str] = frozenset()
    trained_norms: frozenset[str] = frozenset()
    # Something in the attention block trains: a first layer whose input takes no gradient
    # still records its attention for backward.
    attention_trains: bool = True
    # LoRA-FA: lora_A is frozen, so its matmul keeps no input for a weight gradient.
    frozen_a: bool = False
    # VeRA on the adapted linears instead of LoRA (`_vera_saves`).
    vera: bool = False
    # LoHa on the adapted linears instead of LoRA (`_loha_saves`).
    loha: bool = False
    # LoKr's options, on the adapted linears instead of LoRA (`_lokr_saves`).
    lokr: LokrSpec | None = None
    # AdaLoRA's SVD triplets on the adapted linears: LoRA's saves and the scaled A and the
    # rank divisor each matmul keeps (`_linear_saves`).
    adalora: bool = False
    # OFT's options, on the adapted linears instead of LoRA (`_oft_saves`).
    oft: OftSpec | None = None
    boft: BoftSpec | None = None  # BOFT's, likewise (`_boft_saves`)
    # LitGPT's LLaMA-Adapter: the prompt length when this layer attends to the adapter prompt
    # (0 below adapter_start_layer); v2: every linear's scale and bias (estimator/adapter.py).
    adapter_prompt: int = 0
    adapter_v2: bool = False
    # PEFT's prefix tuning: keys and values run behind the virtual tokens (estimator/prefix.py)
    prefix: bool = False
    # DeepSeek: which of the MoE block's parameters PEFT adapts ("router", "gate_up", "down";
    # `deepseek.deepseek_lora_targets`), each its own ParamWrapper
    expert_parts: frozenset[str] = frozenset()
    # HF Trainer's use_liger_kernel: Liger's RMSNorm and SwiGLU Functions (`_norm_saves`,
    # `_mlp_saves`); its RoPE rotates q and k in their projection's storage, which SDPA then
    # saves: the same bytes as transformers' rotated copies.
    liger: bool = False


def litgpt_zero_pad_width(arch: ModelArch, adapted: tuple[Linear, ...]) -> int:
    """Features per token of the adapters' q/k/v output that LitGPT's zero_pad index_copies; 0
    when q, k and v are all adapted (zero_pad then returns its input unchanged)."""
    qkv = [lin for lin in arch.linears if lin.kind is LinearKind.ATTN_QKV and not lin.expert]
    names = {lin.name for lin in adapted}
    if arch.fused_qkv_linear:
        # One fused projection (GPT-NeoX's query_key_value): LitGPT adapts its parts through
        # to_query / to_key / to_value, and finetune/lora.py enables query and value.
        return arch.q_dim + arch.kv_dim if qkv[0].name in names else 0
    chosen = [lin for lin in qkv if lin.name in names]
    if not chosen or len(chosen) == len(qkv):
        return 0
    return sum(lin.out_features for lin in chosen)


def _adapts_attention(adapted: tuple[Linear, ...]) -> bool:
    """Whether an adapter sits in the attention block. With the adapters on the MLP's linears
    alone (target_modules gate_proj, up_proj, down_proj), a first layer whose input takes no
    gradient runs its norm, attention and output projection on tensors that need none, so
    autograd records nothing there (reference traces *__r16-gate_proj+up_proj+down_proj__*)."""
    return any(lin.kind in (LinearKind.ATTN_QKV, LinearKind.ATTN_OUT) for lin in adapted)


def _int8(rs: ResolvedSpec) -> bool:
    """Whether the base is LLM.int8 (bitsandbytes' Linear8bitLt)."""
    return rs.quantization is not None and rs.quantization.type is QuantType.INT8


def _packed(rs: ResolvedSpec) -> str:
    """The base's GPTQ, AWQ, HQQ or torchao type ('' for none or bitsandbytes')."""
    quant = rs.quantization
    return quant.type.value if quant is not None and quant.type.packed else ""


def layer_flow(arch: ModelArch, rs: ResolvedSpec, adapted: tuple[Linear, ...]) -> LayerFlow:
    spec = rs.spec
    md = DTYPE_BYTES[spec.dtype]
    prep = (
        spec.method is Method.QLORA and rs.quantization is not None and rs.quantization.prepare_kbit
    )
    # prepare_model_for_kbit_training leaves embeddings and norms in fp32, so the residual
    # stream and every 4-bit linear's output (cast back to its input dtype by bnb's
    # Linear4bit.forward) run in fp32.
    residual = FP32_BYTES if prep else md
    norm_out = residual
    # Autocast runs q/k/v and attention in half precision: bf16 for an fp32 model.
    if spec.autocast:
        attn = DTYPE_BYTES[DType.BF16] if spec.dtype is DType.FP32 else md
    else:
        attn = residual
    lora = rs.lora
    targets = frozenset(lin.name for lin in adapted)
    litgpt = spec.framework is Framework.LITGPT
    ia3_out, ia3_in = scaled_kinds(arch, rs)
    kbit = spec.kbit_base
    v2 = is_v2(rs)
    return LayerFlow(
        residual=residual,
        norm_out=norm_out,
        attn=attn,
        adapter=DTYPE_BYTES[rs.adapter_dtype],
        lora_targets=targets,
        full=spec.method is Method.FULL,
        r=lora.r if lora else 0,
        dropout=bool(lora and rs.lora_dropout > 0),
        fused_qkv=spec.framework is Framework.LITGPT
        or sum(1 for lin in arch.linears if lin.kind is LinearKind.ATTN_QKV) == 1,
        quantized=kbit,
        quant_saves_input=kbit
        and (spec.framework is Framework.LITGPT or _int8(rs) or saves_input(_packed(rs))),
        packed=_packed(rs),
        dequant_saved=md if saves_dequantized_weight(_packed(rs)) else 0,
        autocast=spec.autocast,
        zero_pad_width=litgpt_zero_pad_width(arch, adapted) if litgpt and lora else 0,
        proj_input_copy=litgpt,
        head_quantized=litgpt
        and kbit
        and not arch.tie_word_embeddings
        and rs.quantization is not None
        and rs.quantization.type is not QuantType.INT8,
        expert_lora=bool(expert_adapters(arch, rs)),
        hf_modules=spec.framework is Framework.HF,
        dora=bool(lora and lora.use_dora),
        ia3_out=ia3_out,
        ia3_in=ia3_in,
        trained_norms=frozenset({"norm1", "norm2", "final"}) if v2 else ln_tuning_targets(arch, rs),
        attention_trains=spec.method is Method.FULL
        or is_adapter(rs)
        or spec.method is Method.PREFIX_TUNING
        or attention_trains(arch, rs)
        or (
            (spec.method in LORA_METHODS or spec.method in DELTA_OPTIONS)
            and _adapts_attention(adapted)
        ),
        frozen_a=spec.method is Method.LORA_FA,
        vera=spec.method is Method.VERA,
        loha=spec.method is Method.LOHA,
        lokr=rs.lokr,
        adalora=spec.method is Method.ADALORA,
        oft=rs.oft,
        boft=rs.boft,
        adapter_prompt=ADAPTER_PROMPT_LENGTH if is_adapter(rs) else 0,
        adapter_v2=v2,
        prefix=spec.method is Method.PREFIX_TUNING,
        expert_parts=deepseek_expert_parts(arch, lora) if arch.is_mla else frozenset(),
        liger=spec.liger_kernel,
    )


def deepseek_expert_parts(arch: ModelArch, lora: LoraSpec | None) -> frozenset[str]:
    """Which of a MoE layer's parameters carry PEFT's ParamWrapper: "router", "gate_up",
    "down" (`deepseek_lora_targets`)."""
    if lora is None or not arch.is_moe:
        return frozenset()
    t = deepseek_lora_targets(arch, lora)
    chosen = (("router", t.router), ("gate_up", t.gate_up), ("down", t.down))
    return frozenset(name for name, on in chosen if on)
