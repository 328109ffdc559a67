"""Stand-in (see flash_attn/__init__.py): every function raises if called."""
from . import _unavailable

index_first_axis = _unavailable("bert_padding.index_first_axis")
pad_input = _unavailable("bert_padding.pad_input")
rearrange = _unavailable("bert_padding.rearrange")
unpad_input = _unavailable("bert_padding.unpad_input")
