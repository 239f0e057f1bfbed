"""The allocation schedule of an encoder's sequence-classification step (BERT), op by op.

transformers 5.24's BertForSequenceClassification (models/bert/modeling_bert.py) in training
mode, as the reference tracer records it (tests/data/traces/bert-*): word + token-type +
position embeddings, their LayerNorm and dropout; per layer query/key/value, bidirectional
attention (no mask: SDPA's kernel, or eager's scores, softmax and dropout of the
probabilities), attention.output.dense, dropout, the residual add and LayerNorm,
intermediate.dense with GELU, output.dense, dropout, add and LayerNorm; the pooler (dense and
tanh on the first token), dropout and the classifier, cross-entropy over num_labels. Each op's
backward frees what its node saved once it has run. Every allocation carries the component the
tracer labels it with, so the replay gives the allocated level and its breakdown phase by phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.core.libs.torch_kernels import EFFICIENT_LSE_PAD, LOSS_SCALARS
from service.core.result import Component, Phase
from service.core.schedule.program import _Grad, _Program, _Saved
from service.core.schedule.shapes import HALF_BYTES, Kernel, LinearShape, StepShape
from service.core.schedule.step import _Step
from service.core.units import BOOL_BYTES, FP32_BYTES, INT64_BYTES


@dataclass(frozen=True, slots=True, kw_only=True)
class EncoderShape:
    """What an encoder step adds to the decoder's `StepShape` (whose per-layer fields it uses:
    the linears, the kernel, the dtypes, checkpointing, the optimizer)."""

    step: StepShape
    labels: int  # the classifier's classes
    positions: int  # max_position_embeddings (the position table's rows)
    type_vocab: int  # type_vocab_size (the token-type table's rows)
    hidden_dropout: bool  # hidden_dropout_prob > 0 (embeddings and each residual branch)
    attention_dropout: bool  # attention_probs_dropout_prob > 0
    classifier_dropout: bool
    head_trainable: bool  # the pooler trains (full fine-tuning)
    classifier_trainable: bool  # full fine-tuning, or PEFT's SEQ_CLS modules_to_save copy
    weights: tuple[tuple[int, Component], ...]  # the model's tensors in creation order
    # DDP's reducer: its flat gradient buckets (allocated when it wraps the model), and
    # whether each .grad is a view into them (gradient_as_bucket_view)
    buckets: tuple[int, ...] = ()
    grads_in_buckets: bool = False


# An event `(key, RELABEL)` makes a live tensor a gradient: AccumulateGrad has stored it in
# .grad (the tracer's post-accumulate-grad hook), after the node that made it.
RELABEL = -1


@dataclass(slots=True)
class _LabelledProgram(_Program):
    """A program whose allocations carry the component they are allocated as; a gradient is
    a backward temporary until the next allocation, then a gradient."""

    component: Component = Component.ACTIVATIONS
    labels: dict[int, Component] = field(default_factory=dict)
    pending: list[int] = field(default_factory=list)
    relabelled: set[int] = field(default_factory=set)
    copied: list[int] = field(default_factory=list)  # gradients copied into DDP's buckets

    def alloc(self, nbytes: int) -> int:
        self.flush()
        key = _Program.alloc(self, nbytes)
        if key:
            self.labels[key] = self.component
        return key

    def flush(self) -> None:
        copied, self.copied = self.copied, []
        self.free(*copied)
        for key in self.pending:
            if key in self.refs and key not in self.relabelled:
                self.relabelled.add(key)
                self.events.append((key, RELABEL))
        self.pending.clear()


@dataclass(frozen=True, slots=True)
class EncoderEvents:
    """The step's events (`(key, nbytes)`: an allocation, a free when 0, a relabel as a
    gradient when RELABEL), each allocation's component, and where each phase window opens:
    `(step, phase, index of its first event)`, in order."""

    events: list[tuple[int, int]]
    labels: dict[int, Component]
    windows: list[tuple[int, Phase, int]]


class _EncoderStep(_Step):
    """Appends an encoder step's events (the decoder builder's linears and optimizer reused)."""

    def __init__(self, shape: EncoderShape, prog: _LabelledProgram) -> None:
        super().__init__(shape.step, prog)
        self.enc = shape
        self.lp = prog
        self.windows: list[tuple[int, Phase, int]] = []
        self.step_no = 0

    def _open(self, phase: Phase, component: Component) -> None:
        self.windows.append((self.step_no, phase, len(self.lp.events)))
        self.lp.component = component

    def grad(self, nbytes: int) -> None:
        if self.enc.grads_in_buckets:
            # AccumulateGrad copies the new gradient into its bucket view and lets it go
            key = self.p.alloc(nbytes)
            self.lp.labels[key] = Component.BACKWARD_TEMPORARIES
            self.lp.copied.append(key)
            return
        before = self.lp.component
        self.lp.component = Component.BACKWARD_TEMPORARIES
        try:
            _Step.grad(self, nbytes)
        finally:
            self.lp.component = before
        if self.grads and not self.accumulated:
            self.lp.pending.append(self.grads[-1])

    def gemm(self, bias: bool = False) -> None:
        """Every BERT linear has a bias (addmm, cuBLASLt): on the forward thread, and on the
        autograd thread when checkpointing reruns a layer there."""
        before = self.lp.component
        lt = self.handle == "forward" or before is Component.RECOMPUTE
        self.lp.component = Component.WORKSPACES
        try:
            _Step.gemm(self, bias or lt)
        finally:
            self.lp.component = before

    def linear(self, x: int, nbytes: int, lin: LinearShape, saved: _Saved | None) -> int:
        """A linear; a LoRA one with dropout (no autocast) as PEFT's lora.Linear runs it: the
        input cast to the adapters' dtype stays bound to `x` until forward returns, and the
        dropout keeps its mask only when that input needs a gradient."""
        sh = self.sh
        if not (lin.adapted and sh.dropout) or lin.trainable or lin.quantized or sh.autocast:
            return _Step.linear(self, x, nbytes, lin, saved)
        ad = sh.adapter
        self.gemm()
        base = self.a(nbytes * lin.d_out)
        cast = self.p.hold(x) if ad == nbytes else self.a(ad * lin.d_in)
        dropped = self.a(ad * lin.d_in)
        mask = self.a(BOOL_BYTES * lin.d_in)
        if saved is not None and self.input_needs_grad:
            saved.save(f"{lin.name}.mask", mask)
        self.f(mask)
        if saved is not None:
            saved.save(f"{lin.name}.cast", dropped)
        lora_a = self.a(ad * sh.rank)
        if saved is not None:
            saved.save(f"{lin.name}.lora_a", lora_a)
        lora_b = self.a(ad * lin.d_out)
        self.f(lora_a)
        scaled = self.a(ad * lin.d_out)
        self.f(lora_b)
        out = self.add_and_cast_back(base, scaled, lin.d_out, nbytes, ad)
        self.f(dropped, cast)
        return out

    def _trainable_autocast(
        self, x: int, nbytes: int, lin: LinearShape, saved: _Saved | None, stop: bool
    ) -> int:
        """A trained linear with a bias under autocast: the input's half cast, then the
        weight's and the bias's (both cached until the region exits); the matmul saves the
        input's and the weight's."""
        sh = self.sh
        half = self.p.hold(x) if nbytes == HALF_BYTES else self.a(HALF_BYTES * lin.d_in)
        weight = 0
        if sh.param_bytes != HALF_BYTES:
            weight = self.p.alloc(lin.weight_bytes * HALF_BYTES // sh.param_bytes)
            self.region += [weight, self.p.alloc(lin.d_out * HALF_BYTES)]
        if saved is not None:
            saved.save(f"{lin.name}.x", half)
            saved.save(f"{lin.name}.w", weight)
        self.gemm()
        out = self.a(HALF_BYTES * lin.d_out)
        self.f(half)
        return out

    def per_sequence(self, nbytes: int) -> int:
        return self.p.alloc(self.sh.batch * nbytes)

    # -- forward ----------------------------------------------------------------------------

    def dropout(self, x: int, nbytes: int, width: int, saved: _Saved | None, name: str) -> int:
        """native_dropout: the output and a one-byte mask, saved when autograd records."""
        out = self.a(nbytes * width)
        mask = self.a(BOOL_BYTES * width)
        if saved is not None:
            saved.save(name, mask)
        self.f(mask)
        return out

    def layer_norm(self, x: int, saved: _Saved | None, name: str) -> int:
        """native_layer_norm: the output, an fp32 mean and rstd per token; the input, mean and
        rstd saved when autograd records."""
        sh = self.sh
        out = self.a(sh.residual * sh.hidden)
        mean = self.a(FP32_BYTES)
        rstd = self.a(FP32_BYTES)
        if saved is not None:
            saved.save(f"{name}.x", x)
            saved.save(f"{name}.mean", mean)
            saved.save(f"{name}.rstd", rstd)
        self.f(mean, rstd)
        return out

    def layer(self, x: int, saved: _Saved | None) -> int:
        """One BertLayer's forward; `saved` collects what its backward needs (None: the
        checkpointed first pass, nothing kept)."""
        sh = self.sh
        enc = self.enc
        nb = sh.residual
        h = sh.hidden
        self.input_needs_grad = self._input_grad
        q, k, v = (self.linear(x, nb, lin, saved) for lin in sh.qkv)
        self.input_needs_grad = True
        qb = self.out_bytes(sh.qkv[0], nb)
        attn = self._self_attention(q, k, v, qb, saved)
        o = self.linear(attn, qb, sh.out_proj, saved)
        ob = self.out_bytes(sh.out_proj, qb)
        d = self.dropout(o, ob, h, saved, "drop1") if enc.hidden_dropout else self.p.hold(o)
        self.f(o)
        r = self.a(nb * h)  # dropout(o) + x, promoted to the residual's dtype
        n1 = self.layer_norm(r, saved, "ln1")
        self.f(d, r, attn)
        i1 = self.linear(n1, nb, sh.mlp_in[0], saved)
        ib = self.out_bytes(sh.mlp_in[0], nb)
        g = self.a(ib * sh.intermediate)  # GELU keeps its input
        if saved is not None:
            saved.save("gelu.x", i1)
        self.f(i1)
        o2 = self.linear(g, ib, sh.mlp_out, saved)
        ob2 = self.out_bytes(sh.mlp_out, ib)
        d2 = self.dropout(o2, ob2, h, saved, "drop2") if enc.hidden_dropout else self.p.hold(o2)
        self.f(o2)
        r2 = self.a(nb * h)
        n2 = self.layer_norm(r2, saved, "ln2")
        self.f(d2, r2, g, n1)  # feed_forward_chunk's locals, then the layer's
        self.f(self.attn_weights)
        self.attn_weights = 0
        return n2

    def _self_attention(self, q: int, k: int, v: int, qb: int, saved: _Saved | None) -> int:
        """BertSelfAttention without a mask: SDPA's kernel (dropout inside it), or eager's."""
        sh = self.sh
        h = sh.hidden
        if sh.kernel is Kernel.EAGER:
            return self._eager(q, k, v, qb, saved)
        out = self.a(qb * h)
        if sh.kernel is Kernel.EFFICIENT:
            padded = -(-sh.seq // EFFICIENT_LSE_PAD) * EFFICIENT_LSE_PAD
            lse = self.per_sequence(FP32_BYTES * sh.heads * padded)
        else:
            lse = self.a(FP32_BYTES * sh.heads)
        if saved is not None:
            for name, key in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
                saved.save(name, key)
        self.f(lse, q, k, v)
        return out

    def _eager(self, q: int, k: int, v: int, qb: int, saved: _Saved | None) -> int:
        """eager_attention_forward: query and key made contiguous for the score bmm (views for
        one sequence), scores, * scaling, softmax (fp32 under autocast), dropout, the value
        made contiguous, probs @ v, the transposed output made contiguous."""
        sh = self.sh
        h = sh.hidden
        scores = sh.heads * sh.seq
        many = sh.batch > 1
        sb = FP32_BYTES if sh.autocast else qb  # autocast runs softmax in fp32
        q_c = self.a(qb * h) if many else self.p.hold(q)
        k_c = self.a(qb * h) if many else self.p.hold(k)
        s1 = self.a(qb * scores)
        self.gemm()
        s2 = self.a(qb * scores)
        self.f(s1)
        up = self.a(sb * scores) if sb != qb else 0  # autocast's fp32 cast of the scores
        probs = self.a(sb * scores)
        if saved is not None and sh.softmax_saves_input:
            saved.save("softmax.x", up or s2)
        self.f(s2, up)
        if self.enc.attention_dropout:
            dropped = self.dropout(probs, sb, scores, saved, "attn_mask")
        else:
            dropped = self.p.hold(probs)
        cast = self.a(qb * scores) if sb != qb else self.p.hold(dropped)
        v_c = self.a(qb * h) if many else self.p.hold(v)
        out = self.a(qb * h)
        if saved is not None:
            for name, key in (("q_c", q_c), ("k_c", k_c), ("probs", probs)):
                saved.save(name, key)
            saved.save("dropped", cast)
            saved.save("v_c", v_c)
        out_t = self.a(qb * h)
        self.f(out)
        self.f(q_c, k_c, probs, cast, v_c)
        self.f(q, k, v)
        # the probabilities are returned too (attn_weights), bound to BertLayer.forward's `_`
        # until the layer returns
        self.attn_weights = dropped
        return out_t

    def embeddings(self, saved: _Saved | None) -> tuple[int, int]:
        """BertEmbeddings: the token-type ids gathered from the buffer, word and token-type
        embeddings, their sum, the position embeddings (one sequence's) added, LayerNorm,
        dropout. Returns the output and the gathered ids (kept by a trained embedding)."""
        sh = self.sh
        nb, h = sh.residual, sh.hidden
        ids = self.p.alloc(sh.seq * INT64_BYTES)
        words = self.a(nb * h)
        types = self.a(nb * h)
        summed = self.a(nb * h)
        positions = self.p.alloc(sh.seq * h * nb)
        with_positions = self.a(nb * h)
        self.f(summed)
        normed = self.layer_norm(with_positions, saved, "emb_ln")
        self.f(with_positions)
        if self.enc.hidden_dropout:
            out = self.dropout(normed, nb, h, saved, "emb_drop")
        else:
            out = self.p.hold(normed)
        if saved is not None and not sh.embed_trainable:
            # HF Trainer's enable_input_require_grads() makes the word embeddings' output a
            # leaf that needs a gradient: the graph's AccumulateGrad node keeps it
            saved.save("words", words)
        self.f(normed, words, types, positions)
        if not sh.embed_trainable:
            self.f(ids)
            ids = 0
        return out, ids

    def head(self, last: int, embedded: int, saved: _Saved) -> None:
        """The pooler (dense + tanh on the first token), dropout, the classifier and the
        cross-entropy: per-sequence tensors. BertModel.forward's `embedding_output` local
        (the first layer's input) goes when it returns, after the pooler."""
        sh = self.sh
        enc = self.enc
        h = sh.hidden
        nb = sh.residual
        hb = HALF_BYTES if sh.autocast else nb
        if sh.autocast:
            # the first token's half cast (saved by a trained pooler), and the trained
            # weights' half copies (cached until the region exits, saved by the matmul)
            first = self.per_sequence(HALF_BYTES * h)
            if enc.head_trainable:
                saved.save("pooler.x", first)
                weight = self.p.alloc(h * h * HALF_BYTES)
                self.region += [weight, self.p.alloc(h * HALF_BYTES)]
                saved.save("pooler.w", weight)
            self.f(first)
        elif enc.head_trainable:
            saved.save("pooler.x", last)  # a view of the last hidden state keeps all of it
        pooled = self.per_sequence(hb * h)
        self.gemm()
        tanh = self.per_sequence(hb * h)
        saved.save("tanh", tanh)
        self.f(pooled, embedded)
        if enc.classifier_dropout:
            dropped = self.per_sequence(hb * h)
            mask = self.per_sequence(BOOL_BYTES * h)
            saved.save("cls_mask", mask)
            self.f(mask)
        else:
            dropped = self.p.hold(tanh)
        if enc.classifier_trainable:
            saved.save("classifier.x", dropped)
        self.lp.component = Component.LOGITS_LOSS  # from the classifier on (its pre-hook)
        logits = self.per_sequence(hb * enc.labels)
        upcast = self.per_sequence(FP32_BYTES * enc.labels) if hb != FP32_BYTES else 0
        logp = self.per_sequence(FP32_BYTES * enc.labels if upcast else hb * enc.labels)
        saved.save("logp", logp)
        if self.sh.softmax_saves_input:
            saved.save("logp.x", upcast or logits)
        self.f(upcast)
        loss, total_weight = (self.p.alloc(FP32_BYTES) for _ in range(LOSS_SCALARS))
        self.f(total_weight)
        saved.save("loss", loss)
        self.f(logp, loss, dropped, tanh, logits)

    # -- backward ---------------------------------------------------------------------------

    def head_backward(self, saved: _Saved) -> int:
        """The loss's and the head's backward; returns the last hidden state's gradient
        (select_backward: zeros but for the first token)."""
        sh = self.sh
        enc = self.enc
        h = sh.hidden
        nb = sh.residual
        hb = HALF_BYTES if sh.autocast else nb
        pb = sh.param_bytes
        ones = self.p.alloc(FP32_BYTES)
        g_nll = self.per_sequence(FP32_BYTES * enc.labels)
        self.f(ones)
        saved.release("loss")
        g = self.per_sequence(FP32_BYTES * enc.labels)
        self.f(g_nll)
        saved.release("logp", "logp.x")
        if hb != FP32_BYTES:
            cast = self.per_sequence(hb * enc.labels)
            self.f(g)
            g = cast
        self._open(Phase.BACKWARD, Component.BACKWARD_TEMPORARIES)
        self.handle = "backward"
        g_x = self.per_sequence(hb * h)
        self.gemm()
        if enc.classifier_trainable:
            self.grad(enc.labels * h * pb)
            self.grad(enc.labels * pb)
        saved.release("classifier.x")
        self.f(g)
        if enc.classifier_dropout:
            g_d = self.per_sequence(hb * h)
            self.f(g_x)
            saved.release("cls_mask")
            g_x = g_d
        g_t = self.per_sequence(hb * h)
        self.f(g_x)
        saved.release("tanh")
        g_first = self.per_sequence(hb * h)
        if enc.head_trainable:
            self.grad(h * h * pb)
            self.grad(h * pb)
        saved.release("pooler.x", "pooler.w")
        self.f(g_t)
        if hb != nb:
            wide = self.per_sequence(nb * h)
            self.f(g_first)
            g_first = wide
        g_out = self.a(nb * h)
        self.f(g_first)
        return g_out

    def ln_backward(self, g: int, saved: _Saved, name: str) -> int:
        sh = self.sh
        dx = self.a(sh.residual * sh.hidden)
        if sh.norm_trainable:
            self.grad(sh.hidden * sh.param_bytes)
            self.grad(sh.hidden * sh.param_bytes)
        saved.release(f"{name}.mean", f"{name}.rstd", f"{name}.x")
        self.f(g)
        return dx

    def dropout_backward(self, g: int, nbytes: int, saved: _Saved, name: str) -> int:
        """The residual branch's gradient through its dropout (g kept: the residual uses it),
        cast first to the branch's narrower dtype under autocast."""
        sh = self.sh
        h = sh.hidden
        cast = self.a(nbytes * h) if nbytes != sh.residual else self.p.hold(g)
        if not self.enc.hidden_dropout:
            return cast
        out = self.a(nbytes * h)
        self.f(cast)
        saved.release(name)
        return out

    def _linear_backward(self, c: _Grad) -> int:
        """A linear's backward with its bias: a trained one (AddmmBackward) makes the input's
        gradient, the weight's and the bias's (a sum over tokens), then lets go of the output's
        gradient and its saved input; the rest as for a decoder's linears."""
        sh = self.sh
        g, nbytes, lin, saved, x_grad = c.g, c.nbytes, c.lin, c.saved, c.x_grad
        acc, in_bytes = c.acc, c.in_bytes
        if not lin.trainable or sh.autocast:
            gin = _Step._linear_backward(self, c)
            if lin.trainable:
                self.grad(lin.d_out * sh.param_bytes)
            return gin
        gin = 0
        if x_grad:
            gin = self.a(nbytes * lin.d_in)
            self.gemm()
        self.grad(lin.weight_bytes)
        # the bias's gradient comes out of the same node: AccumulateGrad runs after both
        waiting, self.lp.pending = self.lp.pending, []
        self.grad(lin.d_out * sh.param_bytes)
        self.lp.pending = waiting + self.lp.pending
        self.f(g)
        saved.release(f"{lin.name}.x")
        if not x_grad:
            return acc
        gin = self._plus(acc, gin, in_bytes * lin.d_in)
        return gin

    def layer_backward(  # type: ignore[override]
        self, g_out: int, saved: _Saved, *, x_grad: bool, recompute: bool
    ) -> int:
        sh = self.sh
        nb = sh.residual
        h = sh.hidden
        if recompute:
            self._recompute_layer(saved)
        qb = self.out_bytes(sh.qkv[0], nb)
        ob = self.out_bytes(sh.out_proj, qb)
        ib = self.out_bytes(sh.mlp_in[0], nb)
        ob2 = self.out_bytes(sh.mlp_out, ib)
        g_r2 = self.ln_backward(g_out, saved, "ln2")
        g_d2 = self.dropout_backward(g_r2, ob2, saved, "drop2")
        g_g = self.linear_backward(g_d2, ob2, sh.mlp_out, saved, x_grad=True, in_bytes=ib)
        g_i1 = self.a(ib * sh.intermediate)  # GELU's backward
        saved.release("gelu.x")
        self.f(g_g)
        g_n1 = self.linear_backward(
            g_i1, ib, sh.mlp_in[0], saved, x_grad=True, acc=g_r2, in_bytes=nb
        )
        g_r1 = self.ln_backward(g_n1, saved, "ln1")
        g_d1 = self.dropout_backward(g_r1, ob, saved, "drop1")
        g_attn = self.linear_backward(g_d1, ob, sh.out_proj, saved, x_grad=True, in_bytes=qb)
        dq, dk, dv = self._attention_grads(g_attn, qb, saved)
        gx = g_r1
        for g, lin in ((dv, sh.qkv[2]), (dk, sh.qkv[1]), (dq, sh.qkv[0])):
            if sh.kernel is Kernel.EAGER:
                # the bmm's (batch x heads) gradient back in the projection's layout: a copy
                contiguous = self.a(qb * h)
                self.f(g)
                g = contiguous
            gx = self.linear_backward(g, qb, lin, saved, x_grad=x_grad, acc=gx, in_bytes=nb)
        saved.release_all()
        if not x_grad:
            self.f(gx)
            return 0
        return gx

    def _attention_grads(self, g: int, qb: int, saved: _Saved) -> tuple[int, int, int]:
        sh = self.sh
        h = sh.hidden
        if sh.kernel is not Kernel.EAGER:
            grads = (self.a(qb * h), self.a(qb * h), self.a(qb * h))
            self.f(g)
            saved.release("lse", "q", "k", "v", "out")
            return grads
        scores = sh.heads * sh.seq
        sb = FP32_BYTES if sh.autocast else qb
        g_c = self.a(qb * h) if sh.batch > 1 else self.p.hold(g)
        self.f(g)
        dv = self.a(qb * h)
        d_probs = self.a(qb * scores)
        self.gemm()
        self.f(g_c)
        saved.release("v_c", "dropped")
        if sb != qb:
            wide = self.a(sb * scores)
            self.f(d_probs)
            d_probs = wide
        if self.enc.attention_dropout:
            d_drop = self.a(sb * scores)
            self.f(d_probs)
            saved.release("attn_mask")
            d_probs = d_drop
        d_soft = self.a(sb * scores)
        self.f(d_probs)
        saved.release("probs", "softmax.x")
        if sb != qb:
            narrow = self.a(qb * scores)
            self.f(d_soft)
            d_soft = narrow
        scaled = self.a(qb * scores)
        self.f(d_soft)
        dq = self.a(qb * h)
        dk = self.a(qb * h)
        self.f(scaled)
        saved.release("q_c", "k_c")
        return dq, dk, dv

    def _recompute_layer(self, saved: _Saved) -> None:
        """Non-reentrant checkpointing reruns the whole layer (its LayerNorm's mean and rstd,
        saved last, are made by its last op); the rerun's output is dropped."""
        before = self.lp.component
        self.lp.component = Component.RECOMPUTE
        checkpoint = self.checkpoint
        out = self.layer(checkpoint, saved)
        self.end_region()
        self.f(out)
        self.lp.component = before

    def embeddings_backward(self, g: int, saved: _Saved, ids: int) -> None:
        """Dropout's and LayerNorm's backward, then each table's gradient: the positions'
        summed over the batch first, the token types', the words'."""
        sh = self.sh
        enc = self.enc
        nb, h, pb = sh.residual, sh.hidden, sh.param_bytes
        g_d = self.dropout_backward(g, nb, saved, "emb_drop")
        self.f(g)
        g_n = self.ln_backward(g_d, saved, "emb_ln")
        summed = self.p.alloc(sh.seq * h * nb)
        self.grad(enc.positions * h * pb)
        self.f(summed)
        self.grad(enc.type_vocab * h * pb)
        self.f(ids)
        self.grad(sh.vocab * h * pb)
        self.f(g_n)

    # -- the step ---------------------------------------------------------------------------

    def _micro_batch(self) -> None:
        sh = self.sh
        self.handle = "forward"
        self._open(Phase.FORWARD_END, Component.ACTIVATIONS)
        emb_saved = _Saved(self.p) if sh.input_grad else None
        x, ids = self.embeddings(emb_saved)
        embedded = self.p.hold(x)
        x, layers, checkpoints = self._layers_forward(x)
        head = _Saved(self.p)
        self.head(x, embedded, head)
        self.f(x)  # the model's output object goes once the loss is read
        self.end_region()  # the forward's autocast region exits
        self._open(Phase.BACKWARD_START, Component.LOGITS_LOSS)
        g = self.head_backward(head)
        for index in reversed(range(sh.layers)):
            x_grad = self._input_grad = index > 0 or sh.input_grad
            if sh.checkpointing:
                self.checkpoint = checkpoints[index]
                saved = _Saved(self.p)
                g = self.layer_backward(g, saved, x_grad=x_grad, recompute=True)
                self.f(self.checkpoint)
            else:
                g = self.layer_backward(g, layers[index], x_grad=x_grad, recompute=False)
        if emb_saved is not None:
            if sh.embed_trainable:
                self.embeddings_backward(g, emb_saved, ids)
            else:
                # through dropout and LayerNorm into the leaf's .grad, freed with the graph
                g_d = self.dropout_backward(g, sh.residual, emb_saved, "emb_drop")
                self.f(g)
                self.f(self.ln_backward(g_d, emb_saved, "emb_ln"))
            emb_saved.release_all()
        self.handle = "forward"

    checkpoint = 0
    input_needs_grad = True  # the linear being run reads an input that needs a gradient
    attn_weights = 0  # eager attention's probabilities, returned beside its output

    def step(self) -> None:
        self.step_no += 1
        # gradients that the last step's zero_grad(set_to_none=False) kept: added into in place
        self.accumulated = bool(self.grads)
        for _ in range(self.sh.accumulation):
            self._micro_batch()
            self.accumulated = True
        self._open(Phase.OPTIMIZER_STEP, Component.OPTIMIZER_TEMPORARIES)
        self.lp.pending += self.grads  # half weights' gradients, kept as .grad
        self.lp.flush()
        before = len(self.states)
        self.optimizer()
        for key in self.states[before:]:
            self.lp.labels[key] = Component.OPTIMIZER_STATE


def encoder_events(shape: EncoderShape, steps: int = 2) -> EncoderEvents:
    """The events of the weights (first) and `steps` training steps of an encoder."""
    prog = _LabelledProgram()
    for nbytes, component in shape.weights:
        prog.component = component
        prog.alloc(nbytes)
    prog.component = Component.COMMUNICATION
    for nbytes in shape.buckets:
        prog.alloc(nbytes)
    prog.component = Component.INPUTS
    prog.alloc(shape.step.tokens * INT64_BYTES)  # input_ids
    prog.alloc(shape.step.batch * INT64_BYTES)  # labels: one class id per sequence
    builder = _EncoderStep(shape, prog)
    builder.windows.append((0, Phase.FORWARD_END, 0))  # before the first step: the model
    for _ in range(steps):
        builder.step()
    return EncoderEvents(events=prog.events, labels=prog.labels, windows=builder.windows)
