"""The Liger Kernel stand-ins compute what the unpatched transformers modules compute, and save
for backward what liger-kernel's Functions save."""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from service.trace import liger  # noqa: E402

pytestmark = pytest.mark.trace


def _tiny(model_type: str) -> Any:
    config = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # away from the ones/zeros init, so the norms' weights matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model.train()


def _step(model: Any, ids: Any, labels: Any) -> tuple[Any, dict[str, Any]]:
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize(
    ("model_type", "mlp"),
    [("llama", "swiglu"), ("qwen2", "swiglu"), ("mistral", "swiglu"), ("gemma2", "geglu")],
)
def test_patched_model_matches_unpatched_loss_and_gradients(model_type: str, mlp: str) -> None:
    model = _tiny(model_type)
    patched = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 12))
    labels = ids.clone()
    labels[0, :3] = liger.IGNORE_INDEX
    want_loss, want_grads = _step(model, ids, labels)
    with liger.applied(patched) as patches:
        assert patches.mlp == mlp
        got_loss, got_grads = _step(patched, ids, labels)
    assert torch.allclose(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert want_grads.keys() == got_grads.keys()
    for name, grad in want_grads.items():
        assert torch.allclose(got_grads[name], grad, rtol=1e-4, atol=1e-6), name


def test_gemma_rms_norm_and_geglu_match_gemma2_modules() -> None:
    from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP, Gemma2RMSNorm

    config = transformers.Gemma2Config(hidden_size=32, intermediate_size=48)
    torch.manual_seed(0)
    norm = Gemma2RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(0, 0.1)
    x = torch.randn(3, 5, 32, requires_grad=True)
    dy = torch.randn(3, 5, 32)
    want = norm(x)
    (want_dx, want_dw) = torch.autograd.grad(want, (x, norm.weight), dy)
    got = liger.RmsNormFunction.apply(x, norm.weight, 1e-6, 1.0, "gemma", False)
    (got_dx, got_dw) = torch.autograd.grad(got, (x, norm.weight), dy)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(got_dx, want_dx, atol=1e-5)
    assert torch.allclose(got_dw, want_dw, atol=1e-5)

    mlp = Gemma2MLP(config)
    h = torch.randn(3, 5, 32, requires_grad=True)
    want_out = mlp(h)
    want_dh = torch.autograd.grad(want_out.sum(), h)[0]
    got_out = liger.geglu_mlp_forward(mlp, h)
    got_dh = torch.autograd.grad(got_out.sum(), h)[0]
    assert torch.allclose(got_out, want_out, atol=1e-6)
    assert torch.allclose(got_dh, want_dh, atol=1e-5)


def test_rope_matches_apply_rotary_pos_emb_and_rotates_in_place() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, s, heads, d = 2, 6, 4, 8
    q_proj = torch.randn(b, s, heads * d)
    k_proj = torch.randn(b, s, heads * d)
    angles = torch.randn(1, s, d // 2)
    cos = torch.cat((angles, angles), -1).cos()
    sin = torch.cat((angles, angles), -1).sin()
    q = q_proj.view(b, s, heads, d).transpose(1, 2)
    k = k_proj.view(b, s, heads, d).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(q.clone(), k.clone(), cos, sin)
    q_leaf = q.clone().requires_grad_(True)
    k_leaf = k.clone().requires_grad_(True)
    ref_q, ref_k = apply_rotary_pos_emb(q_leaf, k_leaf, cos, sin)
    dq, dk = torch.randn_like(ref_q), torch.randn_like(ref_k)
    want_dq, want_dk = torch.autograd.grad((ref_q, ref_k), (q_leaf, k_leaf), (dq, dk))

    got_q, got_k = liger.rotary_pos_emb(q, k, cos, sin)
    assert torch.allclose(got_q, want_q, atol=1e-6)
    assert torch.allclose(got_k, want_k, atol=1e-6)
    assert got_q.untyped_storage().data_ptr() == q_proj.untyped_storage().data_ptr()  # in place

    q_in = q.detach().clone().requires_grad_(True)
    k_in = k.detach().clone().requires_grad_(True)
    out_q, out_k = liger.RopeFunction.apply(q_in, k_in, cos, sin)
    got_dq, got_dk = torch.autograd.grad((out_q, out_k), (q_in, k_in), (dq, dk))
    assert torch.allclose(got_dq, want_dq, atol=1e-6)
    assert torch.allclose(got_dk, want_dk, atol=1e-6)


def _saved(fn: Any) -> list[tuple[int, ...]]:
    """Shapes of the tensors autograd saves while `fn` runs."""
    shapes: list[tuple[int, ...]] = []

    def pack(t: Any) -> Any:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


def test_stand_ins_save_what_liger_saves() -> None:
    x = torch.randn(2, 5, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    # LigerRMSNormFunction: X (the 2-D view), W, RSTD
    assert _saved(lambda: liger.RmsNormFunction.apply(x, w, 1e-6, 0.0, "llama", True)) == [
        (10, 32),
        (32,),
        (10,),
    ]
    a = torch.randn(2, 5, 48, requires_grad=True)
    b = torch.randn(2, 5, 48, requires_grad=True)
    # LigerSiLUMulFunction: the gate and up outputs, no activation
    assert _saved(lambda: liger.SiluMulFunction.apply(a, b)) == [(2, 5, 48), (2, 5, 48)]
    cos = torch.randn(1, 5, 8)
    q = torch.randn(2, 4, 5, 8, requires_grad=True)
    # LigerRopeFunction: cos and sin only
    assert _saved(lambda: liger.RopeFunction.apply(q * 1, q * 1, cos, cos)) == [
        (1, 5, 8),
        (1, 5, 8),
    ]
    hidden = torch.randn(10, 32, requires_grad=True)
    head = torch.randn(64, 32)
    target = torch.randint(0, 64, (10,))
    # LigerFusedLinearCrossEntropyFunction: the input's gradient (a frozen head: no weight's)
    assert _saved(
        lambda: liger.FusedLinearCrossEntropyFunction.apply(hidden, head, target, None)
    ) == [(10, 32)]
