"""Build the real HF (+ bitsandbytes, + PEFT) model of a spec on `meta`, then make it fake.

Everything that shapes the model is the libraries' own code: `AutoModelForCausalLM.from_config`,
transformers' `replace_with_bnb_linear` and bitsandbytes' `quantize_4bit` (run on meta through its
fake kernels), `peft.prepare_model_for_kbit_training`, `peft.get_peft_model`. Only the final step,
giving every meta tensor a fake CPU twin (tied weights and shared tensors stay shared), is ours.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

# Imported here, never for the first time inside a fake mode, where bitsandbytes' module-level
# tensors would become fake ones (and be counted by the trace).
import bitsandbytes as bnb
import torch

from service.core.arch.hf_config import ENCODER_DECODER_MODEL_TYPES, ENCODER_MODEL_TYPES
from service.core.arch.mllama import MLLAMA_MODEL_TYPE
from service.core.arch.vision import VISION_MODEL_TYPES
from service.core.result import Component
from service.core.spec import (
    ALL_LINEAR,
    LORA_METHODS,
    Method,
    Objective,
    QuantType,
    ResolvedSpec,
)
from service.core.units import DType
from service.trace.delta import DELTA_METHODS, apply_delta
from service.trace.linear_experts import install, is_moe_block

TORCH_DTYPES: dict[DType, torch.dtype] = {
    DType.FP32: torch.float32,
    DType.BF16: torch.bfloat16,
    DType.FP16: torch.float16,
}
# bitsandbytes' 4-bit block size (BitsAndBytesConfig / Params4bit default blocksize=64).
BNB_4BIT_BLOCKSIZE = 64
# What bitsandbytes and PEFT read from a 4-bit weight (bitsandbytes/nn/modules.py Params4bit).
_PARAMS4BIT_ATTRIBUTES = (
    "quant_state",
    "blocksize",
    "compress_statistics",
    "quant_type",
    "quant_storage",
    "module",
    "bnb_quantized",
)
# A reward model's one output (RewardTrainer sets num_labels=1) and the padding id on its
# config (service/trace/reward.py).
REWARD_LABELS = 1
REWARD_PAD_TOKEN_ID = 0
# LoRA hyperparameters never change memory but PEFT needs them; learning rate likewise.
LEARNING_RATE = 1e-4


@dataclass(slots=True)
class BuiltModel:
    """The model to train (a PeftModel for LoRA/QLoRA) and the module producing the logits."""

    model: torch.nn.Module
    lm_head: torch.nn.Module
    decoder_layers: torch.nn.ModuleList


def is_encoder(config: Mapping[str, Any]) -> bool:
    """Whether the model runs as a sequence classifier (an encoder such as BERT)."""
    return config.get("model_type") in ENCODER_MODEL_TYPES


def is_encoder_decoder(config: Mapping[str, Any]) -> bool:
    """Whether the model runs as a sequence-to-sequence LM (an encoder-decoder such as T5)."""
    return config.get("model_type") in ENCODER_DECODER_MODEL_TYPES


def build_meta_model(resolved: ResolvedSpec, config: Mapping[str, Any]) -> BuiltModel:
    """The training model of `resolved`, every tensor on the meta device: a causal LM, or for
    an encoder its sequence classifier with the spec's `num_labels`, or an encoder-decoder's
    conditional-generation model."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSeq2SeqLM,
        AutoModelForSequenceClassification,
    )

    spec = resolved.spec
    dtype = TORCH_DTYPES[spec.dtype]
    values = {k: v for k, v in config.items() if k not in ("quantization_config", "auto_map")}
    model_type = values.pop("model_type")
    encoder = model_type in ENCODER_MODEL_TYPES
    reward = spec.objective is Objective.REWARD
    if encoder and spec.num_labels is not None:
        values.pop("id2label", None)
        values.pop("label2id", None)
        values["num_labels"] = spec.num_labels
    if reward:
        # RewardTrainer: num_labels=1 and the tokenizer's padding id on the config
        # (trl/trainer/reward_trainer.py __init__)
        values.pop("id2label", None)
        values.pop("label2id", None)
        values["num_labels"] = REWARD_LABELS
        values["pad_token_id"] = REWARD_PAD_TOKEN_ID
    hf_config = AutoConfig.for_model(model_type, **values)
    attn = spec.attn_implementation.value
    if attn == "flash_attention_2":
        attn = "sdpa"  # same saved tensors through SDPA's flash op; flash_attn is not needed
    hf_config._attn_implementation = attn
    auto: Any = AutoModelForCausalLM
    if encoder or reward:
        auto = AutoModelForSequenceClassification
    elif model_type in ENCODER_DECODER_MODEL_TYPES:
        auto = AutoModelForSeq2SeqLM
    elif model_type in VISION_MODEL_TYPES or model_type == MLLAMA_MODEL_TYPE:
        auto = AutoModelForImageTextToText
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = auto.from_config(hf_config, dtype=dtype)
    model.config.use_cache = False
    model.train()
    if spec.stack.experts_are_linears and any(is_moe_block(m) for m in model.modules()):
        # transformers 4's layout: one nn.Linear per expert, looped over (linear_experts.py)
        install(model, dtype)

    if spec.method is Method.QLORA:
        _quantize(model, resolved)
    if spec.method is Method.FULL:
        if spec.gradient_checkpointing:
            _enable_checkpointing(model)
    elif spec.method in DELTA_METHODS:
        model = apply_delta(model, resolved)
    elif spec.method in LORA_METHODS:
        model = _apply_lora(model, resolved)
    else:
        model = _apply_peft_method(model, resolved)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return BuiltModel(
        model=model,
        lm_head=base.classifier
        if encoder
        else base.score
        if reward
        else base.get_output_embeddings(),
        decoder_layers=_decoder_layers(base),
    )


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    encoder = getattr(getattr(model, "bert", None), "encoder", None)
    if encoder is not None:
        return encoder.layer
    if getattr(model.config, "model_type", "") in ENCODER_DECODER_MODEL_TYPES:
        return model.get_decoder().block  # type: ignore[no-any-return]
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(inner, "layers", None)
    if layers is None:  # Falcon's and BLOOM's stack is `h`
        layers = getattr(inner, "h", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


def _enable_checkpointing(model: Any) -> None:
    # HF Trainer with gradient_checkpointing=True, non-reentrant as the trace is run.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _quantize(model: Any, resolved: ResolvedSpec) -> None:
    """What `from_pretrained(quantization_config=BitsAndBytesConfig(...))` does: the base's
    linears quantized by bitsandbytes, then PEFT's k-bit preparation."""
    from transformers.quantizers.base import get_keys_to_not_convert

    quant = resolved.quantization
    if quant is None:  # resolve() always fills it for QLoRA
        raise ValueError("QLoRA needs a quantization spec")
    skip = get_keys_to_not_convert(model)
    if quant.type is QuantType.INT8:
        _quantize_8bit(model, skip, TORCH_DTYPES[resolved.spec.dtype])
        model.is_loaded_in_8bit = True
    else:
        _quantize_4bit(model, resolved, skip)
        model.is_loaded_in_4bit = True
    model.is_quantized = True
    model.quantization_method = "bitsandbytes"
    if quant.prepare_kbit:
        from peft import prepare_model_for_kbit_training

        prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=resolved.spec.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    elif resolved.spec.gradient_checkpointing:
        _enable_checkpointing(model)


def _quantize_4bit(model: Any, resolved: ResolvedSpec, skip: list[str]) -> None:
    """`load_in_4bit=True`: each linear a Linear4bit holding its packed weight and quant state."""
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    quant = resolved.quantization
    assert quant is not None  # _quantize checked it
    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant.type.value,
        bnb_4bit_use_double_quant=quant.double_quant,
        bnb_4bit_compute_dtype=TORCH_DTYPES[resolved.compute_dtype],
    )
    replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=bnb_config)
    dtype = TORCH_DTYPES[resolved.spec.dtype]
    for module in model.modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        weight = module.weight
        source = torch.empty(weight.shape, dtype=dtype, device="meta")
        packed, state = bnb.functional.quantize_4bit(
            source,
            blocksize=BNB_4BIT_BLOCKSIZE,
            compress_statistics=quant.double_quant,
            quant_type=quant.type.value,
            quant_storage=torch.uint8,
        )
        weight.data = packed
        weight.quant_state = state
        weight.bnb_quantized = True
        module.quant_state = state
        if module.bias is not None:
            module.bias.data = module.bias.data.to(dtype)


