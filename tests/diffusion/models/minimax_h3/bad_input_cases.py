# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Bad input on one rank, as one table for the thread-rank tests and the gloo-rank tests.

Each case spoils what rank ``BAD_RANK`` passes to the gather (its share, its ``num_tiles``, or both);
the other ranks pass good input. Every rank must raise the same error, and the next good gather must work.
Some cases fail on that rank before the exchange (a share that is no list, a copy-in that raises): the
others must hear of it, not wait for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .stand_ins import make_share, make_tile

WORLD = 4
BAD_RANK = 2
NUM_TILES = 9  # rank 2 owns tiles 2 and 6
SHAPE = (3, 2, 4, 4)


@dataclass(frozen=True)
class BadInput:
    id: str
    spoil: Callable[[list[torch.Tensor], int], tuple[list[Any], Any]]  # (good share, num_tiles) -> bad ones
    pattern: str
    every_rank: bool = False  # spoil every rank's input, not only BAD_RANK's
    kind: str = "ValueError"


def _other_tile(index: int, **kwargs: Any) -> torch.Tensor:
    return make_tile(index, **{"shape": SHAPE, **kwargs})


class CopyInFails(torch.Tensor):
    """A tile whose copy into the workspace raises: a local failure after the workspace is in hand."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.stack:
            raise RuntimeError("injected: the copy-in failed")
        return super().__torch_function__(func, types, args, kwargs or {})


_BEFORE_THE_EXCHANGE = r"rank\(s\) \[2\] failed before the exchange; the cause is in their traceback"


CASES = (
    BadInput("extra-tile", lambda s, n: (s + [_other_tile(99)], n), r"rank 2 holds 3 tile\(s\)"),
    BadInput("empty-share", lambda s, n: ([], n), r"rank 2 holds 0 tile\(s\)"),
    BadInput("missing-tile", lambda s, n: (s[:1], n), r"rank 2 holds 1 tile\(s\)"),
    BadInput(
        "mixed-shapes-in-share",
        lambda s, n: ([s[0], _other_tile(6, shape=(3, 2, 4, 5))], n),
        r"rank\(s\) \[2\] hold tiles that are not tensors of one shape, dtype and device",
    ),
    BadInput(
        "mixed-dtypes-in-share",
        lambda s, n: ([s[0], s[1].to(torch.bfloat16)], n),
        r"rank\(s\) \[2\] hold tiles that are not tensors of one shape",
    ),
    BadInput(
        "mixed-devices-in-share",
        lambda s, n: ([s[0], s[1].to("meta")], n),
        r"rank\(s\) \[2\] hold tiles that are not tensors of one shape",
    ),
    BadInput("not-a-tensor", lambda s, n: ([s[0], "tile"], n), r"rank\(s\) \[2\] hold tiles that are not tensors"),
    BadInput(
        "unsupported-dtype",
        lambda s, n: ([t.to(torch.int64) for t in s], n),
        r"rank\(s\) \[2\] hold tiles of a dtype other than",
    ),
    BadInput(
        "more-than-8-dims",
        lambda s, n: ([t.reshape(1, 1, 1, 1, 1, *SHAPE) for t in s], n),
        r"rank\(s\) \[2\] hold tiles .*, of more than 8 dims",
    ),
    BadInput(
        "dtype-differs-across-ranks",
        lambda s, n: ([t.to(torch.bfloat16) for t in s], n),
        r"different dtypes or shapes \['torch.float32\[3, 2, 4, 4\]', 'torch.float32\[3, 2, 4, 4\]', "
        r"'torch.bfloat16\[3, 2, 4, 4\]'.*VLLM_OMNI_H3_VAE_GATHER_REUSE=0",
    ),
    BadInput(
        "shape-differs-across-ranks",
        lambda s, n: ([_other_tile(g, shape=(3, 2, 4, 8)) for g in (2, 6)], n),
        r"different dtypes or shapes .*'torch.float32\[3, 2, 4, 8\]'",
    ),
    BadInput("num-tiles-differs-across-ranks", lambda s, n: (s, n + 1), r"num_tiles per rank \[9, 9, 10, 9\]"),
    BadInput("num-tiles-a-string", lambda s, n: (s, str(n)), r"num_tiles per rank \[9, 9, -1, 9\] \(-1: not an int"),
    BadInput("num-tiles-a-float", lambda s, n: (s, float(n)), r"num_tiles per rank \[9, 9, -1, 9\]"),
    BadInput("num-tiles-a-bool", lambda s, n: (s, True), r"num_tiles per rank \[9, 9, -1, 9\]"),
    BadInput(
        "tiles-on-another-device-type",
        lambda s, n: ([t.to("meta") for t in s], n),
        r"tiles on different device types \['cpu', 'cpu', 'meta', 'cpu'\]",
    ),
    BadInput("share-not-a-list", lambda s, n: (None, n), _BEFORE_THE_EXCHANGE, kind="RuntimeError"),
    BadInput(
        "copy-in-raises",
        lambda s, n: ([t.as_subclass(CopyInFails) for t in s], n),
        _BEFORE_THE_EXCHANGE,
        kind="RuntimeError",
    ),
    BadInput(
        "num-tiles-below-sp-size",
        lambda s, n: (make_share(0, 1, 3, shape=SHAPE)[:1], 3),
        r"num_tiles per rank \[3, 3, 3, 3\].*expected one int >= sp_size",
        every_rank=True,
    ),
)


def inputs_for(case: BadInput, rank: int) -> tuple[list[Any], Any]:
    """What ``rank`` passes to the gather in ``case``."""
    share = make_share(rank, WORLD, NUM_TILES, shape=SHAPE)
    if rank == BAD_RANK or case.every_rank:
        return case.spoil(share, NUM_TILES)
    return share, NUM_TILES
