"""SmolLM2-360M shape (Allal et al. 2025): 361,821,120 parameters.

hidden 960, MLP 2560, 32 layers, 15 heads, 5 KV heads, vocab 49152, tied embeddings, RoPE θ 100000.
Target hardware: one H100 80GB (``config.hardware='h100-80gb'``), remat on, 8 microbatches of 32
sequences (the dry run's peak estimate is in docs/fitting.md's table).
"""

from asyncpp_jax.configs import base_config


def get_config():
    c = base_config()
    c.name = "dense360m"
    c.model.update(
        vocab_size=49152, d_model=960, n_layers=32, n_heads=15, n_kv_heads=5, d_ff=2560,
        rope_theta=100000.0, tie_embeddings=True, compute_dtype="bfloat16", remat=True,
    )
    c.hardware = "h100-80gb"
    c.data.seq_len = 2048
    c.train.update(steps=30000, global_batch_size=256, microbatches=8, eval_every=500, eval_batches=32,
                   checkpoint_every=1000)
    c.optimizer.update(lr=2e-3, warmup_steps=1000, weight_decay=0.1, schedule="cosine", min_lr_ratio=0.1)
    return c
