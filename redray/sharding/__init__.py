"""Mesh, automatic tensor-parallel + FSDP specs, user overrides, and placement.

Exported here is what users and the rest of redray call. The parts behind them:
``dataflow`` (tracing which parameter feeds which), ``rules`` (specs from that trace),
``specs`` (whole pytrees), ``mesh``, ``placement`` (bytes per device) and
``collectives`` (what a compiled step communicates; import it as a module).

Never imports Ray: the in-host engine must stay testable alone.
"""

from redray.sharding.mesh import (AXES, BATCH_AXES, batch_sharding, data_parallel_size,
                                  make_mesh)
from redray.sharding.placement import Placement, format_placement, format_whole, placement
from redray.sharding.rules import Whole
from redray.sharding.specs import derive_specs, flatten, follow_specs, path_str, shardings

__all__ = ["AXES", "BATCH_AXES", "Placement", "Whole", "batch_sharding",
           "data_parallel_size", "derive_specs", "flatten", "follow_specs", "format_placement",
           "format_whole", "make_mesh", "path_str", "placement", "shardings"]
