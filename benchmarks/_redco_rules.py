"""redco 0.4.23's sharding rules for a parameter tree; runs inside redco's own venv.

Reads {"model_shards": N, "params": {"a/b/kernel": [shape...], ...}} as JSON on stdin,
asks redco how it would shard that tree (``get_sharding_rules`` then
``get_params_spec``, the calls its ``Deployer`` makes) and writes
{"a/b/kernel": [entry per dimension, null or "model"], ...} as JSON on stdout.
redco names its model axis "mp"; it is written as redray's "model".

    .venv-redco/bin/python -P benchmarks/_redco_rules.py < tree.json > specs.json

(``-P`` keeps benchmarks/ off the path: benchmarks/redco.py would shadow redco.)
"""

import json
import sys

import jax

# redco 0.4.23 was written against a jax that still had these aliases (0.10 removed them).
for _name, _new in (("tree_map", jax.tree.map), ("tree_leaves", jax.tree.leaves),
                    ("tree_structure", jax.tree.structure)):
    if not hasattr(jax, _name):
        setattr(jax, _name, _new)

from flax.traverse_util import flatten_dict  # noqa: E402
from redco.deployers.partition_utils import get_params_spec, get_sharding_rules  # noqa: E402


def main() -> None:
    request = json.load(sys.stdin)
    tree: dict = {}
    for path, shape in request["params"].items():
        node = tree
        *parents, leaf = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = jax.ShapeDtypeStruct(tuple(shape), "float32")
    rules = get_sharding_rules(tree, n_model_shards=request["model_shards"])
    specs = flatten_dict(dict(get_params_spec(tree, rules)))
    json.dump({"/".join(key): [None if e is None else "model" if e == "mp" else e
                               for e in spec] for key, spec in specs.items()}, sys.stdout)


if __name__ == "__main__":
    main()
