"""The former home of the cross-block rewrite (now normfuse/passes/cross_block/), kept so
that saved models load.

A model pickled by normfuse 0.1.0 while its streams were rewritten names objects of the
rewrite by this module's path: the stream it shares between its modules (``_Stream``), the
owner's and the final norm's hooks, and the swapped classes of its blocks and final norm
(``_nf_swapped_<hex>``, rebuilt by ``__getattr__`` below). pickle looks each of them up
here, so each name must stay. Code imports normfuse.passes.cross_block instead; models
pickled since name that package's modules. normfuse/legacy.py lists every path 0.1.0
pickles name.
"""

# every name a saved model may give (and the public ones, for code written against this path)
from normfuse.passes.cross_block import (ResidualPair, StreamRewrite, crosses_checkpoints, rewrite_streams,
                                         rewritten_streams, undo_streams)
from normfuse.passes.cross_block.classes import _SWAPPED_PREFIX, _rebuilt_class
from normfuse.passes.cross_block.runtime import (_add_pair_first, _enter_owner, _leave_owner,  # noqa: F401
                                                 _Stream, _StreamElement)

__all__ = ["ResidualPair", "StreamRewrite", "crosses_checkpoints", "rewrite_streams", "rewritten_streams",
           "undo_streams"]


def __getattr__(name: str):
    # the swapped classes of those models, named by how to build them again
    if not name.startswith(_SWAPPED_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _rebuilt_class(name)
