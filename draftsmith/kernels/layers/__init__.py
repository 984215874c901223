"""The one Llama-family model stack: config, RoPE, RMSNorm, linears, decoder layer, causal LM, checkpoints.

The engine's target (serve_eval.engine.model_executor) and every draft (draftsmith/drafts/) are built from these
modules. Both run over a FLATTENED token axis ``[T, d]`` with explicit positions and an attention
callable ``attn_fn(q [T,h,hd], k [T,kv,hd], v [T,kv,hd]) -> [T,h,hd]``; only that callable differs between
training (causal SDPA over a padded batch, the training-time-test unroll) and serving (paged KV cache).

Modules keep HF parameter names and train with autograd as plain nn.Modules. ``to_serving_()`` turns one into its
serving form: q/k/v and gate/up become one matrix each, weights are packed for oneDNN where that is the
fast CPU path (kernels.layers.linear), and the forward runs those without nn.Module call overhead.
"""
