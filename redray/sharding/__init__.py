"""Mesh, automatic tensor-parallel + FSDP specs, user overrides, and the plan.

Never imports Ray: the in-host engine must stay testable alone.
"""

from redray.sharding.dataflow import Trace, Use, trace
from redray.sharding.mesh import (AXES, BATCH_AXES, batch_sharding, data_parallel_size,
                                  make_mesh)
from redray.sharding.plan import PlanRow, format_plan, plan
from redray.sharding.rules import partition_specs
from redray.sharding.specs import derive_specs, flatten, follow_specs, path_str, shardings

__all__ = ["AXES", "BATCH_AXES", "PlanRow", "Trace", "Use", "batch_sharding",
           "data_parallel_size", "derive_specs", "flatten", "follow_specs", "format_plan",
           "make_mesh", "partition_specs", "path_str", "plan", "shardings", "trace"]
