"""The continuous-batching sampler against redray's static ``generate`` and against
transformers' PyTorch ``generate`` (``sampler/tokens_per_s_over_generate``,
``sampler/tokens_per_s_over_transformers``).

64 prompts (16 to 32 tokens) whose completions have lengths spread evenly on a log
scale from 1x to 16x a base length (``--base`` tokens): most answers short, a few
long, as reinforcement learning's rollouts are. Greedy, one random LLaMA (float32, one
CPU device: the whole machine), the same prompts and lengths for all three:

- redray's ``generate``: the 64 prompts as one left-padded batch and
  ``max_new_tokens`` = the longest completion (a static batch decodes until its
  longest row ends: that is the reference's cost). Its useful tokens are each row's
  first ``length`` tokens.
- the ``Sampler`` (``--slots`` sequences in flight, by default all 64: a server's
  batch, vLLM's ``max_num_seqs``, is as wide as that): each request asks for its own
  length (``SamplingParams.max_new_tokens``), so a slot frees as soon as its completion
  is done and takes the next prompt.
- transformers' ``generate`` with its static cache on the same weights (exported with
  ``save_pretrained``), the same batch as redray's ``generate``, on as many torch
  threads as the machine has cores (what XLA:CPU uses).

The completion lengths are set by the request, not by an EOS the random model would
emit: a static batch's cost is the same either way (it decodes until its longest row
is done), and the sampler's is what EOS would give it. The figure is useful (asked)
tokens per second over the reference's, medians over ``--rounds`` rounds in
alternating order after a compiling warm-up; beside it the ideal ratio of the length
schedule alone (the longest length times 64 over the sum of lengths), which is what
continuous batching removes at equal cost per decoded row.

For that workload the detail also holds this machine's ceiling (``ceiling``): a
decoding step timed alone at a few sizes and fitted, from which ``generate``'s time and
a perfect sampler's follow (``ceiling()``); where attention is a small share of a step,
no sampler reaches 3 (docs/performance/sampler.md).

With ``--prompts`` above ``--slots`` (``--prompts 256``: the refill workload, figures
``..._refills``), slots are refilled as they free, which the default workload (as many
prompts as slots) never does: the reference decodes the prompts in static batches of
``--slots``, each to its own longest completion (the least a static batch can do), and
transformers the same; the schedule's ideal ratio is then the batches' rows times their
longest completions over the sum of lengths.

With ``--group G`` (``--prompts 256 --group 8``: GRPO's rollouts, figures
``..._groups``), each prompt is asked G times in a row, each request with its own
length; beside the sampler, the same sampler with every slot's prompt run through the
model on its own (``each_prompt_run`` in the detail: the prefill before a prompt taken
by several slots was run once).

With ``--hybrid`` (``--prompts 256 --hybrid``: figure
``sampler/hybrid_tokens_per_s_over_generate``) the model is a Qwen3.5-shaped hybrid
of the same width (``hybrid_config``: three Gated DeltaNet layers to one full attention
layer), which the Sampler serves on its paged cache only (each slot holding its linear
layers' state and convolution window, replaced on refill); transformers' side is not
run (its Gated DeltaNet is a PyTorch loop over tokens without flash-linear-attention).

With ``--mla`` (figure ``sampler/mla_cache_bytes_over_mha``) the model has DeepSeek-V3's
attention shapes and the figure is the bytes of the Sampler's KV cache, which holds the
latent (``mla_figures``), against a cache of every head's keys and values for the same
tokens; its greedy tokens are checked against ``generate``'s.

    python benchmarks/sampler.py [--slots 64] [--base 8] [--rounds 3] [--prompts 256]
                                 [--group 8] [--hybrid] [--mla]
"""

import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import figure, machine, parser, save, stats  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

COMMAND = "python benchmarks/sampler.py"
FULL = dict(vocab=2048, hidden=256, intermediate=688, layers=4, heads=8, prompts=64, base=8)
TINY = dict(vocab=64, hidden=32, intermediate=64, layers=1, heads=4, prompts=8, base=2)


