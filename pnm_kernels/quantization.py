"""int8 optimizer state (state_dtype=torch.int8, docs/design.md §8): block-wise quantised codes,
one float32 scale per block, codes written with stochastic rounding. The ground truth, in
torch ops: reference.py stores and loads int8 state with these functions.

Layout. A parameter with at least two dimensions is a stack of rows (its dim-0 slices, of
numel / shape[0] elements each, in row-major order); each row is cut into blocks of BLOCK
elements, its last block shorter where BLOCK does not divide the row. A block never crosses a
row, so FSDP2's dim-0 shards (uneven ones too) hold whole blocks, and a sharded run quantises
exactly as one process does. The scales form a (shape[0], blocks per row) float32 tensor,
sharded along dim 0 with its parameter. A parameter whose rows are shorter than a block
(biases, norms' weights: one-element rows) keeps bfloat16 state instead (stochastic rounding
too); so does one of no elements.

Map. A code c stands for sign(c) * (|c| / cmax)^POWER * scale, with scale the block's largest
magnitude: momenta in signed codes (int8, cmax 127), second moments in unsigned ones (uint8,
cmax 255). The power spends the codes where the values are: near zero. Chosen by measurement
(docs/performance.md, "int8 state"): POWER 2 for momenta, 4 for second moments, BLOCK 128.

Rounding. A value x in [lo, hi], between two neighbouring codes' values, is stored as hi with
probability (x - lo) / (hi - lo) (to within 2^-16), decided by 16 random bits (those
rounding.py gives the buffer's bfloat16): unbiased. A step writes the buffers it changes;
the momentum it only reads keeps its codes. A block whose largest magnitude is 0 stores zeros; one holding
a non-finite value stores scale NaN (the whole block reads NaN: GradScaler's skipped steps
never write one). A block whose scale is subnormal (below 2^-126, where 1 / scale overflows)
is encoded at 2^24 times its values and scale, which is exact: its codes are those of the
same values in a normal range.
"""
import math
from typing import Optional

import torch

BLOCK = 128
SIGNED_MAX = 127    # momenta: int8 codes in [-127, 127]
UNSIGNED_MAX = 255  # second moments: uint8 codes in [0, 255]
MOMENTUM_POWER = 2
SECOND_MOMENT_POWER = 4
# Which buffers hold signed codes (momenta) and which unsigned (second moments).
SIGNED = {"pos_momentum": True, "neg_momentum": True, "exp_avg": True, "neg_exp_avg": True,
          "exp_avg_sq": False, "max_exp_avg_sq": False}
# A checkpoint's float state converted into codes, and codes read back into another dtype,
# round to nearest: random bits fixed at one half.
NEAREST_BITS = 0x8000
# Blocks of a scale below the smallest normal float32 are encoded lifted by this power of two.
SMALLEST_NORMAL = 2.0 ** -126
SUBNORMAL_LIFT = 2.0 ** 24


def scale_name(name: str) -> str:
    """The state key of a buffer's scales."""
    return name + "_scale"


def row_length(shape: torch.Size) -> Optional[int]:
    """The length of a parameter's rows where it keeps int8 state, else None (bfloat16).
    The whole parameter's shape (a DTensor's), not a shard's: a shard may hold no rows."""
    if len(shape) < 2 or shape[0] == 0:
        return None
    length = shape.numel() // shape[0]
    return length if length >= BLOCK else None


