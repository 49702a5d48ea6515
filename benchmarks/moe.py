"""A mixture of experts against the dense model of the same active parameters
(``moe/step_over_dense_active``).

A Mixtral-shaped model (``models/mixtral.py``: 8 experts, top-2, each expert's MLP of
intermediate size I) and a LLaMA whose one MLP has intermediate size 2 I: every token
runs through the same number of parameters in both (attention alike; the router's
hidden x 8 besides). Same mesh (4 simulated CPU devices, data 4: each device dispatches
its own tokens), batch, sequence, optimizer (adamw), float32; the MoE's loss adds its
load-balancing loss, as a user's would. Each round times ``--steps`` steps of each
model, in alternating order; compilation is done before the first round. The figure
is the MoE's median tokens/s over the dense model's, with the spread of the per-round
ratios; beside it XLA's FLOPs of both compiled steps (cost analysis), which say what
the backend runs: on XLA:CPU ``jax.lax.ragged_dot`` is a dense masked product (every
assigned row against every expert), so the MoE computes experts x the useful FLOPs of
its experts' matmuls; on GPU it is a grouped matmul (not measured here: no GPU).

    python benchmarks/moe.py [--steps 3] [--rounds 5]
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import figure, parser, save, simulate_devices, stats  # noqa: E402

simulate_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

COMMAND = "python benchmarks/moe.py"
FULL = dict(vocab=1024, hidden=256, intermediate=512, layers=2, heads=4, batch=16, seq=128)
TINY = dict(vocab=128, hidden=32, intermediate=32, layers=1, heads=4, batch=4, seq=16)
EXPERTS, TOP_K = 8, 2


def configs(s: dict):
    from transformers import LlamaConfig, MixtralConfig

    common = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                  num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
                  max_position_embeddings=s["seq"] + 1, tie_word_embeddings=False)
    moe = MixtralConfig(**common, intermediate_size=s["intermediate"],
                        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    dense = LlamaConfig(**common, intermediate_size=TOP_K * s["intermediate"])
    return moe, dense


def trainers(s: dict) -> dict:
    import redray
    from redray.models import build, moe as moe_layer

    moe_config, dense_config = configs(s)

    def moe_loss(m, batch, rng, train):
        logits, aux = m(batch["ids"][:, :-1], train=train, aux=True)
        tokens = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["ids"][:, 1:]).mean()
        return tokens + moe_layer.auxiliary_loss(aux, m.config)

    def dense_loss(m, batch, rng, train):
        logits = m(batch["ids"][:, :-1], train=train)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["ids"][:, 1:]).mean()

    def collate(examples):
        return {"ids": np.stack([e["ids"] for e in examples])}

    out = {}
    for name, config, loss in (("moe", moe_config, moe_loss), ("dense", dense_config,
                                                                 dense_loss)):
        # layers as a list: XLA's cost analysis (the FLOPs beside the figure) counts a
        # scanned loop's body once
        out[name] = redray.Trainer.of(lambda rngs, c=config: build(c, rngs=rngs, scan=False),
                                   collate, loss,
                                   optax.adamw(1e-3), batch_size=s["batch"], data_axis=4,
                                   progress=False, checkpoint=False, seed=0)
    return out


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    s = TINY if args.tiny else FULL
    steps, rounds = (1, 1) if args.tiny else (args.steps, args.rounds)
    rs = np.random.default_rng(0)
    data = [{"ids": rs.integers(0, s["vocab"], s["seq"] + 1).astype(np.int32)}
            for _ in range(s["batch"] * (steps + 1))]
    batches = [{"ids": np.stack([e["ids"] for e in data[i * s["batch"]:(i + 1) * s["batch"]]])}
               for i in range(steps + 1)]
    runs = trainers(s)
    flops, params = {}, {}
    for name, t in runs.items():
        t.init(data)
        jax.block_until_ready(t.train_step(batches[0]))  # compiled and warm
        flops[name] = float(t.compiled_step().cost_analysis()["flops"])
        params[name] = sum(x.size for x in jax.tree.leaves(t.runtime.abstract[0]))
    times = {name: [] for name in runs}
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            start = time.perf_counter()
            for batch in batches[1:]:
                metrics = runs[name].train_step(batch)
            jax.block_until_ready(metrics)
            times[name].append((time.perf_counter() - start) / steps)
    tokens = s["batch"] * s["seq"]
    ratios = [d / m for m, d in zip(times["moe"], times["dense"])]
    ratio = statistics.median(times["dense"]) / statistics.median(times["moe"])
    moe_config, dense_config = configs(s)
    print(f"MoE {statistics.median(times['moe']) * 1e3:.1f} ms/step, dense "
          f"{statistics.median(times['dense']) * 1e3:.1f} ms/step: {ratio:.3f}x "
          f"(per round {min(ratios):.3f}-{max(ratios):.3f}); compiled FLOPs MoE/dense "
          f"{flops['moe'] / flops['dense']:.2f}")
    save([figure(
        "moe/step_over_dense_active", ratio, "x",
        f"a LLaMA of the same active parameters (MLP {TOP_K} x {s['intermediate']} wide "
        f"against {EXPERTS} experts of {s['intermediate']}, top-{TOP_K}), same mesh "
        "(4 CPU devices, data 4), batch and optimizer", None, COMMAND,
        seconds_per_step={k: stats(v) for k, v in times.items()},
        tokens_per_s={k: tokens / statistics.median(v) for k, v in times.items()},
        ratio_per_round=stats(ratios), compiled_flops=flops,
        compiled_flops_moe_over_dense=flops["moe"] / flops["dense"], parameters=params,
        backend=jax.default_backend())], args.out)


if __name__ == "__main__":
    main()
