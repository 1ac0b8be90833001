"""A Llama-3-8B-shaped dense decoder (Grattafiori et al. 2024, "The Llama 3 Herd of Models"):
8,030,261,248 parameters.

hidden 4096, MLP 14336, 32 layers, 32 query / 8 KV heads (head_dim 128), untied 128,256-token
embeddings, RoPE θ 500000, sequences of 4096 (Llama 3's are 8192).  A shape to measure the engine
against, above all its vocabulary-sized tensors (the embedding and the head are 1.05B of the 8.03B
parameters): 8 pipeline stages x 8-way data parallel on 64 H100 80GB
(``config.hardware='h100-80gb'``), the 2bw schedule, remat on, 32 microbatches of one sequence per
data shard, the embedding and the head split over the stages along the vocabulary
(``config.pipeline.vocab_parallel=True``: 1/8 of each table, of its weight versions, accumulators
and optimizer state on every device, and 1/8 of the lookup and the head computed there).  The dry
run says per device what the vocabulary-sized tensors cost.  On 4 stages the step needs an H200;
``--config.pipeline.vocab_parallel=False`` keeps both tables whole on every stage, where only stage
0 reads the embedding and only the last stage the head; adding ``--config.pipeline.placement=mpmd``
runs each stage as programs of its own, with the embedding on stage 0 and the head on stage 7
alone: no middle stage holds a byte of either, and the end stages peak higher than the split's
(docs/pipeline.md, "Vocabulary-sized tensors", compares the three):

    python -m asyncpp_jax.main --config=configs/llama3_8b.py --dry_run
    python -m asyncpp_jax.main --config=configs/llama3_8b.py --dry_run --config.pipeline.stages=4 --config.hardware=h200-141gb
    python -m asyncpp_jax.main --config=configs/llama3_8b.py --dry_run --config.pipeline.vocab_parallel=False
    python -m asyncpp_jax.main --config=configs/llama3_8b.py --dry_run --config.pipeline.vocab_parallel=False \\
        --config.pipeline.placement=mpmd
"""

from asyncpp_jax.configs import base_config


def get_config():
    c = base_config()
    c.name = "llama3_8b"
    c.model.update(
        vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
        rope_theta=500000.0, tie_embeddings=False, compute_dtype="bfloat16", remat=True,
    )
    c.hardware = "h100-80gb"
    c.data.seq_len = 4096
    c.train.update(steps=50000, global_batch_size=256, microbatches=32, eval_every=1000, eval_batches=16,
                   checkpoint_every=500)
    c.optimizer.update(name="muon", lr=3e-3, warmup_steps=2000, weight_decay=0.1, schedule="cosine",
                       min_lr_ratio=0.1)
    c.pipeline.update(stages=8, schedule="2bw", vocab_parallel=True)  # 128256 = 8 x 16032
    c.staleness.update(mitigation="ef")
    c.mesh.update(data=8)
    return c
