"""CPU default: a ~3M-parameter byte-level Llama trained on the Python stdlib in a few minutes.
Target hardware: a CPU (``config.hardware='cpu'``, 8 GB per device in the dry run).

    python -m asyncpp_jax.main                  # this config
"""

from asyncpp_jax.configs import base_config


def get_config():
    c = base_config()
    c.name = "tiny"
    c.hardware = "cpu"
    c.model.update(vocab_size=257, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=688)
    c.data.seq_len = 128
    c.train.update(steps=500, global_batch_size=32, eval_every=100, eval_batches=16, checkpoint_every=200)
    c.optimizer.update(lr=3e-3, warmup_steps=50, weight_decay=0.1, schedule="cosine", min_lr_ratio=0.1)
    return c