def _quantize_8bit(model: Any, skip: list[str], dtype: torch.dtype) -> None:
    """`load_in_8bit=True` (LLM.int8, BitsAndBytesConfig's defaults: threshold 6.0, no fp16
    weights): each linear a Linear8bitLt whose Int8Params hold the int8 weight (CB) and one
    fp32 scale per output row (SCB), as Int8Params._quantize leaves them on the GPU."""
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    replace_with_bnb_linear(
        model,
        modules_to_not_convert=skip,
        quantization_config=BitsAndBytesConfig(load_in_8bit=True),
    )
    for module in model.modules():
        if not isinstance(module, bnb.nn.Linear8bitLt):
            continue
        weight = module.weight
        packed = torch.empty(weight.shape, dtype=torch.int8, device="meta")
        weight.data = packed
        weight.CB = weight.data
        weight.SCB = torch.empty(weight.shape[0], dtype=torch.float32, device="meta")
        if module.bias is not None:
            module.bias.data = module.bias.data.to(dtype)


def _apply_lora(model: Any, resolved: ResolvedSpec) -> Any:
    from peft import LoraConfig, get_peft_model

    lora = resolved.lora
    if lora is None:  # resolve() always fills it for LoRA/QLoRA
        raise ValueError("LoRA needs a LoRA spec")
    target: Any = lora.target_modules
    if isinstance(target, tuple):
        target = list(target)
    elif target == ALL_LINEAR:
        target = ALL_LINEAR
    lora_config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.lora_alpha,
        lora_dropout=resolved.lora_dropout,
        target_modules=target,
        modules_to_save=list(lora.modules_to_save) or None,
        use_dora=lora.use_dora,
        use_rslora=lora.use_rslora,
        # An encoder's classifier: PEFT's sequence-classification task trains the classifier
        # whole beside the adapters (PeftModelForSequenceClassification: modules_to_save).
        task_type=_task_type(getattr(model.config, "model_type", ""), resolved.spec.objective),
    )
    spec = resolved.spec
    if spec.method in (Method.LORA, Method.LORA_FA) and spec.gradient_checkpointing:
        _enable_checkpointing(model)
    adapters_fp32 = resolved.adapter_dtype is DType.FP32
    with (
        warnings.catch_warnings(),
        _dora_reads_4bit_layers_in_place(lora.use_dora),
        _v4_targets(spec.stack.experts_are_linears),
    ):
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, lora_config, autocast_adapter_dtype=adapters_fp32)
    if not adapters_fp32:
        adapter_dtype = TORCH_DTYPES[resolved.adapter_dtype]
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.data = param.data.to(adapter_dtype)
    if spec.method is Method.LORA_FA:
        # peft/optimizers/lorafa.py create_lorafa_optimizer: every lora_A stops training
        # before the model runs (the tracer builds that optimizer once the model is real).
        for name, param in peft_model.named_parameters():
            if "lora_A" in name:
                param.requires_grad_(False)
    if spec.gradient_checkpointing:
        # HF Trainer does this for PEFT models so checkpointed layers get an input needing grad.
        peft_model.enable_input_require_grads()
    return peft_model


