"""The parallelism plan, automatic tensor-parallel + FSDP specs, user overrides, placement.

Exported here is what users and the rest of redray call. The parts behind them:
``parallelism`` (the named axes, the mesh, the batch geometry, the spec passes),
``dataflow`` (tracing which parameter feeds which), ``rules`` (the spec passes),
``specs`` (whole pytrees), ``placement`` (bytes per device) and ``collectives`` (what a
compiled step communicates; import it as a module).

Never imports Ray: the in-host engine must stay testable alone.
"""

from redray.sharding.parallelism import (AXES, BATCH_AXES, CONTEXT, DATA, EXPERT, FSDP, MODEL,
                                         STAGE, PARAMETER_AXES, Axis, BatchGeometry, Parallelism,
                                         make_mesh)
from redray.sharding.plan import Plan
from redray.sharding.placement import Placement, format_placement, format_whole, placement
from redray.sharding.rules import Whole
from redray.sharding.specs import derive_specs, flatten, follow_specs, path_str, shardings

__all__ = ["AXES", "BATCH_AXES", "CONTEXT", "DATA", "EXPERT", "FSDP", "MODEL", "STAGE",
           "PARAMETER_AXES", "Axis", "BatchGeometry",
           "Parallelism", "Placement", "Plan", "Whole", "derive_specs", "flatten", "follow_specs",
           "format_placement", "format_whole", "make_mesh", "path_str", "placement", "shardings"]
