"""Routing an imported optimizer is explicit: suspect leaves are flagged in the table and warned about once."""

from __future__ import annotations

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from asyncpp_jax import configs, optim
from asyncpp_jax.models import dense
from asyncpp_jax.optim import routing


class AutoNamedMLP(nn.Module):
    """A plain Flax model: layers auto-named Dense_0 ... Dense_11 (natural order differs from sorted)."""

    @nn.compact
    def __call__(self, x):
        for _ in range(11):
            x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(5)(x)


@pytest.fixture(scope="module")
def mlp_params():
    return AutoNamedMLP().init(jax.random.key(0), jnp.zeros((1, 12)))["params"]


def test_first_and_last_matrix_of_an_auto_named_model_are_suspects(mlp_params):
    # Sorted keys put Dense_10 and Dense_11 before Dense_2; creation order makes Dense_11 the head.
    assert routing.suspects(mlp_params) == {"Dense_0/kernel": "first matrix", "Dense_11/kernel": "last matrix"}
    table = routing.describe(mlp_params)
    assert "Dense_0/kernel   12x16  hidden  <- head or embedding? (first matrix)" in table
    assert "Dense_11/kernel  16x5   hidden  <- head or embedding? (last matrix)" in table
    assert "Dense_5/kernel   16x16  hidden\n" in table
    pattern = routing.DEFAULT_ADAMW_PATTERN + "|^Dense_0$|^Dense_11$"
    assert routing.suspects(mlp_params, pattern) == {}
    assert "Dense_11/kernel  16x5   adamw\n" in routing.describe(mlp_params, pattern) + "\n"


def test_untied_head_matching_the_vocabulary_is_a_suspect():
    params = {"Embed_0": {"embedding": jnp.zeros((50, 8))}, "Dense_0": {"kernel": jnp.zeros((8, 8))},
              "Dense_1": {"kernel": jnp.zeros((8, 50))}, "Dense_2": {"kernel": jnp.zeros((8, 8))}}
    # Natural path order puts Dense_* before Embed_0, so Dense_0 is the "first matrix" here.
    assert routing.suspects(params) == {"Dense_0/kernel": "first matrix",
                                        "Dense_1/kernel": "a side equals the vocabulary size 50"}


@pytest.mark.parametrize("make", [optim.muon, optim.soap, optim.mars])
def test_init_warns_once_per_layout(mlp_params, caplog, make):
    routing._WARNED.clear()
    tx = make(1e-3)
    with caplog.at_level(logging.WARNING, logger="asyncpp_jax.optim.routing"):
        tx.init(mlp_params)
        jax.eval_shape(tx.init, mlp_params)  # traced again: still one warning
    warnings = [r.getMessage() for r in caplog.records if r.name == "asyncpp_jax.optim.routing"]
    assert len(warnings) == 1
    assert "Dense_0/kernel (first matrix), Dense_11/kernel (last matrix)" in warnings[0]
    assert "|^Dense_0$|^Dense_11$'" in warnings[0]  # the suggested adamw_pattern
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncpp_jax.optim.routing"):
        make(1e-3, side=optim.AdamWBranch(pattern=routing.DEFAULT_ADAMW_PATTERN + "|^Dense_0$|^Dense_11$")
             ).init(mlp_params)
    assert not caplog.records


@pytest.mark.parametrize("make", [optim.muon, optim.soap, optim.mars])
def test_old_side_keywords_name_the_side_branch(make):
    with pytest.raises(TypeError, match=r"no longer takes adamw_b1, adamw_pattern: .*"
                                        r"side=AdamWBranch\(b1=0.8, pattern='norm'\)"):
        make(1e-3, adamw_b1=0.8, adamw_pattern="norm")
    with pytest.raises(TypeError, match="side must be an asyncpp_jax.optim.AdamWBranch"):
        make(1e-3, side={"b1": 0.8})


@pytest.mark.parametrize("config", ["tiny", "moe_tiny"])
def test_project_models_have_no_suspects(config):
    assert routing.suspects(dense.abstract_params(configs.load_file(f"configs/{config}.py").model)) == {}


def test_print_routing_prints_the_table(mlp_params, capsys):
    optim.print_routing(mlp_params, branch_names={"hidden": "muon"})
    out = capsys.readouterr().out
    assert out.startswith("parameter") and "Dense_1/kernel   16x16  muon\n" in out
