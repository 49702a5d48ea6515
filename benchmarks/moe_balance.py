"""Auxiliary-loss-free balancing (DeepSeek-V3's bias update) against the same run without
it (``moe/load_cv_over_control_200``).

A tiny DeepSeek-V3 (``redray/models/deepseek.py``: latent attention, a dense first layer,
then 3 MoE layers of 16 experts in 4 groups, top-4 within the 2 best groups, a shared
expert) is trained ``--steps`` steps twice from the same initial parameters on the same
batches of real text (Python's documentation, ``pydoc_data.topics``, as bytes), one
device, Adam: once with the bias update on (``bias_update_speed`` 0.001, the family's
default) and once with it off (0, the control). Both losses ask the model for its
router statistics (``aux=True``; no auxiliary loss is added to either) and log each
MoE layer's per-expert load of the step's batch: its coefficient of variation (std over
mean, 0 for a perfectly even load), averaged over the layers. The figure is that
average at the last step with the update over the control's, each the mean of the last
10 steps' values (one batch's load is noisy); the loss curves of both runs are in the
detail, every 10 steps.

    python benchmarks/moe_balance.py [--steps 200]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import figure, parser, save, simulate_devices  # noqa: E402

simulate_devices(1)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

COMMAND = "python benchmarks/moe_balance.py"
FULL = dict(steps=200, batch=16, seq=64, hidden=64, experts=16)
TINY = dict(steps=12, batch=4, seq=16, hidden=32, experts=8)
LAST = 10  # the steps averaged at the end


def text_batches(s: dict) -> list[dict]:
    """``steps`` batches of ``batch`` rows of ``seq + 1`` bytes of real text."""
    from pydoc_data.topics import topics

    data = np.frombuffer("\n".join(topics.values()).encode("utf-8", "replace"), np.uint8)
    rows = s["steps"] * s["batch"]
    width = s["seq"] + 1
    starts = np.random.default_rng(0).integers(0, len(data) - width, rows)
    ids = np.stack([data[i:i + width] for i in starts]).astype(np.int32)
    return [{"ids": row} for row in ids]


def config(s: dict, speed: float):
    import transformers

    e = s["experts"]
    return transformers.AutoConfig.for_model(
        "deepseek_v3", vocab_size=256, hidden_size=s["hidden"],
        intermediate_size=2 * s["hidden"], moe_intermediate_size=s["hidden"] // 2,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=s["hidden"] // 2, kv_lora_rank=s["hidden"] // 4, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=e, num_experts_per_tok=4,
        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
        max_position_embeddings=s["seq"] + 1, pad_token_id=None, bos_token_id=None,
        eos_token_id=None, bias_update_speed=speed)


def loss(model, batch, rng, train):
    logits, aux = model(batch["ids"][:, :-1], train=train, aux=True)
    tokens = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["ids"][:, 1:]).mean()
    counts = aux["expert_tokens"]  # (MoE layers, experts)
    cv = (counts.std(-1) / jnp.maximum(counts.mean(-1), 1e-9)).mean()
    return tokens, {"load_cv": cv}


def run(s: dict, speed: float, data: list[dict]) -> list[dict]:
    """The logged rows of one run (every step)."""
    import redray
    from redray.models import build

    rows = []

    class Rows(redray.Hook):
        def on_log(self, run, row):
            rows.append(row)

    trainer = redray.Trainer.of(
        build(config(s, speed), seed=0), lambda ex: {"ids": np.stack([e["ids"] for e in ex])},
        loss, optax.adam(3e-3), batch_size=s["batch"], progress=False, hooks=[Rows()],
        log_every=1)
    trainer.fit(data, epochs=1, shuffle=False)
    return rows


def main(argv=None) -> None:
    args = parser(__doc__).parse_args(argv)
    s = TINY if args.tiny else FULL
    data = text_batches(s)
    runs = {"balanced": run(s, 0.001, data), "control": run(s, 0.0, data)}
    last = {name: float(np.mean([r["load_cv"] for r in rows[-LAST:]]))
            for name, rows in runs.items()}
    curves = {name: {r["step"]: round(float(r["loss"]), 4) for r in rows
                     if r["step"] % 10 == 0 or r["step"] == 1}
              for name, rows in runs.items()}
    cv = {name: {r["step"]: round(float(r["load_cv"]), 4) for r in rows
                 if r["step"] % 10 == 0 or r["step"] == 1}
          for name, rows in runs.items()}
    print(f"load CV over the last {LAST} steps: balanced {last['balanced']:.3f}, control "
          f"{last['control']:.3f}; final loss {runs['balanced'][-1]['loss']:.3f} vs "
          f"{runs['control'][-1]['loss']:.3f}")
    save([figure(
        f"moe/load_cv_over_control_{s['steps']}", last["balanced"] / last["control"], "x",
        f"the same tiny DeepSeek-V3, initial parameters and text batches without the bias "
        f"update (bias_update_speed 0): the per-expert load's coefficient of variation, "
        f"mean over the MoE layers and the last {LAST} of {s['steps']} steps",
        "<= 0.8", COMMAND, cv_last=last, loss_every_10=curves, load_cv_every_10=cv,
        final_loss={name: float(rows[-1]["loss"]) for name, rows in runs.items()},
        sizes=s)], args.out)


if __name__ == "__main__":
    main()
