"""Building the model on the device and running the training steps."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from service.core.spec import LossImpl, Optim, SdpaKernel, TrainingSpec, resolve
from service.core.units import DType
from service.trace.probe.readings import DeviceReadings

STEPS = 2


# -- building the model on the device -------------------------------------------------------


def build_on_device(spec: TrainingSpec, config: Mapping[str, Any], device: str) -> Any:
    """The tracer's model of `spec`, every tensor real on `device` with random values.

    A 4-bit base's config gets the `quantization_config` that `from_pretrained` would leave
    on it, so that the model describes itself as a loaded QLoRA model does.
    """
    import torch

    from service.trace.model import build_meta_model, materialize

    resolved = resolve(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the libraries' deprecation notices
        built = build_meta_model(resolved, config)
    owned = materialize(built.model, fake_device=device)
    with torch.no_grad():
        for tensor, _component in owned:
            _randomize(tensor)
    if resolved.quantization is not None:
        from transformers import BitsAndBytesConfig

        from service.trace.model import TORCH_DTYPES

        base = _base_model(built.model)
        base.config.quantization_config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=resolved.quantization.type.value,
            bnb_4bit_use_double_quant=resolved.quantization.double_quant,
            bnb_4bit_compute_dtype=TORCH_DTYPES[resolved.compute_dtype],
        )
    if resolved.loss is LossImpl.PLAIN:
        from service.trace.runner import plain_causal_lm_loss

        base = _base_model(built.model)
        base.loss_function = plain_causal_lm_loss
    return built


def _labels(model: Any, ids: Any, spec: TrainingSpec) -> Any:
    """A causal LM's labels are its input ids; a sequence classifier's (an encoder's) one
    class id per sequence (a single row when `ids` is one sequence); an encoder-decoder's
    `target_length` token ids (the first input id repeated)."""
    from service.core.arch.hf_config import ENCODER_DECODER_MODEL_TYPES, ENCODER_MODEL_TYPES

    model_type = getattr(model.config, "model_type", "")
    if model_type in ENCODER_DECODER_MODEL_TYPES:
        target = spec.target_length or spec.seq_len
        return ids[..., :1].expand(*ids.shape[:-1], target).clone()
    if model_type not in ENCODER_MODEL_TYPES:
        return ids.clone()
    return ids[..., 0] % max(1, int(model.config.num_labels))


def _base_model(model: Any) -> Any:
    """The transformers model inside a PEFT model (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _randomize(tensor: Any) -> None:
    import torch

    if tensor.is_floating_point():
        tensor.normal_(0.0, 0.02)
    elif tensor.dtype == torch.uint8:
        tensor.random_(0, 256)
    else:
        tensor.zero_()


# -- running the steps ----------------------------------------------------------------------


def make_probe_optimizer(params: list[Any], optim: Optim) -> Any:
    """The optimizer HF Trainer builds for `optim`, on real tensors."""
    if optim in (Optim.PAGED_ADAMW_8BIT, Optim.PAGED_ADAMW_32BIT):
        import bitsandbytes as bnb

        from service.trace.model import LEARNING_RATE

        cls = bnb.optim.PagedAdamW8bit if optim is Optim.PAGED_ADAMW_8BIT else bnb.optim.PagedAdamW
        return cls(params, lr=LEARNING_RATE)
    from service.trace.optimizers import make_optimizer

    return make_optimizer(params, optim, fake=False)


@contextmanager
def attention_kernel(kernel: SdpaKernel) -> Iterator[None]:
    """Force SDPA's backend as the spec says; `auto` leaves PyTorch's choice."""
    if kernel is SdpaKernel.AUTO:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        SdpaKernel.FLASH: SDPBackend.FLASH_ATTENTION,
        SdpaKernel.EFFICIENT: SDPBackend.EFFICIENT_ATTENTION,
        SdpaKernel.MATH: SDPBackend.MATH,
    }[kernel]
    with sdpa_kernel(backend):
        yield


def _counts(readings: DeviceReadings) -> tuple[int, int]:
    """Allocations and frees the allocator made so far (the allocator history's indices)."""
    stats = readings.stats()
    return int(stats.get("allocation.all.allocated", 0)), int(stats.get("allocation.all.freed", 0))


def run_loop(
    model: Any, spec: TrainingSpec, record: dict[str, Any], readings: DeviceReadings
) -> None:
    """`STEPS` steps of the plain loop; each step's peaks into `record["steps"]`."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_probe_optimizer(params, spec.optim)
    vocab = int(model.config.vocab_size)
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (spec.batch_size, spec.seq_len), device=device)
    labels = _labels(model, ids, spec)
    readings.synchronize()
    record["before_steps_allocated"] = readings.allocated()
    steps = []
    with attention_kernel(spec.sdpa_kernel):
        for step in range(1, STEPS + 1):
            readings.reset_peaks()
            marks = {"start": _counts(readings)}
            t0 = time.time()
            loss = model(input_ids=ids, labels=labels).loss
            forward_end = readings.allocated()
            forward_peak = readings.max_allocated()
            forward_reserved = readings.max_reserved()
            marks["forward_end"] = _counts(readings)
            loss.backward()
            del loss
            readings.synchronize()
            backward_peak = readings.max_allocated()
            marks["backward_end"] = _counts(readings)
            if spec.max_grad_norm > 0:  # as HF Trainer clips (accelerate's clip_grad_norm_)
                torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            readings.synchronize()
            marks["step_end"] = _counts(readings)
            steps.append(
                {
                    "step": step,
                    "forward_end": forward_end,
                    "forward_peak": forward_peak,
                    "forward_reserved": forward_reserved,
                    "backward_peak": backward_peak,
                    "max_allocated": readings.max_allocated(),
                    "max_reserved": readings.max_reserved(),
                    "seconds": round(time.time() - t0, 3),
                    "allocator_counts": marks,
                }
            )
    record["steps"] = steps


def training_arguments(spec: TrainingSpec, device: str, output_dir: str) -> Any:
    """The HF TrainingArguments of the job: what `run_trainer` trains with, and what describes
    a loop run to the reporter's derivation as a Trainer run of the same job would."""
    from transformers import TrainingArguments

    half = spec.autocast and spec.dtype is DType.FP16
    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=spec.batch_size,
        gradient_accumulation_steps=spec.gradient_accumulation_steps,
        max_grad_norm=spec.max_grad_norm,
        max_steps=STEPS,
        bf16=spec.autocast and not half,
        fp16=half,
        use_cpu=device == "cpu",
        # transformers 5's names for gradient_checkpointing(_kwargs), which mirror them.
        activation_checkpointing=spec.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False},
        optim=spec.optim.value,
        learning_rate=1e-4,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        remove_unused_columns=False,
        disable_tqdm=True,
    )


