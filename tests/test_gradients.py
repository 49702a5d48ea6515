"""One step's gradient of every family against transformers' PyTorch model, on a batch
whose rows start with the pad token; the norms' backward at an exactly-zero input.

Logits that match do not make gradients that match: a pad token's embedding row is
all zeros in a checkpoint, its hidden state stays zero through every norm until
attention mixes in other tokens, and the backward of a norm at zero multiplies by
``1 / sqrt(epsilon)``. Torch's ``nn.Embedding(padding_idx=...)`` drops that row's
gradient from the lookup; a model that kept it trained Gemma 2 into an infinite
gradient norm at step 1.
"""

import copy
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import redray
import redray.models as rm
from redray.models import hub

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install torch==2.13.0; "
                                            "make test installs it)")
transformers = pytest.importorskip("transformers")

VOCAB, PAD = 128, 0
# One tiny configuration per model type redray reads (the registry's): every one gives
# the pad token an id (the families whose torch model has no padding row must keep its
# gradient).
CONFIGS = {name: family.tiny for name, family in rm.FAMILIES.items()
           if family.text_config is None}  # a wrapped language model: its own family's
ROWS, LENGTH = 4, 16


def batch():
    """Token ids with the pad token leading two rows (where hidden states stay zero
    through the layers) and scattered through the rest."""
    ids = np.random.default_rng(0).integers(1, VOCAB, (ROWS, LENGTH))
    ids[0, :3] = ids[1, :1] = ids[2, 5] = ids[3, 9] = PAD
    return ids


def hf_checkpoint(model_type, folder):
    """A random transformers model of ``model_type`` saved into ``folder``, its norms
    and biases drawn away from their initial values (so that each one shows)."""
    config = transformers.AutoConfig.for_model(model_type, **CONFIGS[model_type])
    torch.manual_seed(0)
    hf = transformers.AutoModelForSeq2SeqLM if model_type == "t5" else \
        transformers.AutoModelForCausalLM
    model = hf.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # the pad row of the embedding stays as init left it
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder)
    return model


def hf_gradients(model, ids, targets, folder):
    """Torch's loss and gradient of the mean next-token loss, the gradient as the
    tensors of a checkpoint (HF name -> array): written by the model's own
    ``save_pretrained`` (through ``folder``), which converts transformers' layout in
    memory (fused experts) to the one on disk that redray's weight tables read."""
    from safetensors.numpy import load_file

    model = copy.deepcopy(model)
    ids_t = torch.tensor(ids)
    if model.config.model_type == "t5":
        logits = model(input_ids=ids_t, decoder_input_ids=ids_t).logits
    else:
        logits = model(ids_t).logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB),
                                             torch.tensor(targets).reshape(-1))
    loss.backward()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.zeros_like(param) if param.grad is None else param.grad)
    model.save_pretrained(folder)
    # buffers (a router's correction bias) are written as they are: no gradient
    buffers = {name for name, _ in model.named_buffers()}
    return loss.item(), {name: value for name, value in
                         load_file(os.path.join(folder, hub.SINGLE_FILE)).items()
                         if name not in buffers}


def redray_gradients(model, ids, targets):
    """redray's loss and gradient (HF name -> array) of the same loss."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        m = nnx.merge(graphdef, p, jax.tree.map(lambda x: x, rest))
        ids_j = jnp.asarray(ids)
        logits = m(ids_j, decoder_input_ids=ids_j) if model.config.model_type == "t5" \
            else m(ids_j)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), jnp.asarray(targets)).mean()

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return float(value), hub.hf_tensors(model.config, grads)


def assert_gradients_match(ours: dict, theirs: dict, rtol=1e-4):
    """Every tensor's gradient in torch equals redray's within ``rtol`` of the larger of
    its own largest entry and a thousandth of the largest gradient entry of the model,
    and the gradient norms agree within ``rtol``."""
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"tensors redray gives no gradient: {missing}"
    scale = max(np.abs(g).max() for g in theirs.values())
    for name, grad in theirs.items():
        tolerance = rtol * max(np.abs(grad).max(), 1e-3 * scale)
        np.testing.assert_allclose(ours[name], grad, rtol=0, atol=tolerance, err_msg=name)
    norm = lambda grads: np.sqrt(sum(float(np.square(g).sum()) for g in grads))  # noqa: E731
    assert norm(ours[n] for n in theirs) == pytest.approx(norm(theirs.values()), rel=rtol)


def test_every_tiny_configuration_uses_the_vocabulary_and_pad_token_of_the_batch():
    for name, fields in CONFIGS.items():
        config = transformers.AutoConfig.for_model(name, **fields)
        assert (config.vocab_size, config.pad_token_id) == (VOCAB, PAD), name


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_one_steps_gradient_matches_transformers(model_type, tmp_path):
    hf = hf_checkpoint(model_type, str(tmp_path))
    model = rm.from_pretrained(str(tmp_path))
    ids = batch()
    targets = np.roll(ids, -1, axis=1)
    value, ours = redray_gradients(model, ids, targets)
    expected, theirs = hf_gradients(hf, ids, targets, str(tmp_path / "gradients"))
    assert value == pytest.approx(expected, rel=1e-5)
    assert_gradients_match(ours, theirs)
    embed = next(getattr(model, n) for n in ("embed_tokens", "wte", "shared") if hasattr(model, n))
    assert embed.padding_idx == hf.get_input_embeddings().padding_idx


def _norm_cases():
    """(name, redray's norm, torch's norm) for every kind of norm the families use."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    from redray.models import gemma

    rngs = nnx.Rngs(0)
    eps = 1e-6
    return [
        ("gemma", gemma.RMSNorm(8, eps), Gemma2RMSNorm(8, eps)),
        ("rms", nnx.RMSNorm(8, epsilon=eps, rngs=rngs), LlamaRMSNorm(8, eps)),
        ("t5", nnx.RMSNorm(8, epsilon=eps, rngs=rngs), T5LayerNorm(8, eps)),
        ("layer", nnx.LayerNorm(8, epsilon=1e-5, rngs=rngs), torch.nn.LayerNorm(8, eps=1e-5)),
    ]


