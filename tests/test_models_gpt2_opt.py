"""GPT-2 and OPT against tiny random ``transformers`` models: logits, greedy generation,
export round trip and tensor parallelism.

Every HF parameter is re-drawn at random (biases and LayerNorms included), so a wrong
layout of any tensor shows up in the logits.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import redray.models as rm
from redray.models import hub
from redray.sharding import Parallelism, flatten, format_placement, make_mesh, placement

torch = pytest.importorskip(
    "torch", reason="parity tests need torch (pip install torch==2.13.0; make test installs it)")
transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, HEADS, LAYERS, MAX_POS = 128, 64, 4, 2, 64
EOS, PAD = 2, 1


def _gpt2(**kw):
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=MAX_POS, n_embd=HIDDEN,
                                   n_layer=LAYERS, n_head=HEADS, bos_token_id=EOS,
                                   eos_token_id=EOS, pad_token_id=PAD, **kw)


def _opt(**kw):
    return transformers.OPTConfig(vocab_size=VOCAB, max_position_embeddings=MAX_POS,
                                  hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                  num_attention_heads=HEADS, ffn_dim=4 * HIDDEN,
                                  bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD,
                                  **{"word_embed_proj_dim": HIDDEN, **kw})


CONFIGS = {
    "gpt2": _gpt2,
    # Untied head, a narrower MLP and the per-layer attention scaling of GPT-2 options.
    "gpt2_untied": lambda: _gpt2(tie_word_embeddings=False, n_inner=96,
                                 scale_attn_by_inverse_layer_idx=True),
    "opt": _opt,
    # opt-350m's shape: post-LayerNorm, project_in/out around a wider decoder; untied head.
    "opt_no_bias": lambda: _opt(enable_bias=False, layer_norm_elementwise_affine=False),
    "opt_proj": lambda: _opt(word_embed_proj_dim=32, do_layer_norm_before=False,
                             tie_word_embeddings=False),
}
ALL = sorted(CONFIGS)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif p.ndim == 1:  # LayerNorm scale
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.15 * noise)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (folder, HF model) for every config, saved once."""
    out = {}
    for i, name in enumerate(ALL):
        torch.manual_seed(i)
        hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()
        _randomize(hf, seed=i)
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        out[name] = (str(folder), hf)
    return out


@pytest.fixture(scope="module")
def loaded(checkpoints):
    """name -> redray model loaded from the checkpoint (4 devices, data parallel)."""
    return {name: rm.from_pretrained(folder) for name, (folder, _) in checkpoints.items()}


@nnx.jit
def _forward(model, ids, mask):
    return model(ids, mask)


def _inputs():
    rng = np.random.RandomState(0)
    ids = rng.randint(3, VOCAB, (2, 10)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = PAD
    return ids, mask


def _hf_logits(hf, ids, mask):
    kwargs = {"attention_mask": torch.tensor(mask)}
    if hf.config.model_type == "gpt2":
        # GPT-2's forward counts positions from the first slot; generate() and redray
        # count real tokens only, so give HF the positions of the unpadded prompt.
        kwargs["position_ids"] = torch.tensor(np.maximum(mask.cumsum(-1) - 1, 0))
    with torch.no_grad():
        return hf(torch.tensor(ids), **kwargs).logits.numpy()


@pytest.mark.parametrize("name", ALL)
def test_logits_match_transformers(name, checkpoints, loaded):
    _, hf = checkpoints[name]
    model = loaded[name]
    ids, mask = _inputs()
    full = np.ones_like(mask)
    np.testing.assert_allclose(np.asarray(_forward(model, ids, full)),
                               _hf_logits(hf, ids, full), atol=1e-4, rtol=0)
    valid = mask.astype(bool)
    ours = np.asarray(_forward(model, ids, mask))
    np.testing.assert_allclose(ours[valid], _hf_logits(hf, ids, mask)[valid], atol=1e-4, rtol=0)
    # The padded row's real tokens see exactly what an unpadded prompt would.
    alone = np.asarray(_forward(model, ids[1:, 3:], full[1:, 3:]))
    np.testing.assert_allclose(ours[1, 3:], alone[0], atol=1e-4, rtol=0)


NEW_TOKENS = 16


@nnx.jit
def _generate(model, ids, mask, eos):
    return rm.generate(model, ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                       pad_token_id=PAD)


def _hf_generate(hf, ids, mask, eos):
    with torch.no_grad():
        out = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                          max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=PAD).numpy()
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("stop", [False, True], ids=["no_eos", "eos_hit"])
@pytest.mark.parametrize("name", ["gpt2", "opt", "opt_proj"])
def test_greedy_generation_matches_transformers(name, stop, checkpoints, loaded):
    _, hf = checkpoints[name]
    model = loaded[name]
    ids, mask = _inputs()
    ref = _hf_generate(hf, ids, mask, EOS)
    eos = EOS
    if stop:  # the first row's 4th token becomes the EOS: rows stop early
        eos = int(ref[0, 3])
        ref = _hf_generate(hf, ids, mask, eos)
    ours = np.asarray(_generate(model, jnp.asarray(ids), jnp.asarray(mask), eos))
    assert ours.shape == (2, NEW_TOKENS)
    np.testing.assert_array_equal(ours[:, :ref.shape[1]], ref)
    assert (ours[:, ref.shape[1]:] == PAD).all()
    if stop:
        assert (ours[0] == eos).any()