def workload(s: dict, base: int):
    """(prompts, completion lengths): lengths base x 2^(4 i / (n-1)), rounded, shuffled;
    each prompt ``s["group"]`` times in a row (default once)."""
    rs = np.random.default_rng(0)
    n, group = s["prompts"], s.get("group", 1)
    prompts = [p for _ in range(-(-n // group))
               for p in [rs.integers(1, s["vocab"], rs.integers(16, 33)).tolist()] * group][:n]
    lengths = np.rint(base * 2.0 ** (4 * np.arange(n) / (n - 1))).astype(int)
    return prompts, rs.permutation(lengths).tolist()


def left_padded(prompts, width: int | None = None):
    width = width or max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    return ids, mask


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--base", type=int, help="the shortest completion (default: 8 tokens)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, help="requests (default: the workload's, as many "
                    "as slots; more: the refill workload, figures ..._refills)")
    ap.add_argument("--group", type=int, default=1, help="requests per prompt, side by side "
                    "(GRPO's group; above 1: figures ..._groups)")
    ap.add_argument("--hybrid", action="store_true", help="a Qwen3.5-shaped hybrid model "
                    "(figure sampler/hybrid_tokens_per_s_over_generate)")
    ap.add_argument("--mla", action="store_true", help="DeepSeek-V3's attention shapes: the "
                    "latent cache's bytes (figure sampler/mla_cache_bytes_over_mha)")
    args = ap.parse_args(argv)
    if args.mla:
        save(mla_figures(args.tiny), args.out)
        return
    s = TINY if args.tiny else FULL
    slots = min(args.slots, s["prompts"])
    s = dict(s, prompts=args.prompts or s["prompts"], group=args.group)
    if args.hybrid:
        save([hybrid_figure(s, args.base or s["base"], slots,
                            1 if args.tiny else args.rounds)], args.out)
        return
    suffix = "_groups" if args.group > 1 else "_refills" if s["prompts"] > slots else ""
    # with refills: the same Sampler refilled by the host between rounds, and one with
    # the structure it has off CPUs (a check every 16 steps, the rest in one call), whose
    # round trips per completion are the figure a GPU needs (counted here)
    variants = dict(host_refill=dict(refill_on_device=False),
                    gpu_structure=dict(narrow=False, check_every=16)) if suffix else {}
    pools = {}
    if suffix == "_refills":  # the paged cache: a pool for every slot's longest request,
        # and half of it (requests wait for pages)
        prompts, lengths = workload(s, args.base or s["base"])
        row = -(-max(map(len, prompts)) // 16) * 16 + max(lengths)  # the Sampler's max_length
        pools = dict(paged=slots * -(-row // 16), paged_half_pool=slots * -(-row // 16) // 2)
        variants.update({name: dict(kv_cache="paged", kv_pages=n) for name, n in pools.items()})
    per_s, detail = measure(s, args.base or s["base"], slots, 1 if args.tiny else args.rounds,
                            variants=variants)
    if not suffix:
        detail["ceiling"] = found = ceiling(s, args.base or s["base"],
                                            repeats=1 if args.tiny else 7)
        print(f"this machine's ceiling for the workload: {found['ratio']:.2f} (a step: "
              + ", ".join(f"{k} {v:.4f} ms" for k, v in found["step_fit_ms"].items()) + ")")
    command = COMMAND + (f" --prompts {s['prompts']}" if s["prompts"] > slots else "") + (
        f" --group {args.group}" if args.group > 1 else "")
    targets = {"": ">= 3", "_refills": ">= 2.5"}
    out = figures("sampler", suffix, per_s, detail, command, targets.get(suffix))
    if suffix == "_refills":
        out.append(figure(
            "sampler/host_round_trips_per_completion",
            detail["round_trips_per_completion"]["gpu_structure"], "",
            "compiled calls and reads of device values per finished completion, counted, of "
            "the Sampler as it is built off CPUs (check_every=16, narrow=False); CPU default "
            "and host refills beside it in the detail", "<= 0.1", command,
            per_sampler=detail["round_trips_per_completion"]))
        window = detail["window_tokens"]
        out.append(figure(
            "sampler/paged_tokens_per_s_over_generate_refills",
            per_s["paged"] / per_s["generate"], "x",
            f"redray's generate as above; the Sampler with kv_cache='paged', a pool of "
            f"{pools['paged']} pages of 16 tokens ({pools['paged'] * 16} tokens: every "
            f"slot's longest request; the window's cache holds {window}), in the same "
            "rounds; with half the pool in the detail", None, command,
            pool_tokens={k: v * 16 for k, v in pools.items()}, window_tokens=window,
            over_generate={k: per_s[k] / per_s["generate"] for k in
                           ("sampler", *pools)}))
    save(out, args.out)


def hybrid_figure(s: dict, base: int, slots: int, rounds: int) -> dict:
    """``sampler/hybrid_tokens_per_s_over_generate``: the paged Sampler on the hybrid
    model against its static ``generate`` (the module docstring)."""
    per_s, detail = measure(dict(s, hybrid=True), base, slots, rounds, torch=False)
    command = COMMAND + (f" --prompts {s['prompts']}" if s["prompts"] > slots else "") + \
        " --hybrid"
    return figure(
        "sampler/hybrid_tokens_per_s_over_generate", per_s["sampler"] / per_s["generate"],
        "x", f"redray's generate on the same hybrid model (Gated DeltaNet and full "
        f"attention), weights and greedy tokens: the {s['prompts']} prompts as left-padded "
        f"batches of {slots}, each decoded to its longest completion", ">= 2.0", command,
        **detail)


# DeepSeek-V3's attention (128 heads, a query rank of 1536, a key/value latent of 512, a
# rotary key part of 64, heads of 128 + 64 against values of 128) in a model of a small
# width, vocabulary and expert count (the cache does not depend on them); --tiny: a
# quarter of each
MLA = dict(vocab=512, hidden=256, heads=128, q_lora=1536, kv_lora=512, rope=64, nope=128,
           v=128, layers=2, prompts=6, new=12)
MLA_TINY = dict(MLA, heads=8, q_lora=64, kv_lora=32, rope=16, nope=32, v=32)


def mla_figures(tiny: bool) -> list[dict]:
    """``sampler/mla_cache_bytes_over_mha``: the Sampler's KV cache arrays (paged and
    windowed) on a model with DeepSeek-V3's attention shapes (``MLA``), over a cache of
    the same tokens holding every head's key (``qk_nope + rope``) and value (``v``), as
    ``transformers``' cache would after expanding the latent; the greedy tokens against
    ``generate``'s."""
    import transformers

    from redray.models import build, generate
    from redray.post_training import Sampler, SamplingParams

    m = MLA_TINY if tiny else MLA
    config = transformers.AutoConfig.for_model(
        "deepseek_v3", vocab_size=m["vocab"], hidden_size=m["hidden"],
        intermediate_size=2 * m["hidden"], moe_intermediate_size=m["hidden"] // 2,
        num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
        num_key_value_heads=m["heads"], q_lora_rank=m["q_lora"], kv_lora_rank=m["kv_lora"],
        qk_rope_head_dim=m["rope"], qk_nope_head_dim=m["nope"], v_head_dim=m["v"],
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=256, pad_token_id=0,
        eos_token_id=None, bos_token_id=None)
    model = build(config, seed=0)
    rs = np.random.default_rng(0)
    prompts = [rs.integers(1, m["vocab"], rs.integers(4, 17)).tolist()
               for _ in range(m["prompts"])]
    ids, mask = left_padded(prompts)
    ref = np.asarray(generate(model, ids, mask, max_new_tokens=m["new"], eos_token_id=-1))
    per_token_mha = m["layers"] * m["heads"] * (m["nope"] + m["rope"] + m["v"]) * 4  # float32
    found = {}
    for kind in ("paged", "window"):
        sampler = Sampler(model, slots=4, max_length=48, eos_token_id=-1, kv_cache=kind,
                          **(dict(kv_pages=12, page_size=16) if kind == "paged" else {}))
        done = sampler.sample(prompts, SamplingParams(max_new_tokens=m["new"]))
        found[kind] = dict(cache_bytes=sampler.cache_bytes, cache_tokens=sampler.cache_tokens,
                           tokens_equal_generate=[list(c.tokens) for c in done] == ref.tolist())
        found[kind]["over_mha"] = found[kind]["cache_bytes"] / (
            found[kind]["cache_tokens"] * per_token_mha)
    worst = max(v["over_mha"] for v in found.values())
    return [figure(
        "sampler/mla_cache_bytes_over_mha", worst, "x",
        f"a cache of the same tokens holding each of the {m['heads']} heads' key "
        f"({m['nope'] + m['rope']}) and value ({m['v']}) in every layer; the Sampler's "
        f"paged pool and window (the larger ratio) on DeepSeek-V3's attention shapes "
        f"(latent {m['kv_lora']} + rotary {m['rope']} per token and layer)", "<= 0.1",
        COMMAND + " --mla", per_cache=found, shapes=m,
        tokens_equal_generate=all(v["tokens_equal_generate"] for v in found.values()))]


def hybrid_config(s: dict):
    """A Qwen3.5 (text) config of ``s``'s sizes (``_lm.hybrid_config``: three Gated
    DeltaNet layers to one full attention), as many key heads as ``heads`` and twice as
    many value heads, every head ``hidden / heads`` wide, a convolution of 4 tokens."""
    from _lm import hybrid_config as qwen3_5

    d = s["hidden"] // s["heads"]
    return qwen3_5(s["vocab"], s["hidden"], s["layers"], s["intermediate"], s["heads"],
                   s["heads"], d, s["heads"], 2 * s["heads"], d, max_position_embeddings=512,
                   pad_token_id=0)


def measure(s: dict, base: int, slots: int, rounds: int, bf16: bool = False,
            variants: dict | None = None, torch: bool = True):
    """Useful tokens/s of the three (``generate``, ``sampler``, ``transformers`` where
    torch is installed) on the workload of size ``s``, and the run's detail; ``bf16``:
    the weights and the computation in bfloat16 (float32 otherwise); ``variants``:
    name -> keyword arguments of more Samplers timed in the same rounds (their figures
    in the detail)."""
    from redray.models import generate
    from redray.post_training import Sampler, SamplingParams

    config, model = built(s, bf16)
    prompts, lengths = workload(s, base)
    useful = sum(lengths)
    width, longest = max(map(len, prompts)), max(lengths)
    # the reference's static batches: as many prompts as the sampler has slots, each
    # decoded to its own longest completion
    batches = [(left_padded(prompts[i:i + slots], width), max(lengths[i:i + slots]))
               for i in range(0, len(prompts), slots)]
    sampler = Sampler(model, slots=slots, max_length=-(-width // 16) * 16 + longest)
    requests = [SamplingParams(max_new_tokens=n) for n in lengths]
    static = {n: jax.jit(lambda m, i, a, n=n: generate(m, i, a, max_new_tokens=n))
              for n in {n for _, n in batches}}

    def run_generate():  # each row's tokens
        return [row for (ids, mask), n in batches
                for row in np.asarray(static[n](model, ids, mask))]

    def run_sampler():
        return sampler.sample(prompts, requests)

    runs = {"generate": run_generate, "sampler": run_sampler}
    samplers = {"sampler": sampler}  # each one's round trips are read after its calls
    variants = dict(variants or {})
    if s.get("group", 1) > 1:  # the same, every slot's prompt run on its own
        variants["each_prompt_run"] = dict(kind=_each_prompt_run())
    for name, kwargs in variants.items():
        kind = kwargs.get("kind", Sampler)
        other = kind(model, slots=slots, max_length=sampler.max_length,
                     **{k: v for k, v in kwargs.items() if k != "kind"})
        runs[name] = (lambda other: lambda: other.sample(prompts, requests))(other)
        samplers[name] = other
    reference = transformers_reference(model, config, batches, bf16) if torch else None
    torch_on = None  # where transformers ran (None: torch is not installed)
    if reference is not None:
        runs["transformers"], torch_on = reference
    outputs = {name: fn() for name, fn in runs.items()}  # compiled and warm
    # compiled calls and reads of device values per completion, counted (each a wait
    # for the device: the structure a GPU needs, counted as well on a CPU)
    trips = {name: x.round_trips / len(lengths) for name, x in samplers.items()}
    done = outputs["sampler"]
    assert [len(c.tokens) for c in done] == lengths, "the sampler ignored a request's length"
    same = sum(np.array_equal(c.tokens, outputs["generate"][i][:n])
               for i, (c, n) in enumerate(zip(done, lengths)))
    times = {name: [] for name in runs}
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    per_s = {name: useful / statistics.median(t) for name, t in times.items()}
    ideal = sum(n * len(ids) for (ids, _), n in batches) / useful  # the rows' decoded tokens
    per_round = [g / m for g, m in zip(times["generate"], times["sampler"])]
    variant_detail = {name: dict(kwargs={k: getattr(v, "__name__", v) for k, v in
                                         variants[name].items()}, over_generate=stats(
        [g / m for g, m in zip(times["generate"], times[name])])) for name in variants}
    detail = dict(seconds={k: stats(v) for k, v in times.items()}, useful_tokens_per_s=per_s,
                  ratio_to_generate_per_round=stats(per_round), variants=variant_detail,
                  round_trips_per_completion=trips,
                  window_tokens=samplers["sampler"].cache_tokens,
                  useful_tokens=useful, ideal_schedule_ratio=ideal, slots=slots,
                  prompts=len(lengths), group=s.get("group", 1),
                  lengths=dict(min=min(lengths), max=longest, mean=useful / len(lengths)),
                  greedy_rows_equal_to_generate=f"{same}/{len(lengths)}",
                  model={k: s[k] for k in ("vocab", "hidden", "intermediate", "layers", "heads")
                         } | dict(kv_heads=config.num_key_value_heads,
                                  dtype="bfloat16" if bf16 else "float32"),
                  threads=os.cpu_count(), backend=jax.default_backend(), transformers_on=torch_on,
                  device=jax.devices()[0].device_kind, machine=machine())
    print(f"useful tokens/s: {', '.join(f'{k} {v:.0f}' for k, v in per_s.items())}; "
          f"over generate per round {min(per_round):.2f}-{max(per_round):.2f}; schedule's ideal "
          f"ratio {ideal:.2f}; greedy rows equal {same}/{len(lengths)}")
    return per_s, detail


def built(s: dict, bf16: bool = False):
    """(config, model): the random LLaMA of size ``s`` (``s["hybrid"]``: the
    ``hybrid_config`` model), in float32 or bfloat16."""
    import jax.numpy as jnp
    from flax import nnx
    from transformers import LlamaConfig

    from redray.models import build

    config = hybrid_config(s) if s.get("hybrid") else LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s.get("kv_heads", s["heads"]), max_position_embeddings=512,
        eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    model = build(config, rngs=nnx.Rngs(0), dtype=dtype)
    if bf16:  # the parameters too, as an inference checkpoint holds them
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda x: x.astype(dtype), params))
    return config, model


def ceiling(s: dict, base: int, rows=(1, 8, 64), columns=(48, 176), steps: int = 32,
            repeats: int = 7) -> dict:
    """What bounds the figure on this machine, for the workload of as many prompts as
    slots: a decoding step of the model timed alone at ``rows`` x ``columns`` (``steps``
    in one compiled loop, medians of ``repeats``), fitted as a fixed cost + a cost a row +
    a cost a row and column (the attention's stream of the cached keys and values). From
    the fit and ``generate``'s prefill (timed: one new token), ``generate``'s time (every
    row to the longest completion, its cache as wide from the first step) and a perfect
    sampler's (every decoded row live, its window exactly the live span, no copy, no
    host time); their ratio is the most any sampler reaches here at this model's cost
    per step."""
    import jax.numpy as jnp
    from flax import nnx

    from redray.planning.probe import _timed
    from redray.models import generate
    from redray.models.generate import for_decoding
    from redray.post_training.kv_window import bucket

    config, model = built(s)
    prompts, lengths = workload(s, base)
    ids, mask = left_padded(prompts)
    width = bucket(ids.shape[1])  # the prompts' columns, as the sampler pads them
    graphdef, state = nnx.split(for_decoding(model))

    def loop(state, cache, valid, token):
        def step(i, c):
            cache, token = c
            logits, cache = nnx.merge(graphdef, state)(
                token[:, None], valid, cache=cache, cache_index=valid.shape[1] - steps + i)
            return cache, jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
        return jax.lax.fori_loop(0, steps, step, (cache, token))[1]

    loop = jax.jit(loop)
    points = [(r, c, _timed(loop, state, model.init_cache(r, c), jnp.ones((r, c), jnp.int32),
                            jnp.ones((r,), jnp.int32), repeats=repeats) / steps)
              for r in rows for c in columns]
    fixed, per_row, per_cell = np.linalg.lstsq(
        np.array([[1, r, r * c] for r, c, _ in points]), np.array([t for *_, t in points]),
        rcond=None)[0]
    prefill = _timed(jax.jit(lambda m, i, a: generate(m, i, a, max_new_tokens=1)),
                     model, ids, mask, repeats=repeats)

    def step(rows, columns):  # the fit's seconds
        return fixed + per_row * rows + per_cell * rows * columns

    n, longest = len(lengths), max(lengths)
    live = [sum(length > t for length in lengths) for t in range(longest)]
    static = prefill + longest * step(n, width + longest)
    perfect = prefill + sum(step(k, width + t) for t, k in enumerate(live))
    return dict(step_fit_ms=dict(fixed=fixed * 1e3, a_row=per_row * 1e3,
                                 a_row_and_column=per_cell * 1e3),
                steps_ms={f"{r}x{c}": t * 1e3 for r, c, t in points}, prefill_s=prefill,
                generate_s=static, perfect_sampler_s=perfect, ratio=static / perfect,
                attention_share_of_generate_step=per_cell * n * (width + longest) / step(
                    n, width + longest))


def _each_prompt_run():
    from redray.post_training import Sampler

    class EachPromptRun(Sampler):
        """The Sampler with every slot's prompt run through the model on its own."""
        @staticmethod
        def _distinct(prompts):
            return prompts, np.arange(len(prompts))
    return EachPromptRun


def figures(prefix: str, suffix: str, per_s: dict, detail: dict, command: str,
            target: str | None) -> list[dict]:
    """``{prefix}/tokens_per_s_over_generate{suffix}`` and, where transformers ran,
    ``..._over_transformers{suffix}``."""
    where = detail["device"]
    batches = "one left-padded batch" if detail["prompts"] <= detail["slots"] else \
        f"left-padded batches of {detail['slots']}, each"
    out = [figure(
        f"{prefix}/tokens_per_s_over_generate{suffix}", per_s["sampler"] / per_s["generate"],
        "x", f"redray's generate: the {detail['prompts']} prompts as {batches} decoded to the "
        f"longest completion; same model, weights, device ({where}) and greedy tokens", target,
        command, **detail)]
    if "transformers" in per_s:
        out.append(figure(
            f"{prefix}/tokens_per_s_over_transformers{suffix}",
            per_s["sampler"] / per_s["transformers"], "x",
            "transformers' PyTorch generate (static cache, greedy) on the same weights and "
            f"batches, {detail['transformers_on']}", None, command, **detail))
    return out


def transformers_reference(model, config, batches, bf16: bool = False):
    """transformers' generate on the same weights and static ``batches`` ((ids, mask),
    new tokens), on the GPU where JAX and torch have one (else on every core), and
    where it runs, in words; or None without torch."""
    try:
        import torch
        from transformers import LlamaForCausalLM
    except ImportError:
        print("torch is not installed: no transformers reference (pip install -e '.[test]')")
        return None
    from redray.models import save_pretrained

    torch.set_num_threads(os.cpu_count())
    device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
    folder = tempfile.mkdtemp(prefix="sampler-bench-")
    save_pretrained(model, folder)
    dtype = torch.bfloat16 if bf16 else torch.float32
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).eval().to(device)
    on = [(torch.from_numpy(ids.astype(np.int64)).to(device),
           torch.from_numpy(mask.astype(np.int64)).to(device), n) for (ids, mask), n in batches]

    def run():
        with torch.no_grad():
            return [hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, cache_implementation="static",
                                pad_token_id=0).cpu() for ids, mask, n in on]
    return run, "the GPU" if device == "cuda" else f"{os.cpu_count()} torch threads"


if __name__ == "__main__":
    main()