@pytest.mark.parametrize("case", range(4))
def test_norms_backward_at_an_exactly_zero_input_is_torchs(case):
    name, ours, theirs = _norm_cases()[case]
    x = np.zeros((3, 8), np.float32)
    x[1] = np.linspace(-1.0, 1.0, 8)  # beside a row of zeros, and a constant row
    x[2] = 0.5
    cotangent = np.random.default_rng(0).normal(size=x.shape).astype(np.float32)
    grad = jax.grad(lambda v: (ours(v) * cotangent).sum())(jnp.asarray(x))
    xt = torch.tensor(x, requires_grad=True)
    (theirs(xt) * torch.tensor(cotangent)).sum().backward()
    assert np.isfinite(np.asarray(grad)).all(), name
    np.testing.assert_allclose(np.asarray(grad), xt.grad.numpy(), rtol=1e-5, atol=1e-3,
                               err_msg=name)


def test_gemma2_trains_on_pad_tokens_with_torchs_gradient_norm(tmp_path):
    """The run that stopped at step 1 on an infinite gradient norm: a transformers Gemma 2
    (hidden 64, 4 layers, Gemma 2's heads, a window shorter than the rows, soft-capping)
    trained by the Trainer on batches of 8 x 32 random ids that include the pad id, one
    device, AdamW."""
    config = transformers.AutoConfig.for_model(
        "gemma2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        sliding_window=8)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    hf.save_pretrained(str(tmp_path))
    ids = np.random.default_rng(1).integers(0, VOCAB, (16, 32))
    ids[:4, :2] = PAD
    data = [{"ids": row} for row in ids]

    def loss(m, b, rng, train):
        return rm.next_token_loss(m, b["ids"], train=train)

    collate = lambda examples: {"ids": np.stack([e["ids"] for e in examples])}  # noqa: E731
    trainer = redray.Trainer.of(rm.from_pretrained(str(tmp_path)), collate, loss,
                             optax.adamw(1e-3), batch_size=8, progress=False,
                             compute_dtype=jnp.float32, mesh=redray.make_mesh(
                                 devices=jax.devices()[:1]))
    trainer.init(data)
    first = collate(data[:8])
    metrics = trainer.train_step(first)
    _, theirs = hf_gradients(hf, first["ids"][:, :-1], first["ids"][:, 1:],
                             str(tmp_path / "gradients"))
    norm = np.sqrt(sum(float(np.square(g).sum()) for g in theirs.values()))
    assert float(metrics["grad_norm"]) == pytest.approx(norm, rel=1e-4)
    _, ours = redray_gradients(rm.from_pretrained(str(tmp_path)), first["ids"][:, :-1],
                               first["ids"][:, 1:])
    assert_gradients_match(ours, theirs)
    before = trainer.evaluate(data)["loss"]
    trainer.fit(data, epochs=3)
    assert trainer.step == 7
    assert trainer.evaluate(data)["loss"] < before


def test_an_untied_pad_row_is_exported_as_it_was_loaded(tmp_path):
    """No gradient reaches the pad row of an untied embedding (torch's lookup drops it,
    nothing else reads the row), so AdamW leaves it as loaded and the export keeps it."""
    from safetensors.numpy import load_file

    hf_checkpoint("llama", str(tmp_path / "in"))
    loaded = load_file(str(tmp_path / "in" / hub.SINGLE_FILE))
    data = [{"ids": row} for row in np.tile(batch(), (2, 1))]
    trainer = redray.Trainer.of(rm.from_pretrained(str(tmp_path / "in")),
                             lambda ex: {"ids": np.stack([e["ids"] for e in ex])},
                             lambda m, b, rng, train: rm.next_token_loss(m, b["ids"], train=train),
                             optax.adamw(1e-2, weight_decay=0.1), batch_size=4, progress=False)
    trainer.fit(data, epochs=2)
    rm.save_pretrained(trainer.model, str(tmp_path / "out"))
    saved = load_file(str(tmp_path / "out" / hub.SINGLE_FILE))
    name = "model.embed_tokens.weight"
    np.testing.assert_array_equal(saved[name][PAD], loaded[name][PAD])
    assert not np.allclose(saved[name][1:], loaded[name][1:])
    assert not np.allclose(saved["lm_head.weight"][PAD], loaded["lm_head.weight"][PAD])
