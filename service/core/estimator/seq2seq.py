"""Encoder-decoder models (T5, mT5): parsed and traced, their step not modelled yet."""

from __future__ import annotations

from service.core.architecture import ModelArch
from service.core.errors import InvalidConfigError
from service.core.spec import TrainingSpec


def check_seq2seq_modelled(arch: ModelArch, spec: TrainingSpec) -> None:
    """Refuse an encoder-decoder's step, which the estimator does not model yet."""
    del spec
    raise InvalidConfigError(
        "model_type",
        f"{arch.model_type!r} (an encoder-decoder) is parsed and traced but its training step "
        "is not modelled yet",
    )
