"""A ~10B-parameter Mixture-of-Experts (10,119,907,328 parameters, 1,664,190,464 active per token).

24 layers, d_model 2048, 16 query / 4 KV heads (head_dim 128), every layer MoE with 64 SwiGLU
experts of hidden 1024, top-8 softmax routing with renormalised gates, capacity factor 1.25,
untied 49152-token embeddings (SmolLM2 tokenizer).  The shape follows OLMoE-1B-7B (Muennighoff et
al. 2024: d 2048, 64 experts, top-8, expert hidden 1024, 16 layers) at 24 layers, which brings the
total to 10.1B with 1.66B active: fine-grained experts with 8 active of 64, as in OLMoE and
DeepSeekMoE, rather than Mixtral's 2 of 8 coarse ones.

Trained with Async PP: 4 pipeline stages x 16-way data parallel on a 64-accelerator slice, experts
sharded over the data axis (4 per device, all_to_all dispatch), the bubble-free 2bw schedule,
Muon with error feedback, the embedding and the head split over the stages along the vocabulary
(``config.pipeline.vocab_parallel=True``: each device holds 1/4 of each table, of its weight
versions and of its optimizer state, not both tables whole).  Target hardware: 64 H100 80GB
(``config.hardware='h100-80gb'``; the per-device peak also fits TPU v5p and H200), remat on, 8
microbatches:

    python -m asyncpp_jax.main --config=configs/moe10b.py \\
        --config.data.tokenizer=/path/to/tokenizer.json --config.data.source=hf:HuggingFaceFW/fineweb-edu:sample-10BT
"""

from asyncpp_jax.configs import base_config


def get_config():
    c = base_config()
    c.name = "moe10b"
    c.model.update(
        vocab_size=49152, d_model=2048, n_layers=24, n_heads=16, n_kv_heads=4, d_ff=1024,
        rope_theta=10000.0, tie_embeddings=False, compute_dtype="bfloat16", remat=True,
    )
    c.hardware = "h100-80gb"
    c.model.moe.update(num_experts=64, top_k=8, expert_d_ff=1024, gating="softmax", capacity_factor=1.25,
                       every=1, lb_loss_coef=0.01, router_z_loss_coef=0.001)
    c.data.seq_len = 4096
    c.train.update(steps=50000, global_batch_size=1024, microbatches=8, eval_every=1000, eval_batches=32,
                   checkpoint_every=500)
    c.optimizer.update(name="muon", lr=3e-3, warmup_steps=2000, weight_decay=0.1, schedule="wsd")
    c.pipeline.update(stages=4, schedule="2bw", vocab_parallel=True)  # 49152 = 4 x 12288
    c.staleness.update(mitigation="ef")
    c.mesh.update(data=16, expert_parallel=True)  # 4 of the 64 experts per data shard
    return c
