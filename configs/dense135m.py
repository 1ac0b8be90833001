"""SmolLM2-135M shape (Allal et al. 2025): 134,515,008 parameters.

hidden 576, MLP 1536, 30 layers, 9 heads, 3 KV heads, vocab 49152, tied embeddings, RoPE θ 100000.
Target hardware: one H100 80GB (``config.hardware='h100-80gb'``), remat on, 4 microbatches of 64
sequences (the dry run's peak estimate, with the fused attention kernel the H100 runs, is in
docs/fitting.md's table; with the einsum path's attention 8 were needed, and without remat at 4
microbatches it was ~900 GB).
Meant for a GPU/TPU; it also runs (slowly) on CPU with the default byte tokenizer.  For the paper's
setting use the SmolLM2 tokenizer and FineWeb-Edu:

    --config.data.tokenizer=/path/to/tokenizer.json --config.data.source=hf:HuggingFaceFW/fineweb-edu:sample-10BT
"""

from asyncpp_jax.configs import base_config


def get_config():
    c = base_config()
    c.name = "dense135m"
    c.model.update(
        vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536,
        rope_theta=100000.0, tie_embeddings=True, compute_dtype="bfloat16", remat=True,
    )
    c.hardware = "h100-80gb"
    c.data.seq_len = 2048
    c.train.update(steps=20000, global_batch_size=256, microbatches=4, eval_every=500, eval_batches=32,
                   checkpoint_every=1000)
    c.optimizer.update(lr=3e-3, warmup_steps=1000, weight_decay=0.1, schedule="cosine", min_lr_ratio=0.1)
    return c
