"""Schedule primitives: one file per primitive, each a `Primitive` class (validate, apply,
record), imported here explicitly. `BUILTIN` lists them in the order `list_primitives()`
shows; `methods.PrimitiveMethods` (generated from them) gives every `Schedule` node one typed
method per primitive, so `sch.shard` has a `def` an editor and `help()` find.
"""

from .annotate import AnnotatePrimitive
from .base import Primitive, get_primitive, list_primitives, register_primitive
from .checkpoint import CheckpointPrimitive
from .compile import CompilePrimitive
from .cut_pipeline_stage import CutPipelineStagePrimitive
from .decompose import DecomposePrimitive
from .find import FindPrimitive
from .fork_rng import ForkRNGPrimitive
from .fuse import FusePrimitive
from .offload import OffloadPrimitive
from .reduce_param_grads import ReduceParamGradsPrimitive
from .replace import ReplacePrimitive
from .set_attr import SetAttrPrimitive
from .shard import ShardPrimitive
from .sync import SyncPrimitive
from .sync_batchnorm import SyncBatchNormPrimitive
from .trace import TracePrimitive

BUILTIN: tuple[type[Primitive], ...] = (
    AnnotatePrimitive, CheckpointPrimitive, CompilePrimitive, CutPipelineStagePrimitive,
    DecomposePrimitive, FindPrimitive, ForkRNGPrimitive, FusePrimitive, OffloadPrimitive,
    ReduceParamGradsPrimitive, ReplacePrimitive, SetAttrPrimitive, ShardPrimitive,
    SyncPrimitive, SyncBatchNormPrimitive, TracePrimitive)

__all__ = ["BUILTIN", "Primitive", "get_primitive", "list_primitives", "register_primitive"]
