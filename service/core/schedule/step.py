"""A training step's events: micro-batches, the loss, checkpointing, the optimizer."""

from __future__ import annotations

from service.core.arch import SCORE_OUTPUTS
from service.core.libs.optimizers import FP32_COPIES, Updater
from service.core.libs.peft import LORAFA_AUTOCAST_BYTES
from service.core.libs.trl import DPO_RUNNING_STATS, DPO_TILE_TOKENS, DPO_TILE_VOCAB, PAIR_SIDES
from service.core.liger import liger_chunk_rows
from service.core.schedule.backward import _Backward
from service.core.schedule.generation import generation_events
from service.core.schedule.program import _Program, _Saved, _Stop
from service.core.schedule.shapes import HALF_BYTES, Event, Kernel, StepShape
from service.core.units import BOOL_BYTES, FP32_BYTES, INT32_BYTES, INT64_BYTES

# q-sized copies around SDPA's math kernel without grad: k and v expanded to every head, the
# scaled q and its contiguous copy (reference trace llama-3_2-1b__qlora__dpo__*__b2-s1024).
MATH_REFERENCE_COPIES = 4


class _Step(_Backward):
    """Appends the events of training steps to a program."""

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> None:
        """One optimizer step: `accumulation` micro-batches, their gradients added up in
        .grad (the first creates it; later ones are added in place and freed), then the
        optimizer."""
        self.accumulated = bool(self.grads)  # kept by zero_grad(set_to_none=False)
        self.f(*self.buffered)
        self.buffered = generation_events(self.sh, self.p) if self.sh.generation_tokens else []
        for _ in range(self.sh.accumulation):
            self._micro_batch()
            self.accumulated = True
        self.optimizer()

    def _layers_forward(self, x: int) -> tuple[int, list[_Saved], list[int]]:
        """Every layer's forward from `x` (released as each layer returns): the last output,
        each layer's saved tensors, and with checkpointing each layer's kept input instead."""
        sh = self.sh
        layers: list[_Saved] = []
        checkpoints: list[int] = []
        self.pins.clear()
        for index in range(sh.layers):
            self._input_grad = index > 0 or sh.input_grad
            if sh.checkpointing:
                checkpoints.append(self.p.hold(x))
                self.pinned = []
                out = self.layer(x, None)
                self.pins.append(self.pinned)
                self.pinned = None
            else:
                saved = _Saved(self.p)
                out = self.layer(x, saved)
                layers.append(saved)
            self.f(x)
            x = out
        return x, layers, checkpoints

    def _micro_batch(self) -> None:
        sh = self.sh
        h = sh.hidden
        self.handle = "forward"
        leaf = 0
        if sh.kto_kl:
            # KTOTrainer._compute_kl_logps: the KL batch through the policy under no_grad
            self._dpo_reference_forward(policy=True)
        if sh.virtual_tokens:
            embed, leaf = self._prompt_forward()
        else:
            embed = self.a(sh.residual * h)
        if sh.embed_scale:
            scaled = self.a(sh.residual * h)
            self.f(embed)
            embed = scaled
        embedded, embed_norm = 0, _Saved(self.p)
        if sh.alibi:
            # BLOOM's word_embeddings_layernorm: the embedding's output stays referenced
            # until the model's forward returns, and is saved when it takes a gradient.
            embedded = embed
            embed = self.a(sh.residual * h)
            stats = [self.a(FP32_BYTES), self.a(FP32_BYTES)]  # mean, rstd
            if sh.input_grad:
                for name, key in zip(("x", "mean", "rstd"), (embedded, *stats), strict=True):
                    embed_norm.save(name, key)
            self.f(*stats)
        masks = self._attention_masks()
        if sh.prefix_tokens:
            # prefix tuning: the cache, and transformers' causal mask over the longer keys,
            # (1, 1, s, s + virtual) expanded to the batch as a view
            self.prefix_forward()
            masks.append(self.p.alloc(sh.seq * (sh.seq + sh.prefix_tokens)))
        x, layers, checkpoints = self._layers_forward(self.p.hold(embed))
        self._input_grad = True
        final = _Saved(self.p)
        fn = self.norm(x, final, "final")
        # PEFT's prompt-tuning forward holds the concatenated input until the causal LM (and
        # its loss) returns; the model's own embedding output is let go before the LM head
        self.f(x, 0 if sh.virtual_tokens else embed, embedded, self.held)
        self.held = 0
        if not sh.checkpointing:
            self.f(*masks)
        logits, logp = self.loss_forward(fn)
        if sh.virtual_tokens:
            self.f(embed)
        if sh.prefix_tokens:
            self.prefix_forward_end()
        self.end_region()  # the forward's autocast region exits
        self.handle = "backward"
        g = self.loss_backward(logits, logp, fn, final)
        for index in reversed(range(sh.layers)):
            self._input_grad = index > 0 or sh.input_grad
            x_grad = self._input_grad
            if sh.checkpointing:
                saved = _Saved(self.p)
                checkpoint = checkpoints[index]

                def recompute(saved: _Saved = saved, checkpoint: int = checkpoint) -> None:
                    self._recompute(checkpoint, saved)

                g = self.layer_backward(g, saved, x_grad=x_grad, recompute=recompute)
                self.f(checkpoint, *self.pins[index])
            else:
                g = self.layer_backward(g, layers[index], x_grad=x_grad, recompute=None)
        if sh.prefix_tokens:
            self.prefix_backward_end()
        self._embedding_backward(g, embedded, embed_norm)
        self.f(leaf)
        if sh.checkpointing:
            self.f(*masks)

    def _attention_masks(self) -> list[int]:
        """The attention masks transformers builds for the step's forward (none without a
        sliding window shorter than the sequence)."""
        sh = self.sh
        mask_bytes = sh.batch * sh.seq * sh.seq * sh.mask_bytes
        bools = sh.batch * sh.seq * sh.seq
        masks = []
        for index in range(sh.masks if sh.window_mask else 0):
            if sh.mask_bytes != 1:
                # eager's additive mask (masking_utils eager_mask): the boolean one (the causal
                # comparison; a sliding one's window comparison and its ands too), then where
                boolean = self.p.alloc(bools)
                if index:
                    window = boolean
                    first = self.p.alloc(bools)
                    self.f(window)
                    causal = self.p.alloc(bools)
                    boolean = self.p.alloc(bools)
                    self.f(causal, first)
                masks.append(self.p.alloc(mask_bytes))
                self.f(boolean)
            else:
                # transformers' boolean sliding-window mask (masking_utils sdpa_mask): the
                # window's comparison, its and with the padding term, the causal comparison and
                # the final and, each (1, 1, s, s) (expanded to the batch as a view)
                window = self.p.alloc(sh.seq * sh.seq)
                first = self.p.alloc(sh.seq * sh.seq)
                self.f(window)
                causal = self.p.alloc(sh.seq * sh.seq)
                masks.append(self.p.alloc(sh.seq * sh.seq))
                self.f(causal, first)
        return masks

    def _embedding_backward(self, g: int, embedded: int, embed_norm: _Saved) -> None:
        """The input embedding's backward from its output's gradient `g` (0: none): the
        embedding LayerNorm's (BLOOM), then the table's gradient, tied or not, or prompt
        tuning's."""
        sh = self.sh
        h = sh.hidden
        if g and embedded:  # the embedding LayerNorm's backward
            g_embed = self.a(sh.residual * h)
            self.f(g)
            embed_norm.release_all()
            g = g_embed
        if g:
            if sh.embed_trainable and sh.tied and (self.grads or self.accumulated):
                # The tied weight's LM-head gradient waits in AccumulateGrad's input buffer (or
                # in .grad): the embedding's is added out of place (old, new and their sum
                # coexist).
                new = self.p.alloc(sh.vocab * h * sh.residual)
                self.f(g)
                total = self.p.alloc(sh.vocab * h * sh.residual)
                if self.accumulated:
                    self.f(self.head_grad, new, total)  # then added into .grad in place
                else:
                    self.f(self.grads.pop(0), new)
                    if sh.in_backward:
                        self.f(total)  # the tied table stepped, its gradient set to None
                    else:
                        self.grads.append(total)
            elif sh.embed_trainable:
                self.grad(sh.vocab * h * sh.residual)
                self.f(g)
            elif sh.virtual_tokens:
                self._prompt_backward(g)
            else:
                self.f(g)

    def _prompt_forward(self) -> tuple[int, int]:
        """Prompt tuning's input (peft/peft_model.py PeftModelForCausalLM.forward, get_prompt):
        the embedded input ids; the virtual tokens embedded once (fp32) and repeated over the
        batch, cast to the input's dtype; both concatenated. Returns the concatenation and what
        outlives it until backward ends: the embedded ids when checkpointing's
        enable_input_require_grads made them a leaf that takes a gradient (AccumulateGrad
        keeps it), else 0."""
        sh = self.sh
        h = sh.hidden
        prompt_tokens = sh.batch * sh.virtual_tokens
        embedded = self.p.alloc((self.t - prompt_tokens) * h * sh.residual)
        once = self.p.alloc(sh.virtual_tokens * h * FP32_BYTES)
        repeated = self.p.alloc(prompt_tokens * h * FP32_BYTES)
        self.f(once)
        prompts = repeated
        if sh.residual != FP32_BYTES:
            prompts = self.p.alloc(prompt_tokens * h * sh.residual)
            self.f(repeated)
        joined = self.a(sh.residual * h)
        self.f(prompts)
        if sh.checkpointing:
            return joined, embedded
        self.f(embedded)
        return joined, 0

    def _prompt_backward(self, g: int) -> None:
        """The concatenation's backward hands the virtual tokens a slice of `g` (released
        here): cast back to fp32, summed over the batch (the repeat's backward), then the
        embedding's backward makes the gradient."""
        sh = self.sh
        once = sh.virtual_tokens * sh.hidden * FP32_BYTES
        wide = self.p.alloc(sh.batch * once)
        self.f(g)
        if sh.batch > 1:
            summed = self.p.alloc(once)
            self.f(wide)
            wide = summed
        self.grad(once)
        self.f(wide)

    def _recompute(self, checkpoint: int, saved: _Saved) -> None:
        """Run the layer again with autograd until its last saved tensor exists (non-reentrant
        checkpointing stops there), then drop everything it made that nothing saved."""
        down = self.sh.mlp_out
        self.stop_at = down.name if (down.adapted or down.trainable) else None
        live_before = set(self.p.refs)
        try:
            self.f(self.layer(checkpoint, saved))
            self.end_region()  # the recomputation's own autocast region
        except _Stop:
            # What the unwound forward held goes; what the saved slots hold stays.
            held: dict[int, int] = {}
            for key in saved.slots.values():
                held[key] = held.get(key, 0) + 1
            refs = self.p.refs
            # (a workspace the recomputation's first GEMM took stays: the handle keeps it)
            made = [k for k in refs if k not in live_before and k not in self.workspaces]
            for key in made:
                while refs.get(key, 0) > held.get(key, 0):
                    self.p.free(key)
            self.region.clear()
            self.pending = 0  # freed above with the rest of the unwound forward
        finally:
            self.stop_at = None

    def loss_forward(self, fn: int) -> tuple[int, int]:
        sh = self.sh
        v = sh.vocab
        if sh.dpo_scored:
            return self._dpo_forward(fn), 0
        if sh.score_head:
            self._score_forward()
            return 0, 0
        if sh.liger:
            self._liger_loss_forward(fn)
            return 0, 0
        if not sh.loss_materialised:
            self.f(fn) if not sh.head_trainable else None
            if sh.adalora:
                # a chunked or fused loss is still the model's `.loss`, which
                # AdaLoraModel.forward adds its penalty to (as loss_backward takes it back)
                self.penalty_forward()
            return 0, 0
        x_half = 0
        if sh.autocast:
            # F.linear under autocast: the head's half weight copy (kept for the backward) and
            # the input's half copy (kept only when the head trains)
            self.head_copy = self.p.alloc(sh.head_weight_copy)
            x_half = self.a(HALF_BYTES * sh.hidden) if sh.residual != HALF_BYTES else 0
        logits = self.a(sh.head_bytes * v)
        self.gemm()
        if not sh.head_trainable:
            self.f(x_half)
        if sh.orpo_logits:
            return self._orpo_forward(logits, fn)
        self.softcap_tanh = 0
        if sh.final_softcap:  # logits / cap, tanh (kept for backward), * cap
            divided = self.a(sh.head_bytes * v)
            self.f(logits)
            self.softcap_tanh = self.a(sh.head_bytes * v)
            self.f(divided)
            logits = self.a(sh.head_bytes * v)
        upcast = self.a(FP32_BYTES * v) if sh.loss_upcast and sh.head_bytes != FP32_BYTES else 0
        logp = self.a((FP32_BYTES if sh.loss_upcast else sh.head_bytes) * v)
        self.f(upcast)
        if not sh.head_trainable:
            self.f(fn)
        if sh.adalora:
            # AdaLoraModel.forward holds the outputs while it adds its penalty to the loss
            self.penalty_forward()
        self.f(logits)  # the outputs object is dropped once `.loss` is read
        return logits, logp

    def loss_backward(self, logits: int, logp: int, fn: int, final: _Saved) -> int:
        sh = self.sh
        v = sh.vocab
        if sh.dpo_scored:
            return self.norm_backward(self._dpo_head_backward(), final, "final")
        if sh.score_head:
            return self.norm_backward(self._score_backward(fn), final, "final")
        if sh.liger:
            grad_input, grad_weight = self.liger_grads
            self.liger_grads = (0, 0)
            if grad_weight:  # AccumulateGrad takes the saved weight gradient as it is
                if self.accumulated and sh.tied and sh.embed_trainable:
                    self.head_grad = grad_weight
                elif self.accumulated:
                    self.f(grad_weight)
                else:
                    self.grads.append(grad_weight)
            return self.norm_backward(grad_input, final, "final")
        g = 0
        if sh.adalora:
            self.penalty_backward()
        if sh.orpo_logits:
            g = self._orpo_backward(logits, logp)
        elif sh.loss_materialised:
            lb = FP32_BYTES if sh.loss_upcast else sh.head_bytes
            g1 = self.a(lb * v)
            g2 = self.a(lb * v)
            self.f(g1, logp)
            g = g2
            if lb != sh.head_bytes:
                g = self.a(sh.head_bytes * v)
                self.f(g2)
            if sh.final_softcap:  # * cap, tanh's backward, / cap
                for release in (False, True, False):
                    nxt = self.a(sh.head_bytes * v)
                    self.f(g)
                    if release:
                        self.f(self.softcap_tanh)
                    g = nxt
        weight = sh.vocab * sh.hidden
        half_weight = sh.head_trainable and sh.autocast and sh.param_bytes != HALF_BYTES
        if sh.head_trainable and not half_weight:
            self._head_gradient(weight * (sh.param_bytes if sh.autocast else sh.head_bytes))
        gh = self.a(sh.head_bytes * sh.hidden)
        self.gemm()
        half = self.p.alloc(weight * HALF_BYTES) if half_weight else 0
        self.f(g)
        if half_weight:
            # the half weight's gradient, cast to the weight's dtype into its .grad
            self._head_gradient(weight * sh.param_bytes)
            self.f(half)
        if sh.head_trainable:
            self.f(fn)
        if sh.autocast:
            self.f(self.head_copy)
            self.head_copy = 0
            if sh.residual != sh.head_bytes:  # the input cast's backward
                wide = self.a(sh.residual * sh.hidden)
                self.f(gh)
                gh = wide
        return self.norm_backward(gh, final, "final")

    def _liger_loss_forward(self, fn: int) -> None:
        """LigerForCausalLMLoss on the final hidden states `fn` (released): the labels padded
        and shifted (int64), then LigerFusedLinearCrossEntropyFunction.forward: the input's
        gradient (and, when the head trains, the weight's) zeroed and kept for backward, an
        fp32 loss per token and the label mask, then chunk by chunk the logits (overwritten
        with their gradient in place), the input gradient's slice (a GEMM output copied in)
        and the weight's `mm(...).float()` added in (liger_kernel/ops/
        fused_linear_cross_entropy.py fused_linear_cross_entropy_forward)."""
        sh = self.sh
        v, h, hb = sh.vocab, sh.hidden, sh.head_bytes
        padded = self.p.alloc(sh.batch * (sh.seq + 1) * INT64_BYTES)
        shifted = self.a(INT64_BYTES)
        grad_input = self.a(hb * h)
        grad_weight = self.p.alloc(v * h * hb) if sh.head_trainable else 0
        losses = self.a(FP32_BYTES)
        mask = self.a(BOOL_BYTES)
        rows = liger_chunk_rows(sh.tokens, v, h)
        for start in range(0, sh.tokens, rows):
            n = min(rows, sh.tokens - start)
            logits = self.p.alloc(n * v * hb)
            self.gemm()
            self.f(self.p.alloc(n * h * hb))
            if grad_weight:
                product = self.p.alloc(v * h * hb)
                self.gemm()
                self.f(product, self.p.alloc(v * h * FP32_BYTES))
            self.f(logits)
        self.f(losses, mask, padded, shifted, fn)
        self.liger_grads = (grad_input, grad_weight)

    # -- ORPO (TRL 1.16.0 ORPOTrainer, trl/experimental/orpo/orpo_trainer.py) ---------------

    def _softcap(self, logits: int, e: int) -> int:
        """Gemma-2's final softcapping: logits / cap, tanh (kept for backward), * cap."""
        v = self.sh.vocab
        self.softcap_tanh = 0
        if not self.sh.final_softcap:
            return logits
        divided = self.a(e * v)
        self.f(logits)
        self.softcap_tanh = self.a(e * v)
        self.f(divided)
        return self.a(e * v)

    def _orpo_chosen(self) -> int:
        """Bytes of the chosen rows' logits without their last position: the NLL's."""
        sh = self.sh
        return sh.batch // PAIR_SIDES * (sh.seq - 1) * sh.vocab * sh.orpo_logits

    def _orpo_forward(self, logits: int, fn: int) -> tuple[int, int]:
        """`concatenated_forward` after the LM head: accelerate's fp32 copy of the outputs under
        autocast, the NLL's contiguous copy of the chosen half and its log-softmax (the copy
        let go), the whole logits kept for the log-prob kernel (estimator/orpo.py)."""
        sh = self.sh
        v, e = sh.vocab, sh.orpo_logits
        if e != sh.head_bytes:  # convert_outputs_to_fp32
            wide = self.a(e * v)
            self.f(logits)
            logits = wide
        logits = self._softcap(logits, e)
        chosen = self._orpo_chosen()
        # `.contiguous()` copies the chosen rows' [:, :-1] slice, unless it is one row (a
        # contiguous view already)
        copy = self.p.alloc(chosen) if sh.batch > PAIR_SIDES else 0
        logp = self.p.alloc(chosen)
        self.f(copy)
        if not sh.head_trainable:
            self.f(fn)
        return logits, logp

    def _orpo_backward(self, logits: int, logp: int) -> int:
        """The logits' gradients: the kernel's (its [:, :-1] slice's backward a full-shape
        copy, the saved logits let go), the NLL's (log-softmax's, then two slices' backward),
        their sum; the softcap's backward, then the cast back to the head's dtype."""
        sh = self.sh
        v, e = sh.vocab, sh.orpo_logits
        chosen = self._orpo_chosen()
        kernel = self.p.alloc(PAIR_SIDES * chosen)  # (rows, seq - 1, vocab)
        self.f(logits)
        sliced = self.a(e * v)
        self.f(kernel)
        nll = self.p.alloc(chosen)
        soft = self.p.alloc(chosen)
        self.f(nll, logp)
        half = self.a(e * v // PAIR_SIDES)  # the chosen rows, every position
        self.f(soft)
        whole = self.a(e * v)
        self.f(half)
        g = self.a(e * v)
        self.f(sliced, whole)
        if sh.final_softcap:  # * cap, tanh's backward, / cap
            for release in (False, True, False):
                nxt = self.a(e * v)
                self.f(g)
                if release:
                    self.f(self.softcap_tanh)
                g = nxt
        if e != sh.head_bytes:
            narrow = self.a(sh.head_bytes * v)
            self.f(g)
            g = narrow
        return g

    # -- reward model (TRL 1.16.0 RewardTrainer, GenericForSequenceClassification) ------------

    def _score_forward(self) -> None:
        """The score linear at every position (one output each), the last non-padding
        token's pooled: the int32 padding mask, its product with the positions and their
        argmax, then the pooled logits; the per-position logits go once pooled (indexing
        keeps only the indices). The pairwise loss is a few per-pair scalars."""
        sh = self.sh
        logits = self.a(sh.head_bytes * SCORE_OUTPUTS)
        self.gemm()
        compared = self.a(BOOL_BYTES)
        mask = self.a(INT32_BYTES)
        self.f(compared)
        positions = self.p.alloc(sh.seq * INT32_BYTES)
        product = self.a(INT32_BYTES)
        last = self.p.alloc(sh.batch * INT64_BYTES)
        self.f(product)
        rows = self.p.alloc(sh.batch * INT64_BYTES)
        self.held_score = (rows, last, self.p.alloc(sh.batch * sh.head_bytes))
        self.f(logits, mask, positions)  # the forward's locals, at its return

    def _score_backward(self, fn: int) -> int:
        """The pooled gradient scattered into a zero (positions x 1) tensor, the score
        weight's gradient from it and the final norm's output, and the hidden states'
        gradient; returns that gradient."""
        sh = self.sh
        rows, last, pooled = self.held_score
        g = self.a(sh.head_bytes * SCORE_OUTPUTS)
        self.f(rows, last, pooled)
        self._head_gradient(SCORE_OUTPUTS * sh.hidden * sh.head_bytes)
        gh = self.a(sh.head_bytes * sh.hidden)
        self.gemm()
        self.f(g, fn)
        return gh

    # -- DPO (TRL 1.16.0 DPOTrainer, trl/kernels/chunked_logprob.py on CUDA) -------------------

    def _dpo_head(self, *, policy: bool) -> list[int]:
        """TRL's fused head over the scored positions: their hidden states and targets
        gathered (through nonzero), the fp32 running statistics, the tile, log Z and the
        requested outputs. Returns what it keeps: the saved tensors for the policy, nothing
        for the reference."""
        sh = self.sh
        n, h = sh.dpo_scored, sh.hidden
        alloc, free = self.p.alloc, self.f
        nonzero = alloc(n * 2 * INT64_BYTES)
        hidden = alloc(n * h * sh.head_bytes)
        free(nonzero)
        nonzero = alloc(n * 2 * INT64_BYTES)
        targets = alloc(n * INT64_BYTES)
        free(nonzero)
        stats = [alloc(n * FP32_BYTES) for _ in range(DPO_RUNNING_STATS)]
        compute = self._dpo_compute_bytes()
        tile = alloc(min(n, DPO_TILE_TOKENS) * min(DPO_TILE_VOCAB, sh.vocab) * compute)
        casts = []
        if compute != sh.head_bytes:  # the token chunk's and a weight tile's casts
            casts = [alloc(min(n, DPO_TILE_TOKENS) * h * compute)]
            weight = alloc(min(DPO_TILE_VOCAB, sh.vocab) * h * compute)
        self.gemm()
        if casts:
            free(weight)
        free(tile, *casts)
        log_sum = alloc(n * FP32_BYTES)
        log_z = alloc(n * FP32_BYTES)
        free(log_sum)
        outputs = [alloc(n * FP32_BYTES)]  # log-probs
        entropy = 0
        if policy:
            ratio = alloc(n * FP32_BYTES)
            entropy = alloc(n * FP32_BYTES)
            free(ratio)
            if sh.dpo_mean_logits:
                outputs.append(alloc(n * FP32_BYTES))  # mean logits
            if sh.dpo_top1:
                left, right = alloc(n), alloc(n)
                outputs.append(alloc(n))  # is_top1
                free(left, right)
        free(*stats)
        return [hidden, targets, log_z, entropy, *outputs]

    def _dpo_scatter(self, widths: list[int], compact: list[int]) -> list[int]:
        """Each per-token output scattered back to (rows, seq - 1): zeros, then an out-of-place
        masked_scatter; the compact ones in `compact` let go."""
        padded = self.sh.batch * (self.sh.seq - 1)
        out = []
        for width in widths:
            zeros = self.p.alloc(padded * width)
            out.append(self.p.alloc(padded * width))
            self.f(zeros)
        self.f(*compact)
        return out

    def _dpo_forward(self, fn: int) -> int:
        """The policy's fused head, then the reference forward (`dpo_reference`); the head's
        saved tensors wait in `self.dpo_saved`. No logits: returns 0."""
        sh = self.sh
        mask = self.p.alloc(sh.batch * (sh.seq - 1))
        hidden, targets, log_z, entropy, *compact = self._dpo_head(policy=True)
        if not sh.head_trainable:
            self.f(fn)
        # log-probs, entropy, mean logits (fp32) and is_top1 (bool), scattered back
        widths = [FP32_BYTES] * (2 + sh.dpo_mean_logits) + ([1] if sh.dpo_top1 else [])
        outputs = self._dpo_scatter(widths, compact)
        if sh.dpo_reference:
            if sh.kto_kl:  # KTO's reference: the KL batch, then the completions
                self._dpo_reference_forward()
            self._dpo_reference_forward()
        self.f(*outputs)  # `_compute_loss` returns: the outputs object is dropped
        self.dpo_saved = [hidden, targets, log_z, entropy, mask]
        if sh.head_trainable:
            self.dpo_saved.append(fn)
        return 0

    def _dpo_reference_forward(self, *, policy: bool = False) -> None:
        """The reference model's no-grad forward: each layer's transients, then its head (the
        policy's head, with its outputs, for KTO's KL batch through the policy)."""
        sh = self.sh
        h, i = sh.hidden, sh.intermediate
        x = self.a(sh.residual * h)
        for _ in range(sh.layers):
            normed = self.a(sh.residual * h)
            attn = self._dpo_reference_attention()
            self.f(normed)
            residual = self.a(sh.residual * h)
            self.f(attn)
            normed = self.a(sh.residual * h)
            act = self.a(sh.residual * i)
            up = self.a(sh.residual * i)
            product = self.a(sh.residual * i)
            self.f(act, up, normed)
            out = self.a(sh.residual * h)
            self.f(product, residual, x)
            x = out
        normed = self.a(sh.residual * h)
        self.f(x)
        head = self._dpo_head(policy=policy)
        self.f(*head[:4], normed)
        ref_outputs = self._dpo_scatter([FP32_BYTES] * (len(head) - 4), head[4:])
        self.f(*ref_outputs)

    def _dpo_reference_attention(self) -> int:
        """A no-grad attention's output; through SDPA's math kernel its q, k and v copies,
        the scores, the probabilities and their all-masked-row check come and go first."""
        sh = self.sh
        h = sh.hidden
        if sh.kernel is not Kernel.MATH:
            return self.a(sh.residual * h)
        q = self.a(sh.residual * h)
        copies = [self.a(sh.residual * h) for _ in range(MATH_REFERENCE_COPIES)]
        scores_bytes = sh.batch * sh.heads * sh.seq * sh.seq
        scores = self.p.alloc(scores_bytes * sh.residual)
        self.f(*copies[:2])
        probs = self.p.alloc(scores_bytes * sh.residual)
        check = self.p.alloc(scores_bytes)
        self.f(check, scores)
        out = self.a(sh.residual * h)
        self.f(probs, q, *copies[2:])
        return out

    def _dpo_compute_bytes(self) -> int:
        """The fused head's tile dtype: autocast's under mixed precision, else the head's."""
        return HALF_BYTES if self.sh.autocast else self.sh.head_bytes

    def _dpo_head_backward(self) -> int:
        """ChunkedLogProbFunction.backward: fp32 accumulators, the tile, the casts back; then
        the gather's and the shift's backward make the hidden states' gradient."""
        sh = self.sh
        n, h, v = sh.dpo_scored, sh.hidden, sh.vocab
        hidden, targets, log_z, entropy, mask, *fn = self.dpo_saved
        grad = self.p.alloc(n * FP32_BYTES)  # the log-probs' gradient, gathered
        grad_hidden = self.p.alloc(n * h * FP32_BYTES)
        grad_weight = self.p.alloc(v * h * FP32_BYTES) if sh.head_trainable else 0
        compute = self._dpo_compute_bytes()
        tile = self.p.alloc(min(n, DPO_TILE_TOKENS) * min(DPO_TILE_VOCAB, v) * compute)
        if compute != sh.head_bytes:
            # the token chunk's cast, and each weight tile's made before the last one goes
            chunk = self.p.alloc(min(n, DPO_TILE_TOKENS) * h * compute)
            weight = self.p.alloc(min(DPO_TILE_VOCAB, v) * h * compute)
            if v > DPO_TILE_VOCAB:
                following = self.p.alloc(min(DPO_TILE_VOCAB, v) * h * compute)
                self.f(weight)
                weight = following
        self.gemm()
        if compute != sh.head_bytes:
            self.f(weight, chunk)
        self.f(tile, grad)
        if sh.head_bytes != FP32_BYTES:
            cast = self.p.alloc(n * h * sh.head_bytes)
            self.f(grad_hidden)
            grad_hidden = cast
        if grad_weight:
            self._head_gradient(v * h * sh.head_bytes)
            self.f(grad_weight)
        self.f(hidden, targets, log_z, entropy, *fn)
        gathered = self.p.alloc(sh.batch * (sh.seq - 1) * h * sh.head_bytes)
        self.f(grad_hidden, mask)
        g = self.a(sh.residual * h)  # the shift's backward: the full sequence
        self.f(gathered)
        return g

    def _head_gradient(self, nbytes: int) -> None:
        """The LM head's weight gradient; a tied one that a later micro-batch makes waits
        for the embedding's (AccumulateGrad's input buffer)."""
        sh = self.sh
        if self.accumulated and sh.tied and sh.embed_trainable:
            self.head_grad = self.p.alloc(nbytes)
        else:
            self.grad(nbytes)

    def _lorafa_step(self) -> None:
        """LoraFAOptimizer.step, one lora_B at a time (peft/optimizers/lorafa.py): the
        gradient projected under bf16 autocast (a half copy and the half product), scaled
        (half), cast back, then sqrt(exp_avg_sq) + eps; each rebinding of `grad_B` and
        `denom_B` lets go of the previous B's."""
        grad_b = denom = 0
        for nbytes in self.sh.trainable:
            half = nbytes * LORAFA_AUTOCAST_BYTES // self.sh.adapter
            cast = self.p.alloc(half)
            product = self.p.alloc(half)
            self.f(cast)
            scaled = self.p.alloc(half)
            self.f(product, grad_b)
            grad_b = self.p.alloc(nbytes)
            self.f(scaled)
            new_denom = self.p.alloc(nbytes)
            self.f(denom)
            denom = new_denom
        self.f(grad_b, denom)

    def optimizer(self) -> None:
        sh = self.sh
        up = sh.updater
        if sh.clip and self.grads:
            # clip_grad_norm_ (foreach): a norm per gradient, their stack, the total norm, the
            # clip coefficient and its clamp; the gradients are scaled in place.
            norms = [self.p.alloc(FP32_BYTES) for _ in self.grads]
            stacked = self.p.alloc(FP32_BYTES * len(norms))
            total = self.p.alloc(FP32_BYTES)
            self.f(stacked, *norms)
            shifted = self.p.alloc(FP32_BYTES)
            coef = self.p.alloc(FP32_BYTES)
            self.f(shifted)
            clamped = self.p.alloc(FP32_BYTES)
            self.f(coef, clamped, total)
        if up not in (Updater.STATELESS, Updater.OUTSIDE) and not self.states:
            self.states = [key for key in map(self.p.alloc, sh.states) if key]
        if up is Updater.ADAMW_FOREACH:
            self.f(*[self.p.alloc(n) for n in sh.trainable])
        elif up is Updater.LORA_FA:
            self._lorafa_step()
        elif up is Updater.ADAFACTOR:
            self.f(*[self.p.alloc(sh.largest_trainable * FP32_BYTES) for _ in range(FP32_COPIES)])
        if sh.adalora:
            self.allocate_ranks()
        self.zero_grad()

    def zero_grad(self) -> None:
        """HF Trainer's model.zero_grad() after the step: the gradients go (set_to_none=True),
        or stay, zeroed in place (set_to_none=False), for the next step to add into."""
        if self.sh.grads_kept:
            return
        self.f(*reversed(self.grads))
        self.grads.clear()


def step_events(shape: StepShape, steps: int = 2) -> tuple[list[Event], list[int]]:
    """The events of `steps` training steps once the weights exist (the inputs first), and
    where in them each step ends."""
    prog = _Program()
    builder = _Step(shape, prog)
    prog.alloc(shape.tokens * INT64_BYTES)  # input_ids
    prog.alloc(shape.tokens * INT64_BYTES)  # labels
    ends = []
    for _ in range(steps):
        builder.step()
        ends.append(len(prog.events))
    return prog.events, ends
