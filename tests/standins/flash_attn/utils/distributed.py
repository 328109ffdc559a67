"""Stand-in (see flash_attn/__init__.py): every function raises if called."""
from .. import _unavailable

all_gather = _unavailable("utils.distributed.all_gather")
