"""Expert parallelism's exchanges: bytes of the compiled training step's collectives over
the expert axis, over the per-device ideal (``communication/moe_ep/<exchange>``), and
the assignments the exchange drops (``moe/dropped_tokens``).

A Qwen3-MoE-shaped model (``redray.models``: 64 experts, top-6 of them, softmax router,
dropless; 2 layers, hidden 256, vocabulary 512) trains one step on 8 simulated CPU
devices with ``expert_axis=4, model_axis=2`` (the experts over 4 devices, each expert's
inner width over 2), batch 8 x sequence 64 (128 tokens a device of the expert axis),
with each exchange (``Plan.expert_exchange``):

* ``gather``: each device all-gathers its expert group's tokens (with their choices and
  weights), runs its own experts on those routed to them, and reduce-scatters the
  outputs back (``redray/models/moe.py``'s ``gathered``): nothing dropped, no slots.
* ``all_to_all``: the fixed-slot all-to-all (``exchange``), dropless: every (device,
  expert) pair a slot per token (XLA:CPU has no ragged all-to-all).

The ideal (per device, forward and backward): each token's hidden state sent once to
each distinct device holding one of its experts and its result sent back, 4 x the sum
over the device's tokens of those devices x hidden x 4 bytes; the devices of each
token's experts are read from the model's own routing of the batch (``MoE.routed``'s
choices on one device, the same parameters), counting the token's own device where it
holds one of its experts, as an all-gather's size counts the device's own part. The
bytes counted are those of every collective whose groups are the expert axis's, an
all-gather by its gathered size, a reduce-scatter and an all-to-all by their full
buffers (what each device sends and keeps), inside the layers' ``shard_map``: the
tokens and, with them, their choices (in the narrowest integer type) and routing
weights, and the weights' gradients back. Beside them in the detail, not counted: the
gradients' all-reduce over the same devices (the expert axis is a data axis for every
other layer) and XLA's gather of the router's logits for their top-k.

    python benchmarks/moe_exchange.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import figure, parser, save, simulate_devices  # noqa: E402

simulate_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

COMMAND = "python benchmarks/moe_exchange.py"
FULL = dict(experts=64, top_k=6, hidden=256, inner=64, layers=2, vocab=512, batch=8, seq=64)
TINY = dict(FULL, experts=16, hidden=64, inner=16, seq=16)
WAYS, MODEL = 4, 2
EXCHANGES = ("gather", "all_to_all")


def config(s: dict):
    import transformers

    return transformers.AutoConfig.for_model(
        "qwen3_moe", vocab_size=s["vocab"], hidden_size=s["hidden"],
        intermediate_size=4 * s["hidden"], moe_intermediate_size=s["inner"],
        num_hidden_layers=s["layers"], num_attention_heads=4, num_key_value_heads=4,
        head_dim=s["hidden"] // 4, num_experts=s["experts"], num_experts_per_tok=s["top_k"],
        norm_topk_prob=True, max_position_embeddings=s["seq"] + 1, tie_word_embeddings=False,
        pad_token_id=None, bos_token_id=None, eos_token_id=None)


def loss(model, batch, rng, train):

    logits, aux = model(batch["ids"][:, :-1], train=train, aux=True)
    tokens = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["ids"][:, 1:]).mean()
    return tokens, {"dropped_assignments": aux["dropped"] * aux["expert_tokens"].sum()}


def batch(s: dict) -> list[dict]:
    ids = np.random.default_rng(0).integers(0, s["vocab"], (s["batch"], s["seq"] + 1))
    return [{"ids": row.astype(np.int32)} for row in ids]


def ideal_bytes(s: dict, model, data) -> tuple[float, dict]:
    """The ideal per device (module docstring) from the model's routing of ``data``."""
    from redray.models import moe

    seen = []
    routed = moe.MoE.routed

    def spy(self, x, chosen, weights):
        seen.append(np.asarray(chosen).reshape(-1, chosen.shape[-1]))
        return routed(self, x, chosen, weights)

    moe.MoE.routed = spy
    try:
        model(jnp.asarray(np.stack([d["ids"] for d in data])[:, :-1]))
    finally:
        moe.MoE.routed = routed
    per_device = s["experts"] // WAYS
    distinct = [np.mean([len(set(row // per_device)) for row in chosen]) for chosen in seen]
    tokens = s["batch"] * s["seq"] // WAYS  # a device's tokens
    total = sum(4 * tokens * d * s["hidden"] * 4 for d in distinct)
    return total, {"distinct_devices_per_token": [float(d) for d in distinct],
                   "uniform_expectation": WAYS * (1 - _none_on(s, per_device))}


def _none_on(s: dict, per_device: int) -> float:
    """P(a device holds none of a token's top-k experts) when they are drawn uniformly."""
    p = 1.0
    for i in range(s["top_k"]):
        p *= (s["experts"] - per_device - i) / (s["experts"] - i)
    return p


def expert_bytes(found, devices: int) -> tuple[int, dict, dict]:
    """Bytes of the exchange's collectives: those over the expert axis's groups inside
    the layers' ``shard_map`` (module docstring), by kind; and beside them the other
    collectives over those groups (the gradients' all-reduce of the layers the expert
    axis splits as a data axis; XLA's gather of the router's logits for its top-k)."""
    import re

    from redray.sharding.collectives import device_groups

    mesh = np.arange(devices).reshape(WAYS, MODEL)  # (expert, model): the plan's order
    groups = {tuple(sorted(mesh[:, m].tolist())) for m in range(MODEL)}
    total, kinds, other = 0, {}, {}
    for c in found:
        if {tuple(sorted(g)) for g in device_groups(c, devices)} != groups:
            continue
        size = c.bytes * (WAYS if c.kind == "reduce-scatter" else 1)
        name = re.search(r'op_name="([^"]*)"', c.line)
        if name is None or "shard_map" not in name.group(1):
            other[c.kind] = other.get(c.kind, 0) + size
            continue
        total += size
        kinds[c.kind] = kinds.get(c.kind, 0) + size
    return total, kinds, other


def step(s: dict, exchange: str, data):
    """(collectives of the compiled step, its metrics after one step)."""
    import redray
    from redray import Parallelism, Plan
    from redray.models import build
    from redray.sharding.collectives import collectives

    plan = Plan(Parallelism.of(expert_axis=WAYS, model_axis=MODEL).build(),
                expert_exchange=exchange)
    rows = []

    class Rows(redray.Hook):
        def on_log(self, run, row):
            rows.append(row)

    trainer = redray.Trainer.of(
        lambda rngs: build(config(s), rngs=rngs, scan=False),
        lambda ex: {"ids": np.stack([e["ids"] for e in ex])}, loss, optax.adam(1e-3),
        batch_size=s["batch"], progress=False, plan=plan, hooks=[Rows()], log_every=1)
    trainer.init(data)
    found = collectives(trainer.compiled_step().as_text())
    trainer.fit(data, epochs=1)
    return found, rows[-1], trainer


def main(argv=None) -> None:
    from redray.models import build

    args = parser(__doc__).parse_args(argv)
    s = TINY if args.tiny else FULL
    data = batch(s)
    ideal, routing = ideal_bytes(s, build(config(s), seed=0, scan=False), data)
    figures, detail = [], {}
    for exchange in EXCHANGES:
        found, row, _ = step(s, exchange, data)
        total, kinds, other = expert_bytes(found, len(jax.devices()))
        detail[exchange] = dict(bytes=total, by_kind=kinds, not_the_exchange=other,
                                dropped_assignments=float(row["dropped_assignments"]))
        print(f"{exchange}: {total:,} B over the expert axis ({kinds}), ideal {ideal:,.0f} B; "
              f"dropped {row['dropped_assignments']:.0f}")
        figures.append(figure(
            f"communication/moe_ep/{exchange}", total / ideal, "x",
            f"the per-device ideal, {ideal:,.0f} B: each token's hidden state once to each "
            f"distinct device of its experts and back, forward and backward ({s['experts']} "
            f"experts, top-{s['top_k']}, expert {WAYS} x model {MODEL} on 8 CPU devices; "
            "module docstring)", "<= 1.2" if exchange == "gather" else None, COMMAND,
            **detail[exchange], ideal_bytes=ideal, routing=routing, sizes=s))
    figures.append(figure(
        "moe/dropped_tokens", detail["gather"]["dropped_assignments"], "assignments",
        "the assignments the gather exchange dropped in one step of the same model "
        f"(expert axis {WAYS}), counted by the layers' reports", "<= 0", COMMAND,
        per_exchange={k: v["dropped_assignments"] for k, v in detail.items()}))
    save(figures, args.out)


if __name__ == "__main__":
    main()
