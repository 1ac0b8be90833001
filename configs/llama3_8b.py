"""A Llama-3-8B-shaped dense decoder (Grattafiori et al. 2024, "The Llama 3 Herd of Models"):
8,030,261,248 parameters.

hidden 4096, MLP 14336, 32 layers, 32 query / 8 KV heads (head_dim 128), untied 128,256-token
embeddings, RoPE θ 500000, sequences of 4096 (Llama 3's are 8192).  A shape to measure the engine
against, above all its vocabulary-sized tensors (the embedding and the head are 1.05B of the 8.03B
parameters): 8 pipeline stages x 8-way data parallel on 64 H100 80GB
(``config.hardware='h100-80gb'``), the 2bw schedule, remat on, 32 microbatches of one sequence per
data shard.  The dry run says per device what the vocabulary-sized tensors cost, which stages read
them and which only hold them.  On 4 stages the step needs an H200 (about 109 GB a device, 25 GB
of it the two tables and what comes with them); ``--config.pipeline.vocab_parallel=True`` splits
the tables over the stages (about 9.5 GB of them a device, 91 GB in all; docs/pipeline.md,
"Vocabulary-sized tensors"):

    python -m asyncpp_jax.main --config=configs/llama3_8b.py --dry_run
    python -m asyncpp_jax.main --config=configs/llama3_8b.py --dry_run --config.pipeline.stages=4 --config.hardware=h200-141gb
    python -m asyncpp_jax.main --config=configs/llama3_8b.py --dry_run --config.pipeline.vocab_parallel=True
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
    c.pipeline.update(stages=8, schedule="2bw")
    c.staleness.update(mitigation="ef")
    c.mesh.update(data=8)
    return c
