"""An encoder-decoder's (T5 v1.1, mT5) LoRA step under DeepSpeed ZeRO-3: the model's parameters
as ZeRO-3 partitions and gathers them (`zero.stage3_rank`, DeepSpeed v0.19.5), listed in the
order T5ForConditionalGeneration's forward runs its modules (transformers 5.24
models/t5/modeling_t5.py):

- the shared embedding, as the encoder's input embedding;
- each encoder block: the self-attention's layer norm, q, k and v (each PEFT lora.Linear: the
  base linear, then lora_A and lora_B), the relative position bias table (the first block only:
  `has_relative_attention_bias`; later blocks reuse its bias), o; the feed-forward's layer norm,
  wi_0, wi_1, wo;
- the encoder's final layer norm;
- the shared embedding again, as the decoder's input embedding;
- each decoder block: as the encoder's, with the cross-attention (its layer norm, q, k, v, o)
  between the self-attention and the feed-forward;
- the decoder's final layer norm and the lm_head, which is the shared table (transformers 5
  ties them for T5).

The activations are the one-GPU step's (`seq2seq._saved`): ZeRO-3 changes where the parameters
live, not what autograd saves.
"""

from __future__ import annotations

from service.core.arch import Linear, ModelArch
from service.core.estimator.weights import _Tensor
from service.core.estimator.zero import Stage3Model, ZeroRank, _Job, stage3_rank, zero_settings
from service.core.spec import ResolvedSpec
from service.core.units import DTYPE_BYTES


def _block(
    linears: tuple[Linear, ...], names: set[str], r: int, h: int, bias: int, cross: bool
) -> list[tuple[int, ...]]:
    """One block's modules in forward order, as (elements of each own parameter)."""
    by_name = {lin.name: lin for lin in linears}

    def linear(name: str) -> list[tuple[int, ...]]:
        lin = by_name[name]
        out: list[tuple[int, ...]] = [(lin.weight_elements,)]
        if name in names:
            out += [(r * lin.in_features,), (lin.out_features * r,)]
        return out

    def attention(prefix: str, with_bias: bool) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = [(h,)]  # the sublayer's layer norm
        for part in ("q", "k", "v"):
            out += linear(f"{prefix}.{part}")
        if with_bias:
            out.append((bias,))
        return out + linear(f"{prefix}.o")

    modules = attention("SelfAttention", bias > 0)
    if cross:
        modules += attention("EncDecAttention", False)
    modules.append((h,))
    for part in ("wi_0", "wi_1", "wo"):
        modules += linear(f"DenseReluDense.{part}")
    return modules


def seq2seq_stage3(arch: ModelArch, rs: ResolvedSpec, names: set[str]) -> ZeroRank:
    """One rank of a ZeRO-3 LoRA job on `arch`: every parameter after DeepSpeed's cast (bf16 or
    fp16 enabled: the adapters too; `zero._cast_params`), frozen base and trainable adapters."""
    spec = rs.spec
    lora = rs.lora
    r = lora.r if lora is not None else 0
    itemsize = DTYPE_BYTES[spec.dtype]
    h, v = arch.hidden_size, arch.vocab_size
    bias = arch.relative_attention_num_buckets * arch.num_attention_heads

    modules: list[tuple[int, ...]] = [(v * h,)]
    for layer in range(arch.num_hidden_layers):
        modules += _block(arch.linears, names, r, h, bias if layer == 0 else 0, cross=False)
    modules += [(h,), (v * h,)]
    for layer in range(arch.decoder_layers):
        modules += _block(arch.decoder_linears, names, r, h, bias if layer == 0 else 0, cross=True)
    modules += [(h,), (v * h,)]

    def weights(linears: tuple[Linear, ...], layers: int, norms: int) -> list[_Tensor]:
        return [
            *(_Tensor(lin.out_features, lin.in_features, itemsize, layers) for lin in linears),
            _Tensor(h, 0, itemsize, layers * norms),
            _Tensor(bias, 0, itemsize, 1),  # the first block's relative position bias
            _Tensor(h, 0, itemsize, 1),  # the stack's final layer norm
        ]

    frozen = [
        _Tensor(v, h, itemsize, 1),
        *weights(arch.linears, arch.num_hidden_layers, 2),
        *weights(arch.decoder_linears, arch.decoder_layers, 3),
    ]
    trainable = [
        t
        for linears, layers in (
            (arch.linears, arch.num_hidden_layers),
            (arch.decoder_linears, arch.decoder_layers),
        )
        for lin in linears
        if lin.name in names
        for t in (
            _Tensor(r, lin.in_features, itemsize, layers),
            _Tensor(lin.out_features, r, itemsize, layers),
        )
    ]
    job = _Job(
        spec.dtype,
        spec.method,
        spec.optim,
        lora,
        None,
        spec.dtype,
        (),
        False,
        spec.parallel,
        spec.gradient_accumulation_steps > 1,
    )
    return stage3_rank(
        Stage3Model(
            frozen=frozen,
            trainable=trainable,
            modules=modules,
            itemsize=itemsize,
            layer_largest=max(
                lin.weight_elements for lin in (*arch.linears, *arch.decoder_linears)
            ),
        ),
        zero_settings(arch, spec.parallel),
        job,
    )
