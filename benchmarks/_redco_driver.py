"""redco 0.4.23's side of benchmarks/redco.py; runs inside redco's own venv.

Trains a model of benchmarks/_redco_models.py the way redco's tutorials do
(``Deployer`` -> ``model.init`` -> ``deployer.get_sharding_rules`` -> ``Trainer`` ->
``trainer.fit``) and prints one JSON line: the seconds from the first line of set-up
to the end of the first epoch, each later epoch's seconds, and the last loss, for
each configuration given (a JSON list; benchmarks/redco.py writes it).

    .venv-redco/bin/python benchmarks/_redco_driver.py '[{"task": "mlp", ...}]'
"""

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# benchmarks/redco.py would shadow the redco package: look in this folder last.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE] + [HERE]

import jax  # noqa: E402
import optax  # noqa: E402
import redco  # noqa: E402

from _redco_models import collate, loss_of, task  # noqa: E402


def main(config: dict) -> dict:
    module, examples, example_input = task(config)
    start = time.perf_counter()
    deployer = redco.Deployer(jax_seed=config["seed"], n_model_shards=config["model_axis"],
                              verbose=False)
    params = module.init(deployer.gen_rng(), example_input)["params"]
    rules = deployer.get_sharding_rules(params_shape_or_params=params)

    def loss_fn(rng, state, params, batch, is_training):
        return loss_of(lambda x: state.apply_fn({"params": params}, x), batch)

    trainer = redco.Trainer(deployer=deployer, collate_fn=collate,
                            apply_fn=module.apply, loss_fn=loss_fn, params=params,
                            optimizer=optax.adam(config["learning_rate"]),
                            params_sharding_rules=rules)

    def epoch():
        trainer.fit(train_examples=examples, n_epochs=1,
                    per_device_batch_size=config["per_device_batch"])
        jax.block_until_ready(trainer.state.params)

    epoch()
    first = time.perf_counter() - start
    times, cpu = [], []
    for _ in range(config["epochs"]):
        t, c = time.perf_counter(), time.process_time()
        epoch()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    batch = collate(examples[:256])
    last = float(jax.jit(lambda p: loss_fn(None, trainer.state, p, batch, False))(
        jax.device_get(jax.tree.map(lambda x: x[0] if config["model_axis"] == 1 else x,
                                    trainer.state.params))))
    return {"first_epoch_s": first, "epoch_s": times, "epoch_cpu_s": cpu, "loss": last,
            "steps_per_epoch": len(examples) // (config["per_device_batch"]
                                                  * (jax.device_count() // config["model_axis"]))}


if __name__ == "__main__":
    print(json.dumps([main(config) for config in json.loads(sys.argv[1])]))