@pytest.mark.parametrize("name", ALL)
def test_export_round_trip(name, checkpoints, loaded, tmp_path):
    _, hf = checkpoints[name]
    rm.save_pretrained(loaded[name], str(tmp_path))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids, mask = _inputs()
    np.testing.assert_allclose(_hf_logits(back, ids, mask), _hf_logits(hf, ids, mask),
                               atol=1e-5, rtol=0)


# Kernels that must be split over 'model' under tensor parallelism, and along which dim.
SPLIT = {
    "gpt2": {"wte/embedding": P("model"),
             "wpe/embedding": P(),  # added to the token rows: whole, one all-reduce for both
             "h/0/attn/c_attn/kernel": P(None, None, "model"),
             "h/0/attn/c_attn/bias": P(None, "model"),
             "h/0/attn/c_proj/kernel": P("model"),
             "h/0/mlp/c_fc/kernel": P(None, "model"),
             "h/0/mlp/c_fc/bias": P("model"),
             "h/0/mlp/c_proj/kernel": P("model")},
    "opt": {"embed_tokens/embedding": P("model"),
            # fused (hidden, heads, 3, head_dim): heads split, Q/K/V of a head together
            "layers/0/self_attn/qkv_proj/kernel": P(None, "model"),
            "layers/0/self_attn/qkv_proj/bias": P("model"),
            "layers/0/self_attn/out_proj/kernel": P("model"),
            "layers/0/fc1/kernel": P(None, "model"),
            "layers/0/fc2/kernel": P("model")},
}
# OPT-350m's shape: project_in writes the residual stream, so it stays whole and the
# blocks keep their usual roles (the same expectations as plain OPT).
SPLIT["opt_proj"] = {**{k: v for k, v in SPLIT["opt"].items()}, "project_in/kernel": P()}


def stacked(expected: dict) -> dict:
    """SPLIT for the default build, whose layers are stacked: layer 0's paths without
    the index, their specs behind the layer axis (which stays whole)."""
    out = {}
    for path, spec in expected.items():
        layer = re.match(r"^(h|layers)/0/(.*)$", path)
        out[f"{layer[1]}/{layer[2]}" if layer else path] = P(None, *spec) if layer else spec
    return out


def _specs(config, mesh):
    fam = hub.family(config.model_type)
    abstract = nnx.eval_shape(lambda: fam.Model(config, rngs=nnx.Rngs(0)))
    graphdef, params, extra = nnx.split(abstract, nnx.Param, ...)
    specs, _ = hub.model_specs(graphdef, (params, extra), Parallelism.of(mesh=mesh),
                               fam.trace_inputs(config))
    return params, specs


@pytest.mark.parametrize("model_axis", [2, 4])
@pytest.mark.parametrize("name", ["gpt2", "opt", "opt_proj"])
def test_automatic_specs_split_heads(name, model_axis):
    params, specs = _specs(CONFIGS[name](), make_mesh(model_axis=model_axis))
    paths, _, _ = flatten(params)
    by_path = dict(zip(paths, jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))))
    for path, spec in stacked(SPLIT[name]).items():
        assert by_path[path] == spec, (path, by_path[path])
    for path, spec in by_path.items():  # norms stay replicated
        if "ln" in path.split("/")[-2] or "layer_norm" in path:
            assert spec == P(), (path, spec)


