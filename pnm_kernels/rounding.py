"""Compressed optimizer state: where its random bits come from and how a value is rounded
with them (docs/design.md §7). The ground truth, in torch ops: pnm_kernels/reference.py
rounds with these functions, and every kernel computes the same bits.

The random bits are counter-based, not drawn from a generator: a hash of the parameter's
seed (state["seed"]), its step and the element's index in the whole, unsharded parameter. So
a step is reproducible, capturable in a CUDA graph, the same on every backend, and the same
whether the parameter is sharded along dim 0 (FSDP2) or not.

    key(seed, t, hi) = mix32(seed ^ mix32(t ^ mix32(hi + GOLDEN)))
    hash(i)          = mix32(lo ^ key(seed, t, hi))

with i = hi * 2^32 + lo, t the step after its increment, modulo 2^32, and mix32 the
xorshift-multiply hash "lowbias32" (C. Wellons' hash-prospector), all in uint32 arithmetic.
One hash an element a step: its high 16 bits round the momentum buffer the step writes, its
low 16 bits the second moment and, with the same bits, its running maximum (so that a stored
maximum taken from the new second moment equals the stored second moment); a bfloat16
parameter (bf16_stochastic_round) the low 16 bits of mix32(hash).

Stochastic rounding of an fp32 value x to bf16: (bits(x) + 16 random bits) with its low 16
bits cleared (a carry out of the mantissa rounds up to the next binade, or to inf past the
largest bf16; an infinity stays itself); NaN becomes 0x7FC0, as c10 writes it (not through
torch's conversion, whose NaN follows the machine: 0xFFFF on an AVX-512 CPU). So x rounds up
with probability (x - down) / (up - down): unbiased, where round-to-nearest lets an average
with a small update (b1 = 0.999) stall at a fraction of its value.
"""
import torch

from .layout import is_dense

GOLDEN = 0x9E3779B9
MIX_MUL_1 = 0x21F0AAAD
MIX_MUL_2 = 0xD35A2D97
_LOW32 = 0xFFFFFFFF
BF16_NAN_BITS = 0x7FC0

# Which 16 bits of an element's hash round each buffer (the shift that brings them down).
HASH_SHIFT = {"pos_momentum": 16, "neg_momentum": 16, "exp_avg": 16, "neg_exp_avg": 16,
              "exp_avg_sq": 0, "max_exp_avg_sq": 0}
# A bfloat16 parameter (bf16_stochastic_round) rounds with the low 16 bits of mix32(hash): a
# hash of its own, as AdaPNM's buffers take both halves of the first.
PARAM_SHIFT = -1


def mix32_int(x: int) -> int:
    """mix32 of a Python int (host-side keys)."""
    x &= _LOW32
    x ^= x >> 16
    x = (x * MIX_MUL_1) & _LOW32
    x ^= x >> 15
    x = (x * MIX_MUL_2) & _LOW32
    return x ^ (x >> 15)


def _mul_low32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 tensors holding uint32 values: in 16-bit halves of c, so
    that no int64 product overflows."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _LOW32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """mix32 elementwise over an int64 tensor of uint32 values."""
    x = x ^ (x >> 16)
    x = _mul_low32(x, MIX_MUL_1)
    x = x ^ (x >> 15)
    x = _mul_low32(x, MIX_MUL_2)
    return x ^ (x >> 15)


def element_index(buffer: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Each element's index in the whole parameter, as an int64 tensor shaped like the
    buffer: its position in the buffer's dense memory order (row-major for a contiguous
    tensor; for one with gaps or overlaps, which the kernels step as a dense copy, row-major)
    plus `offset`, the elements before this shard (FSDP2's dim-0 shards)."""
    count = torch.arange(buffer.numel(), dtype=torch.int64, device=buffer.device)
    if not is_dense(buffer):
        return count.reshape(buffer.shape) + offset
    return torch.as_strided(count, buffer.shape, buffer.stride()) + offset


def element_hash(seed, step, index: torch.Tensor) -> torch.Tensor:
    """Each element's 32-bit hash (int64 tensor in [0, 2^32)). `seed` and `step` are ints or
    int64 tensors (a traced step reads them on the device)."""
    hi, lo = index >> 32, index & _LOW32
    key = mix32((hi + GOLDEN) & _LOW32)
    key = mix32(key ^ (step & _LOW32))
    key = mix32(key ^ (seed & _LOW32))
    return mix32(lo ^ key)


def random_bits(seed, step, shift: int, index: torch.Tensor) -> torch.Tensor:
    """The 16 random bits that round a buffer (HASH_SHIFT) or, with PARAM_SHIFT, a bfloat16
    parameter at each element: in [0, 2^16)."""
    return bits_from_hash(element_hash(seed, step, index), shift)


def bits_from_hash(hashes: torch.Tensor, shift: int) -> torch.Tensor:
    if shift == PARAM_SHIFT:
        return mix32(hashes) & 0xFFFF
    return (hashes >> shift) & 0xFFFF


def round_bf16_stochastic(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """x (float32) rounded to bfloat16 with these random bits (see the module's docstring)."""
    u = x.view(torch.int32).to(torch.int64) & _LOW32
    rounded = ((u + bits) & 0xFFFF0000) >> 16  # in [0, 2^16): the bf16's bit pattern
    rounded = torch.where(torch.isnan(x), BF16_NAN_BITS, rounded)
    as_int16 = torch.where(rounded >= 0x8000, rounded - 0x10000, rounded).to(torch.int16)
    return as_int16.view(torch.bfloat16)


def store_stochastic(buffer: torch.Tensor, value: torch.Tensor, *, seed: int, step: int,
                     shift: int, offset: int = 0) -> None:
    """buffer (bfloat16) = value (float32), rounded stochastically with the bits of this
    seed and step (those `shift` picks) at each element's index."""
    bits = random_bits(seed, step, shift, element_index(buffer, offset))
    buffer.copy_(round_bf16_stochastic(value.float(), bits))


__all__ = ["HASH_SHIFT", "PARAM_SHIFT", "bits_from_hash", "mix32", "mix32_int", "element_index", "element_hash", "random_bits",
           "round_bf16_stochastic", "store_stochastic"]