@contextlib.contextmanager
def _v4_targets(on: bool) -> Iterator[None]:
    """PEFT's targets as on transformers 4, where `on`: PEFT 0.21 on transformers 5 rewrites
    a MoE model's expert and router targets (w1/w2/w3, gate_proj/up_proj/down_proj, gate; and
    "all-linear", which it resolves to them) into `target_parameters` of the fused 3-D experts
    (peft/tuners/tuners_utils.py inject_adapter, behind `is_transformers_ge_v5`;
    peft/utils/transformers_weight_conversion.py _convert_peft_config_moe). On transformers 4
    nothing is rewritten (PEFT 0.14 has no such conversion): the names match the per-expert
    nn.Linear modules that `linear_experts.install` builds, as PEFT 0.14 matches them."""
    if not on:
        yield
        return
    from peft.tuners import tuners_utils

    before = tuners_utils.is_transformers_ge_v5
    tuners_utils.is_transformers_ge_v5 = False
    try:
        yield
    finally:
        tuners_utils.is_transformers_ge_v5 = before


def _task_type(model_type: str, objective: Objective = Objective.SFT) -> str:
    """PEFT's task for the model: an encoder-decoder's SEQ_2_SEQ_LM
    (PeftModelForSeq2SeqLM) adds no trained module of its own; a reward model's SEQ_CLS trains
    its `score` head whole beside the adapters (PeftModelForSequenceClassification)."""
    if model_type in ENCODER_MODEL_TYPES or objective is Objective.REWARD:
        return "SEQ_CLS"
    if model_type in ENCODER_DECODER_MODEL_TYPES:
        return "SEQ_2_SEQ_LM"
    return "CAUSAL_LM"


