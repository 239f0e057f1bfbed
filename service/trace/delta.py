"""The PEFT methods beside LoRA, applied with PEFT's own config classes and get_peft_model."""

from __future__ import annotations

import warnings
from typing import Any

from service.core.spec import ALL_LINEAR, Method, ResolvedSpec

# AdaLoraConfig requires total_step; a trace without one runs the RankAllocator's schedule of
# PEFT's method-comparison runs (method_comparison/MetaMathQA/experiments/adalora: 5000).
TRACED_TOTAL_STEP = 5000
DELTA_METHODS = (Method.VERA, Method.LOHA, Method.LOKR, Method.ADALORA, Method.OFT, Method.BOFT)


def _targets(target: tuple[str, ...] | str | None) -> Any:
    return list(target) if isinstance(target, tuple) else target


def _config(resolved: ResolvedSpec) -> Any:
    """The method's PEFT config, from the resolved spec's options."""
    from peft import AdaLoraConfig, BOFTConfig, LoHaConfig, LoKrConfig, OFTConfig, VeraConfig

    if resolved.spec.method is Method.VERA and resolved.vera is not None:
        vera = resolved.vera
        return VeraConfig(
            r=vera.r,
            target_modules=_targets(vera.target_modules),
            vera_dropout=vera.vera_dropout,
            d_initial=vera.d_initial,
            projection_prng_key=vera.projection_prng_key,
            save_projection=vera.save_projection,
            task_type="CAUSAL_LM",
        )
    if resolved.spec.method is Method.LOHA and resolved.loha is not None:
        loha = resolved.loha
        return LoHaConfig(
            r=loha.r,
            alpha=loha.alpha,
            rank_dropout=loha.rank_dropout,
            module_dropout=loha.module_dropout,
            target_modules=_targets(loha.target_modules),
            task_type="CAUSAL_LM",
        )
    if resolved.spec.method is Method.LOKR and resolved.lokr is not None:
        lokr = resolved.lokr
        return LoKrConfig(
            r=lokr.r,
            alpha=lokr.alpha,
            rank_dropout=lokr.rank_dropout,
            module_dropout=lokr.module_dropout,
            decompose_both=lokr.decompose_both,
            decompose_factor=lokr.decompose_factor,
            rank_dropout_scale=lokr.rank_dropout_scale,
            target_modules=_targets(lokr.target_modules),
            task_type="CAUSAL_LM",
        )
    if resolved.spec.method is Method.ADALORA and resolved.adalora is not None:
        ada = resolved.adalora
        return AdaLoraConfig(
            init_r=ada.init_r,
            target_r=ada.target_r,
            lora_alpha=ada.lora_alpha,
            lora_dropout=ada.lora_dropout,
            target_modules=_targets(ada.target_modules),
            orth_reg_weight=ada.orth_reg_weight,
            tinit=ada.tinit,
            tfinal=ada.tfinal,
            deltaT=ada.deltaT,
            beta1=ada.beta1,
            beta2=ada.beta2,
            total_step=ada.total_step or TRACED_TOTAL_STEP,
            task_type="CAUSAL_LM",
        )
    if resolved.spec.method is Method.OFT and resolved.oft is not None:
        oft = resolved.oft
        return OFTConfig(
            r=oft.r,
            oft_block_size=oft.oft_block_size,
            module_dropout=oft.module_dropout,
            target_modules=_targets(oft.target_modules),
            coft=oft.coft,
            eps=oft.eps,
            block_share=oft.block_share,
            use_cayley_neumann=oft.use_cayley_neumann,
            num_cayley_neumann_terms=oft.num_cayley_neumann_terms,
            task_type="CAUSAL_LM",
        )
    if resolved.spec.method is Method.BOFT and resolved.boft is not None:
        boft = resolved.boft
        return BOFTConfig(
            boft_block_size=boft.boft_block_size,
            boft_block_num=boft.boft_block_num,
            boft_n_butterfly_factor=boft.boft_n_butterfly_factor,
            boft_dropout=boft.boft_dropout,
            bias=boft.bias,
            target_modules=_targets(boft.target_modules),
            task_type="CAUSAL_LM",
        )
    raise ValueError(f"no PEFT config for method {resolved.spec.method.value!r}")


class _Draw:
    """What `torch.rand(1)` gives LyCORIS' module dropout check: above the dropout of 0 the
    spec requires (a uniform draw in [0, 1) is above 0 almost surely)."""

    def __gt__(self, other: object) -> bool:
        return other == 0.0


class _TorchDrawingAboveZero:
    """The `torch` PEFT's LoHa and LoKr layer modules see: torch, but `rand(1)` a `_Draw`. Its
    `torch.rand(1) > module_dropout` is data-dependent, which fake tensors cannot answer; the
    draw is a host tensor on a GPU run, no device memory."""

    def __getattr__(self, name: str) -> Any:
        import torch

        if name == "rand":
            return lambda *size, **kwargs: _Draw()
        return getattr(torch, name)


def _answer_module_dropout() -> None:
    from peft.tuners.loha import layer as loha_layer
    from peft.tuners.lokr import layer as lokr_layer

    loha_layer.torch = _TorchDrawingAboveZero()  # type: ignore[attr-defined]
    lokr_layer.torch = _TorchDrawingAboveZero()  # type: ignore[attr-defined]


class _FastBlockDiagKernel:
    """PEFT's CUDA extension fbd_cuda (peft/tuners/boft/fbd/fbd_cuda_kernel.cu) as a GPU run
    loads it, on fake tensors: forward allocates the zeroed (N, D·H, D·H) block-diagonal
    output and writes the blocks in place; backward a zeroed gradient the input's shape,
    filled from the output gradient's diagonal blocks. The CPU tracer cannot build it, and
    without it PEFT falls back to one butterfly factor and torch.block_diag."""

    @staticmethod
    def _blocks(full: Any, d: int, h: int) -> Any:
        import torch

        n = full.shape[0]
        return torch.diagonal(full.view(n, d, h, d, h), dim1=1, dim2=3)  # (N, H, H, D)

    def forward(self, blocks: Any) -> list[Any]:
        import torch

        n, d, h, _ = blocks.shape
        output = torch.zeros((n, d * h, d * h), dtype=blocks.dtype, device=blocks.device)
        self._blocks(output, d, h).copy_(blocks.permute(0, 2, 3, 1))
        return [output]

    def backward(self, grad_output: Any, blocks: Any) -> list[Any]:
        import torch

        _, d, h, _ = blocks.shape
        grad = torch.zeros_like(blocks)
        grad.permute(0, 2, 3, 1).copy_(self._blocks(grad_output, d, h))
        return [grad]


def _load_fbd_kernel() -> None:
    from peft.tuners.boft import layer as boft_layer

    boft_layer._FBD_CUDA = _FastBlockDiagKernel()  # type: ignore[attr-defined]


def apply_delta(model: Any, resolved: ResolvedSpec) -> Any:
    """get_peft_model with the method's config (PEFT's autocast_adapter_dtype=True, the
    default: adapters in fp32 beside a half-precision base); with checkpointing, HF's
    non-reentrant checkpointing and the input gradient HF Trainer asks a PEFT model for."""
    from peft import get_peft_model

    spec = resolved.spec
    if spec.method in (Method.LOHA, Method.LOKR):
        _answer_module_dropout()
    if spec.method is Method.BOFT:
        _load_fbd_kernel()
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, _config(resolved))
    if spec.gradient_checkpointing:
        peft_model.enable_input_require_grads()
    return peft_model


__all__ = ["ALL_LINEAR", "DELTA_METHODS", "apply_delta"]
