"""A CPU-sized MoE: the tiny dense model with 8 SwiGLU experts (top-2) on every other layer.
Target hardware: a CPU (``config.hardware='cpu'``, from configs/tiny.py).

    python -m asyncpp_jax.main --config=configs/moe_tiny.py
"""

import pathlib

from asyncpp_jax.configs import load_file


def tiny():
    # A config file is loaded by path (configs/ is not a package), so reach the sibling file by path.
    return load_file(pathlib.Path(__file__).with_name("tiny.py"))


def get_config():
    c = tiny()
    c.name = "moe_tiny"
    c.model.moe.update(num_experts=8, top_k=2, expert_d_ff=344, every=2, capacity_factor=1.25, shared_experts=0)
    return c