def blocks_per_row(length: int) -> int:
    return -(-length // BLOCK)


def scales_shape(shape: torch.Size) -> tuple[int, int]:
    """The shape of the scales of a parameter of this shape that keeps int8 state."""
    length = row_length(shape)
    assert length is not None
    return shape[0], blocks_per_row(length)


def code_dtype(name: str) -> torch.dtype:
    return torch.int8 if SIGNED[name] else torch.uint8


def _code_max_and_power(signed: bool) -> tuple[int, int]:
    return (SIGNED_MAX, MOMENTUM_POWER) if signed else (UNSIGNED_MAX, SECOND_MOMENT_POWER)


def row_length_of(x: torch.Tensor) -> int:
    """The length of the rows of x (a parameter, a shard of one, or a buffer shaped like
    it): from its shape, as a shard may hold no rows."""
    return math.prod(x.shape[1:])


def _as_rows(x: torch.Tensor, length: int) -> torch.Tensor:
    """x (a parameter's shape) as (rows, length); a shard may hold no rows (FSDP2's of a
    parameter with fewer rows than ranks), which a -1 in the shape cannot say."""
    return x.reshape(x.shape[0], length)


def _blocks(x: torch.Tensor, length: int) -> torch.Tensor:
    """x (rows of `length`) as (rows, blocks, BLOCK), zero-padded at row ends."""
    rows = _as_rows(x, length)
    pad = blocks_per_row(length) * BLOCK - length
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    return rows.reshape(rows.shape[0], blocks_per_row(length), BLOCK)


def _per_element(scales: torch.Tensor, length: int) -> torch.Tensor:
    """Each element's block scale, as (rows, length). Indexed, not expanded: inductor
    (torch 2.14) fused an expanded, reshaped and sliced scale tensor into a product with
    the wrong indices past the first block of each row."""
    block_of = torch.arange(length, device=scales.device) // BLOCK
    return scales.float()[:, block_of]


def _magnitude(code: torch.Tensor, cmax: int, power: int) -> torch.Tensor:
    """(code / cmax)^power (power 1, 2 or 4) in float32, multiplied out as kernels do it."""
    t = code.float() * (1.0 / cmax)  # a product, as vector units do it cheaply
    if power >= 2:
        t = t * t
    return t * t if power == 4 else t


def dequantize(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    """The float32 values of a buffer's codes (shaped like them)."""
    cmax, power = _code_max_and_power(signed)
    length = row_length_of(codes)
    c = _as_rows(codes.contiguous(), length).to(torch.int32)
    value = _magnitude(c.abs(), cmax, power) * _per_element(scales, length)
    if signed:
        value = torch.where(c < 0, -value, value)
    return value.reshape(codes.shape)


def quantize(x: torch.Tensor, bits, signed: bool):
    """(codes, scales) for float32 values x (a parameter's shape), each code rounded up with
    probability given by its 16 random bits `bits` (int64 in [0, 2^16), shaped like x, or a
    number: NEAREST_BITS rounds to nearest); see the module's docstring."""
    cmax, power = _code_max_and_power(signed)
    length = row_length_of(x)
    rows = _as_rows(x.float().contiguous(), length)
    magnitude = rows.abs()
    block_scales = _blocks(magnitude, length).amax(dim=-1)
    finite = torch.isfinite(block_scales)
    if not signed:  # a negative second moment: NaN too
        finite &= _blocks(rows, length).amin(dim=-1) >= 0
    block_scales = torch.where(finite, block_scales, torch.full_like(block_scales, float("nan")))
    lift = torch.ones_like(block_scales).masked_fill(block_scales < SMALLEST_NORMAL,
                                                     SUBNORMAL_LIFT)  # 1 for NaN
    inverse = _per_element(1.0 / (block_scales * lift), length)  # one division a block
    # In [0, 1]; NaN where the block is all zeros or not finite.
    a = (magnitude * _per_element(lift, length)) * inverse
    root = torch.sqrt(a) if power >= 2 else a
    if power == 4:
        root = torch.sqrt(root)
    low = torch.floor(root * cmax).clamp_(0, cmax - 1)
    low = torch.where(torch.isnan(low), torch.zeros_like(low), low)
    below, above = _magnitude(low, cmax, power), _magnitude(low + 1, cmax, power)
    if torch.is_tensor(bits):
        bits = _as_rows(bits, length)
    # Up with probability (a - below) / (above - below), compared without the division:
    # u (above - below) < a - below. False where a is NaN.
    up = (bits * (1.0 / 65536)) * (above - below) < a - below
    code = (low + up.float()).to(torch.int32)
    if signed:
        code = torch.where(rows < 0, -code, code)
    codes = code.reshape(x.shape).to(code_dtype_for(signed))
    return codes, block_scales


def code_dtype_for(signed: bool) -> torch.dtype:
    return torch.int8 if signed else torch.uint8


__all__ = ["BLOCK", "SIGNED", "NEAREST_BITS", "scale_name", "row_length", "row_length_of",
           "scales_shape",
           "code_dtype", "dequantize", "quantize"]