@pytest.mark.parametrize("name", ["gpt2", "opt", "opt_proj"])
def test_tensor_parallel_matches_single_device(name, checkpoints):
    folder, _ = checkpoints[name]
    one = rm.from_pretrained(folder, mesh=make_mesh(devices=jax.devices()[:1]))
    tp = rm.from_pretrained(folder, model_axis=2)
    _, params, _ = nnx.split(tp, nnx.Param, ...)
    paths, leaves, _ = flatten(params)
    sharded = {p for p, leaf in zip(paths, leaves) if "model" in leaf.sharding.spec}
    expected = {path for path, spec in stacked(SPLIT[name]).items() if "model" in spec}
    assert expected <= sharded, expected - sharded
    ids, mask = _inputs()
    np.testing.assert_allclose(np.asarray(_forward(tp, ids, mask)),
                               np.asarray(_forward(one, ids, mask)), atol=1e-5, rtol=0)


def test_plan_formats(capsys):
    """Prints one GPT-2 and one OPT block's plan under model_axis=4 (run with -s to read)."""
    mesh = make_mesh(model_axis=4)
    for name, prefix in (("gpt2", "h/"), ("opt", "layers/")):
        params, specs = _specs(CONFIGS[name](), mesh)
        rows = [r for r in placement(params, specs, mesh)
                if r.path.startswith(prefix) or "/" not in r.path.split("/", 1)[-1]]
        text = format_placement(rows, mesh)
        assert "model" in text
        print(text)


DROPOUT = {"gpt2": dict(attn_pdrop=0.3, resid_pdrop=0.3, embd_pdrop=0.3),
           "opt": dict(dropout=0.3, attention_dropout=0.3)}


@pytest.mark.parametrize("name", ["gpt2", "opt"])
def test_dropout_only_in_training_and_remat_grads(name):
    config = CONFIGS[name]()
    for key, value in DROPOUT[name].items():
        setattr(config, key, value)
    # rbg keys: threefry dropout masks take seconds to compile on small CPUs.
    model = rm.build(config, remat=True, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
    ids = jnp.asarray(_inputs()[0])

    @nnx.jit
    def run(m):
        loss, grads = nnx.value_and_grad(lambda m: m(ids, train=True).mean())(m)
        return loss, grads, m(ids).mean(), m(ids).mean()

    train_loss, grads, eval_loss, eval_again = run(model)
    assert eval_loss == eval_again
    assert abs(float(train_loss) - float(eval_loss)) > 1e-6
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("name", ["gpt2", "opt"])
def test_checkpoint_saved_from_the_base_model_loads(name, checkpoints, tmp_path):
    # The original GPT-2 and OPT checkpoints were saved from GPT2Model / OPTModel: no
    # "transformer." / "model." prefix and no separate head (it is tied).
    _, hf = checkpoints[name]
    base = hf.transformer if name == "gpt2" else hf.model
    base.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="np") as f:
        assert not any(k.startswith(("transformer.", "model.")) for k in f.keys())
    model = rm.from_pretrained(str(tmp_path))
    ids, mask = _inputs()
    np.testing.assert_allclose(np.asarray(_forward(model, ids, mask))[mask.astype(bool)],
                               _hf_logits(hf, ids, mask)[mask.astype(bool)], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["gpt2", "opt", "opt_proj"])
def test_scanned_layers_match_the_list(checkpoints, loaded, name):
    folder, hf = checkpoints[name]
    scanned = loaded[name]  # the default: stacked layers
    assert not isinstance(getattr(scanned, "h", None) or scanned.layers, nnx.List)
    listed = rm.from_pretrained(folder, scan=False)
    assert isinstance(getattr(listed, "h", None) or listed.layers, nnx.List)
    ids, mask = _inputs()
    np.testing.assert_allclose(np.asarray(_forward(scanned, jnp.asarray(ids), jnp.asarray(mask))),
                               np.asarray(_forward(listed, jnp.asarray(ids),
                                                   jnp.asarray(mask))), atol=1e-5, rtol=0)
    args = (jnp.asarray(ids), jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(rm.generate(scanned, *args, max_new_tokens=6)),
                                  np.asarray(rm.generate(listed, *args, max_new_tokens=6)))


def test_scan_refuses_layers_that_differ(checkpoints):
    folder, _ = checkpoints["gpt2_untied"]  # attention scaled by each layer's index
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        rm.from_pretrained(folder, scan=True)
    # left to the default, such a config is built as a list of layers
    assert isinstance(rm.from_pretrained(folder).h, nnx.List)