def _peft_method_config(resolved: ResolvedSpec) -> Any:
    """PEFT's config of a method other than LoRA; fields left None take PEFT's defaults for
    the model, as PEFT resolves them in get_peft_model."""
    from peft import IA3Config, LNTuningConfig, PrefixTuningConfig, PromptTuningConfig

    def names(value: tuple[str, ...] | None) -> list[str] | None:
        return None if value is None else list(value)

    if resolved.ia3 is not None:
        return IA3Config(
            target_modules=names(resolved.ia3.target_modules),
            feedforward_modules=names(resolved.ia3.feedforward_modules),
            task_type="CAUSAL_LM",
        )
    if resolved.ln_tuning is not None:
        return LNTuningConfig(
            target_modules=names(resolved.ln_tuning.target_modules), task_type="CAUSAL_LM"
        )
    if resolved.prompt_tuning is not None:
        return PromptTuningConfig(
            num_virtual_tokens=resolved.prompt_tuning.num_virtual_tokens, task_type="CAUSAL_LM"
        )
    prefix = resolved.spec.prefix_tuning
    if prefix is not None:
        return PrefixTuningConfig(
            num_virtual_tokens=prefix.num_virtual_tokens,
            prefix_projection=prefix.prefix_projection,
            encoder_hidden_size=prefix.encoder_hidden_size,
            task_type="CAUSAL_LM",
        )
    raise ValueError(f"method {resolved.spec.method!r} has no PEFT config")


def _apply_peft_method(model: Any, resolved: ResolvedSpec) -> Any:
    """get_peft_model with (IA)^3, LN tuning or prompt tuning, as PEFT's method_comparison
    trains them."""
    from peft import get_peft_model

    config = _peft_method_config(resolved)
    if resolved.spec.gradient_checkpointing:
        _enable_checkpointing(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, config)
    if resolved.spec.gradient_checkpointing:
        peft_model.enable_input_require_grads()
    return peft_model


@contextlib.contextmanager
def _dora_reads_4bit_layers_in_place(use_dora: bool) -> Iterator[None]:
    """DoRA's init deep-copies a 4-bit base layer before dequantizing it for the magnitude (an
    FSDP workaround, peft/tuners/lora/dora.py DoraLinearLayer.update_layer); bitsandbytes'
    Params4bit cannot deep-copy a fake tensor (its __setstate__ sets .data). The copy is read
    once and dropped before the step, so the tracer lets DoRA read the layer itself. DoRA's
    dequantization stays pointed at `_dequantize_stand_in` for the step that follows."""
    if not use_dora:
        yield
        return
    from peft.tuners.lora import dora

    original = dora.deepcopy
    dora.deepcopy = lambda module: module  # type: ignore[attr-defined]
    dora.dequantize_module_weight = _dequantize_stand_in  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dora.deepcopy = original  # type: ignore[attr-defined]


def _dequantize_stand_in(module: torch.nn.Module) -> Any:
    """peft/utils/integrations.py dequantize_module_weight for the tracer's 4-bit layers:
    `materialize` stands a plain Parameter in for each Params4bit (which cannot wrap a fake
    tensor), and PEFT knows a 4-bit weight by its class name; this dequantizes it as PEFT's
    dequantize_bnb_weight does a Params4bit (bitsandbytes.functional.dequantize_4bit)."""
    from peft.utils.integrations import dequantize_module_weight

    if isinstance(module, bnb.nn.Linear4bit):
        weight = module.weight
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
    return dequantize_module_weight(module)