def run_trainer(
    model: Any, spec: TrainingSpec, record: dict[str, Any], arguments: Any, readings: DeviceReadings
) -> None:
    """HF Trainer with `arguments` (`training_arguments`), `STEPS` optimizer steps."""
    import torch
    from transformers import PrinterCallback, Trainer

    b, s = spec.batch_size, spec.seq_len
    vocab = int(model.config.vocab_size)
    generator = torch.Generator().manual_seed(0)
    rows = STEPS * b * spec.gradient_accumulation_steps
    data = [
        {"input_ids": ids, "labels": _labels(model, ids, spec)}
        for ids in torch.randint(0, vocab, (rows, s), generator=generator)
    ]
    base = _base_model(model)
    if getattr(base, "is_quantized", False) and getattr(base, "hf_quantizer", None) is None:
        # Trainer refuses a quantized model it did not load unless it is a PEFT model loaded
        # by from_pretrained; the 4-bit layers are marked through is_loaded_in_4bit alone.
        base.is_quantized = False
    trainer = Trainer(model=model, args=arguments, train_dataset=data)
    trainer.remove_callback(PrinterCallback)  # its end-of-training metrics would go to stdout
    readings.reset_peaks()
    t0 = time.time()
    with attention_kernel(spec.sdpa_kernel):
        trainer.train()
    readings.synchronize()
    record["steps"] = [
        {
            "step": "1-2",
            "max_allocated": readings.max_allocated(),
            "max_reserved": readings.max_reserved(),
            "seconds": round(time.time() - t0, 3),
        }
    ]
