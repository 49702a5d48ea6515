"""redco 0.4.23's own compiled training step, for benchmarks/communication.py; runs
inside redco's venv.

Sets a model of benchmarks/_redco_models.py up the way redco's tutorials do
(``Deployer`` -> ``model.init`` -> ``deployer.get_sharding_rules`` -> ``Trainer``),
takes the first batch redco itself makes of the given examples, lowers and compiles
redco's training step (``Trainer._p_train_step``: its ``default_train_step`` under
``pjit`` with its state specs) and writes the compiled HLO text to stdout; redray's
side counts its collectives.

    .venv-redco/bin/python -P benchmarks/_redco_step.py < request.json > step.hlo

The request: {"case": "separate_qkv" | "dense12", "model_shards": N, "sizes": {...},
"batch": B, "examples": [...]} (examples as lists of ints or floats).
"""

import dataclasses
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(HERE)  # after site-packages: benchmarks/redco.py must not shadow redco

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import redco  # noqa: E402

from _redco_models import DenseStack, SeparateLM, collate, loss_of  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Sizes:
    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    batch: int
    seq: int


def setup(request: dict):
    """(module, examples, example input) of the request."""
    if request["case"] == "separate_qkv":
        s = Sizes(**request["sizes"])
        examples = [{"ids": np.asarray(e["ids"], np.int32)} for e in request["examples"]]
        return SeparateLM(s, hf_names=True), examples, np.zeros((1, s.seq), np.int32)
    m = request["sizes"]
    examples = [{"x": np.asarray(e["x"], np.float32), "label": np.int32(e["label"])}
                for e in request["examples"]]
    return (DenseStack(m["width"], m["classes"], m["depth"]), examples,
            np.zeros((1, m["inputs"]), np.float32))


def main() -> None:
    request = json.load(sys.stdin)
    module, examples, example_input = setup(request)
    deployer = redco.Deployer(jax_seed=0, n_model_shards=request["model_shards"], verbose=False)
    params = module.init(deployer.gen_rng(), example_input)["params"]
    rules = deployer.get_sharding_rules(params_shape_or_params=params)

    def loss_fn(rng, state, params, batch, is_training):
        return loss_of(lambda x: state.apply_fn({"params": params}, x), batch)

    trainer = redco.Trainer(deployer=deployer, collate_fn=collate, apply_fn=module.apply,
                            loss_fn=loss_fn, params=params, optimizer=optax.adam(1e-3),
                            params_sharding_rules=rules)
    per_device = request["batch"] // (jax.device_count() // request["model_shards"])
    batch = next(iter(deployer.get_model_input_batches(
        examples=examples, per_device_batch_size=per_device, collate_fn=collate,
        shuffle=False, shuffle_rng=deployer.gen_rng(), desc="", is_train=True)))
    trainer.setup_running_step(dummy_batch=batch)
    with deployer.mesh:
        compiled = trainer._p_train_step.lower(deployer.gen_model_step_rng(), trainer.state,
                                               batch).compile()
    sys.stdout.write(compiled.as_text())


if __name__ == "__main__":
    main()
