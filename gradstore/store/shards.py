"""How a DTensor gradient row relates to the whole tensor: the words the readers put beside a norm that is one
rank's piece (a shard or a Partial term), so that it is never shown as the norm of the parameter or of the
gradient it belongs to. Plain strings in, plain strings out (the rows' `placements` and `global_shape` columns):
no PyTorch, no collective.
"""

from __future__ import annotations

import pandas as pd


def _text(v) -> str | None:
    if v is None or (isinstance(v, float) and pd.isna(v)) or v is pd.NA:
        return None
    return str(v)


def is_piece(placements) -> bool:
    """True where a row with these placements holds one rank's piece of the tensor, not all of it: a Shard or
    _StridedShard dimension (its elements are a region) or a Partial one (its elements are one term of a
    reduction). A Replicate-only DTensor and a plain tensor (None) hold the whole tensor."""
    p = _text(placements)
    return p is not None and ("Shard(" in p or "Partial(" in p)


def piece_label(placements, global_shape) -> str | None:
    """'this rank's shard, (Shard(dim=0),) of 3,6' (or '... Partial(sum) term ...'); None where the row holds the
    whole tensor (plain, or Replicate on every mesh dimension)."""
    if not is_piece(placements):
        return None
    p = _text(placements)
    kind = "shard" if "Shard(" in p else "term"
    if "Shard(" in p and "Partial(" in p:
        kind = "shard of a term"
    shape = _text(global_shape)
    return f"this rank's {kind}, {p} of ({shape if shape is not None else '?'})"


def is_copy(placements) -> bool:
    """True where a row with these placements is a DTensor that holds the whole tensor as one of the ranks' copies
    (Replicate on every mesh dimension); False for a plain tensor (None) and for a piece (`is_piece`)."""
    return _text(placements) is not None and not is_piece(placements)


def copy_label(placements, global_shape) -> str | None:
    """'this rank's copy, (Replicate(),) of (8)': the words for a row that `is_copy`, one of the ranks' copies,
    which agree only where every rank computed or reduced it alike; None for a plain tensor and for a piece
    (`piece_label`)."""
    if not is_copy(placements):
        return None
    p = _text(placements)
    shape = _text(global_shape)
    return f"this rank's copy, {p} of ({shape if shape is not None else '?'})"