def _named_tensor_slots(model: torch.nn.Module) -> Iterator[tuple[Any, str, torch.Tensor, str]]:
    """(owner, attribute, tensor, kind) for every parameter, buffer and 4-bit quant-state tensor."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                yield module, name, param, "param"
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                yield module, name, buf, "buffer"
        state = getattr(module, "quant_state", None)
        if state is not None:
            yield from _quant_state_slots(state)
        for name, value in list(vars(module).items()):
            if (
                isinstance(value, torch.Tensor)
                and not isinstance(value, torch.nn.Parameter)
                and value.device.type == "meta"
                and name not in module._buffers
            ):
                yield module, name, value, "attribute"


def _quant_state_slots(state: Any) -> Iterator[tuple[Any, str, torch.Tensor, str]]:
    for name in ("absmax", "code", "offset"):
        value = getattr(state, name, None)
        if isinstance(value, torch.Tensor):
            yield state, name, value, "quant_state"
    nested = getattr(state, "state2", None)
    if nested is not None:
        yield from _quant_state_slots(nested)


def _fake_prompt_tokens(model: torch.nn.Module, fake_device: str) -> None:
    """A prompt-learning PeftModel keeps each adapter's virtual token ids, an arange it moves
    to the prompt encoder's device on every forward (peft/peft_model.py
    PeftModel._setup_prompt_encoder, get_prompt), in a plain dict: made anew where the step
    runs."""
    tokens = getattr(model, "prompt_tokens", None)
    if isinstance(tokens, dict):
        for name, ids in list(tokens.items()):
            tokens[name] = torch.arange(ids.numel(), dtype=ids.dtype, device=fake_device)


def materialize(
    model: torch.nn.Module, fake_device: str = "cpu"
) -> list[tuple[torch.Tensor, Component]]:
    """Replace every meta tensor of `model` by a fresh tensor on `fake_device`, in place.

    Call inside the FakeTensorMode the trace runs in (or outside any mode, for real tensors).
    Shared tensors (tied embeddings, shared quant-state tensors) stay shared. Returns each new
    storage-owning tensor once, with its role: trainable parameters, or frozen weights.
    """
    _fake_prompt_tokens(model, fake_device)
    replaced: dict[int, torch.Tensor] = {}
    owned: list[tuple[torch.Tensor, Component]] = []
    for owner, name, tensor, kind in list(_named_tensor_slots(model)):
        new = replaced.get(id(tensor))
        if new is None:
            data = torch.empty_strided(
                tensor.shape, tensor.stride(), dtype=tensor.dtype, device=fake_device
            )
            if kind == "buffer" and not data.is_floating_point():
                # index buffers (BERT's position_ids and token_type_ids) must hold valid
                # indices in a real run; zeros are (in place: no allocation)
                data.zero_()
            if isinstance(tensor, bnb.nn.Int8Params):
                # Likewise an Int8Params: a Parameter whose CB is its own data, and its
                # per-row scales (SCB) made on the fake device beside it.
                new = torch.nn.Parameter(data, requires_grad=False)
                scales = torch.empty(tensor.SCB.shape, dtype=tensor.SCB.dtype, device=fake_device)
                new.CB, new.SCB, new.has_fp16_weights = new.data, scales, False
                owned.append((scales, Component.FROZEN_WEIGHTS))
            elif isinstance(tensor, bnb.nn.Params4bit):
                # A Params4bit cannot wrap a fake tensor; a Parameter carrying the attributes
                # bitsandbytes reads from it behaves the same in forward and backward.
                new = torch.nn.Parameter(data, requires_grad=False)
                for attr in _PARAMS4BIT_ATTRIBUTES:
                    setattr(new, attr, getattr(tensor, attr))
            elif isinstance(tensor, torch.nn.Parameter):
                new = torch.nn.Parameter(data, requires_grad=tensor.requires_grad)
            else:
                new = data
            replaced[id(tensor)] = new
            trainable = isinstance(new, torch.nn.Parameter) and new.requires_grad
            owned.append(
                (new, Component.TRAINABLE_PARAMS if trainable else Component.FROZEN_WEIGHTS)
            )
        if kind == "param":
            owner._parameters[name] = new
        elif kind == "buffer":
            owner._buffers[name] = new
        else:
            setattr(owner, name, new)
    return owned
