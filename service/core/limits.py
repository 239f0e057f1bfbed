"""Bounds of a job spec: what the REST API accepts and the spec codec checks.

Beyond them no single-node fine-tuning job exists, and the fit solver's answers
(max_batch_size, max_seq_len) never exceed them.
"""

from __future__ import annotations

MAX_BATCH_SIZE = 4096
MAX_SEQ_LEN = 1_048_576  # 1M tokens
MAX_GRADIENT_ACCUMULATION = 65_536
MAX_GRAD_NORM = 1e6  # far above any clipping threshold in use
MAX_LORA_R = 16_384
# Classes of a sequence-classification head: far above any label set in use.
MAX_NUM_LABELS = 100_000
MAX_LORA_ALPHA = 1_000_000
MAX_GPUS = 1024
# A GPU's total memory as a request may give it (a fit-check's memory_mib, an upload's reported
# total): 4 TiB, over 20 times what the largest GPU in the catalog holds.
MAX_GPU_MEMORY_MIB = 4 * 1024 * 1024
MAX_BUCKET_CAP_MB = 1 << 20  # DDP's bucket cap, in MB: up to 1 TiB
# DeepSpeed's bucket sizes and live-parameter limits, in elements: up to 1e12 (a 1T model)
MAX_ZERO_ELEMENTS = 1_000_000_000_000
MAX_MODULES = 64
# Prompt and prefix tuning's virtual tokens: PEFT's examples use 8 to a few hundred.
MAX_VIRTUAL_TOKENS = 65_536
# Prefix tuning's projection width (PrefixTuningConfig.encoder_hidden_size): PEFT's default
# is the keys' width per layer, a few thousand.
MAX_ENCODER_HIDDEN_SIZE = 65_536
# VeRA's projection_prng_key (torch.Generator.manual_seed's seed): up to 2**53 - 1, the
# integers a JSON number carries exactly wherever it is read (I-JSON, RFC 7493 section 2.2),
# as the OpenAPI document writes its bounds.
MAX_PRNG_KEY = 2**53 - 1
# AdaLoRA's schedule (tinit, tfinal, total_step, deltaT): far above any run's optimizer steps.
MAX_TRAINING_STEPS = 1_000_000_000
# A vision-language sample's images and their side in pixels: far above what a processor
# takes (Qwen2-VL's default max_pixels is 28 * 28 * 1280, about 1000 x 1000).
MAX_IMAGES_PER_SAMPLE = 4096
MAX_IMAGE_SIDE = 65_536

# A module name as transformers names it ("q_proj", "model.layers.0.mlp").
MAX_MODULE_NAME_CHARS = 128
MODULE_NAME_PATTERN = r"^[A-Za-z0-9_.]+$"

# PYTORCH_CUDA_ALLOC_CONF settings, as the API's allocator object bounds them: split sizes up
# to 1 TiB in MB, power-of-two divisions up to 1024.
MAX_ALLOC_SETTING_MB = 1 << 20
MAX_ROUNDUP_POWER2_DIVISIONS = 1 << 10
